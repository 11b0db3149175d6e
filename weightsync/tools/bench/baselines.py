"""The bench's baselines: what weightsync's cases are measured against, outside weightsync.

Ray's floor (a colocated sync's calls doing nothing), one raw gloo broadcast of the model's
bytes and one broadcast per tensor, the reference design (one slot, a Ray round trip per
chunk), one CUDA IPC handle per tensor, and the Ray object store. Each runs through the
driver's :meth:`~weightsync.tools.bench.driver.Bench.timed`, as weightsync's cases do.
"""

from __future__ import annotations

import time
from typing import Any

import weightsync.tools.bench.probes as probes
from weightsync.core.wire.settings import MIB
from weightsync.tools.bench.report import Case
from weightsync.tools.bench.sharded import Timer


def ray_floor_case(bench: Timer, size: str, trainer: Any, worker: Any, nbytes: int, copy_s: float) -> None:
    """The hand-off floor: a colocated sync's shape (one call per side, started
    together, waited for once), doing nothing; then the same with calls as long as one
    raw copy, from 1 ms up: Ray was measured to return a call that lasted a while
    later than a no-op (docs/benchmarks.md), so a sync's time minus the copy and this
    second row is what weightsync itself adds."""

    def one() -> None:
        bench.get([worker.call.remote(probes.nothing), trainer.call.remote(probes.nothing)])

    bench.timed(
        Case(size, "ray floor: one no-op call per side", nbytes, note="what any sync pays for Ray"),
        one,
        [trainer, worker],
    )
    if copy_s < 1e-3:
        return

    def long() -> float:
        start = time.perf_counter()
        bench.get([worker.call.remote(probes.polling, copy_s), trainer.call.remote(probes.polling, copy_s)])
        return time.perf_counter() - start - copy_s

    bench.timed(
        Case(size, "ray floor: calls as long as a copy", nbytes, note="Ray's share, the copy's length taken off"),
        long,
        [trainer, worker],
    )


def reference_case(
    bench: Timer, size: str, trainer: Any, worker: Any, nbytes: int, copy_s: float, buffer_mib: int
) -> None:
    """The reference design: one slot, pack then consume, a Ray round trip each, per chunk."""
    from weightsync.glue.coordinator import WeightSync

    base = bench.memory_base([trainer, worker])
    ws = WeightSync(
        trainer, [worker], transport="ipc", buffer_bytes=buffer_mib * MIB, num_buffers=1, timeout_s=bench.timeout_s
    )
    manifest = ws.setup()

    def one() -> None:
        for chunk in manifest.chunks:
            handle = bench.get(trainer.pack_chunk.remote(chunk.index, 0, ws.label))
            bench.get(worker.consume_chunk.remote(handle))

    bench.timed(
        Case(
            size,
            "reference: 1 slot, serialized via Ray",
            nbytes,
            buffer_mib,
            1,
            limit_s=copy_s,
            note=f"{len(manifest.chunks)} chunks",
        ),
        one,
        [trainer, worker],
        base,
    )
    ws.close()


def gloo_case(
    bench: Timer, size: str, trainer: Any, workers: list[Any], nbytes: int, per_tensor: bool, limit: float | None = None
) -> float:
    """One gloo broadcast of the model's bytes in one buffer (the raw limit of broadcast,
    returned), or of every tensor in turn (the per-tensor baseline)."""
    world = len(workers) + 1
    port = bench.get(trainer.call.remote(probes.gloo_open_store, "127.0.0.1", world, bench.timeout_s))
    bench.get(
        [trainer.call.remote(probes.gloo_join_root, "127.0.0.1", world, bench.timeout_s)]
        + [
            w.call.remote(probes.gloo_join, "127.0.0.1", port, r, world, bench.timeout_s)
            for r, w in enumerate(workers, start=1)
        ]
    )

    def one() -> None:
        bench.get(
            [p.call.remote(probes.gloo_broadcast, per_tensor, nbytes, bench.timeout_s) for p in [trainer, *workers]]
        )

    name = (
        "naive: one gloo broadcast per tensor" if per_tensor else f"raw limit: one gloo broadcast, {len(workers)} recv"
    )
    case = bench.timed(Case(size, name, nbytes, limit_s=limit), one, [trainer, workers[0]])
    bench.get([p.call.remote(probes.gloo_close) for p in [trainer, *workers]])
    if not per_tensor:
        case.limit_s = case.median
    return case.median


def outside_cases(bench: Timer, size: str, trainer: Any, worker: Any, nbytes: int, copy_s: float) -> None:
    """The baselines outside weightsync: one CUDA IPC handle per tensor (GPU), and the Ray
    object store's put of the state dict and get into the worker."""
    args, parties = bench.args, [trainer, worker]
    if args.device == "cuda" and "naive" in args.transports:

        def naive() -> None:
            handles = bench.get(trainer.call.remote(probes.export_per_tensor))
            bench.get(worker.call.remote(probes.import_per_tensor, handles))

        case = Case(size, "naive: one CUDA IPC handle per tensor", nbytes, limit_s=copy_s)
        bench.timed(case, naive, parties)
    if "objectstore" in args.transports and nbytes <= args.object_store_max_mb * 1e6:

        def object_store() -> None:
            bench.get(worker.call.remote(probes.load_state, trainer.call.remote(probes.state_cpu)))

        case = Case(size, "ray object store (put/get state dict)", nbytes, limit_s=copy_s)
        bench.timed(case, object_store, parties)
