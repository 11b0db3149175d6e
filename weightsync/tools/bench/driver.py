"""The bench's driver: one trainer and its workers per model size, every case in turn.

:meth:`Bench.run` -> per size :meth:`Bench.size_cases` (the raw limit, the Ray floor, the
weightsync transports and their knob sweeps, the reference design, the baselines) -> each
case through :meth:`Bench.timed` (one warm-up, ``--repeats`` timed runs, peak memory).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import weightsync.tools.bench.probes as probes
from weightsync.core.wire.errors import SettingsError, SetupError, WeightSyncError
from weightsync.core.wire.outcome import Status
from weightsync.core.wire.settings import SyncSettings
from weightsync.tools.bench.chart import check_plot_path, plot
from weightsync.tools.bench.engine_tp import engine_tp_cases
from weightsync.tools.bench.lora import lora_cases
from weightsync.tools.bench.report import MIB, Case, check_json_path, header, ratios, show, write_json
from weightsync.tools.bench.sharded import sharded_cases
from weightsync.tools.models import PolicyFactory


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import ray

        self.ray = ray
        self.args = args
        self.cases: list[Case] = []
        self.summary: list[str] = []
        #: Cases whose setup failed for another reason than a refusal: the run's exit code says so.
        self.failed: list[str] = []
        self.timeout = args.timeout
        self._version = 0

    def not_run(self, size: str, name: str, exc: Exception) -> None:
        """A case whose setup raised: skipped when weightsync refused the case (a setting or
        a handshake it cannot run here), failed otherwise (a party died or did not answer,
        or anything else raised); either way the other cases go on."""
        refused = isinstance(exc, SettingsError) or (
            isinstance(exc, SetupError)
            and not exc.dead
            and all(o.status is not Status.TIMED_OUT for o in exc.outcomes.values())
        )
        line = f"{size:>6} {name:<34} {'skipped' if refused else 'FAILED'}: {type(exc).__name__}: {exc}"
        print(line.splitlines()[0], flush=True)
        if not refused:
            self.failed.append(f"{size} {name}")

    def next_version(self) -> int:
        """One counter for every case: the workers are shared and refuse an older version."""
        self._version += 1
        return self._version

    def get(self, ref: Any) -> Any:
        return self.ray.get(ref, timeout=self.timeout)

    def memory_base(self, parties: list[Any]) -> list[int]:
        """Reset each side's peak counter; returns what each holds now."""
        return list(self.get([p.call.remote(probes.memory_reset) for p in parties]))

    def timed(
        self, case: Case, one: Callable[[], float | None], parties: list[Any], base: list[int] | None = None
    ) -> Case:
        """Warm up once, then time ``repeats`` runs of ``one``. Peak memory counts from
        ``base`` (taken before a case's setup, so its buffers count) or from now."""
        if base is None:
            base = self.memory_base(parties)
        one()
        case.times = []
        case.send_times = []
        for _ in range(self.args.repeats):
            t0 = time.perf_counter()
            measured = one()
            case.times.append(measured if measured is not None else time.perf_counter() - t0)
        peaks = self.get([p.call.remote(probes.memory_peak) for p in parties])
        case.trainer_extra_mb = (peaks[0] - base[0]) / 1e6
        case.worker_extra_mb = (peaks[1] - base[1]) / 1e6 if len(parties) > 1 else None
        self.cases.append(case)
        show(case)
        return case

    def run(self) -> int:
        from weightsync.tools.bench.reference import ChunkTrainerActor, ChunkWorkerActor
        from weightsync.tools.cluster import connect

        args = self.args
        cuda = args.device == "cuda"
        if args.plot:
            check_plot_path(args.plot)
        if args.json:
            check_json_path(args.json)
        connect(args.address, num_cpus=args.num_cpus)
        opts: dict[str, Any] = {"num_cpus": 0}
        if cuda:
            # Colocated cases need one GPU shared by the trainer and one worker; NCCL cases
            # would need more GPUs, which this bench does not place yet.
            args.workers = 1
            opts["num_gpus"] = 0.5
        header()
        started = time.perf_counter()
        for index, size in enumerate(args.sizes, 1):
            # Progress: which size of how many, and the time so far (sizes grow, so the last
            # ones take longest).
            print(f"-- size {index}/{len(args.sizes)}: {size}, {time.perf_counter() - started:.0f}s so far", flush=True)
            factory_device = "cuda" if cuda else "cpu"
            trainer = ChunkTrainerActor.options(**opts).remote(
                PolicyFactory(size, 0, factory_device), device=args.device
            )
            workers = [
                ChunkWorkerActor.options(**opts).remote(PolicyFactory(size, i + 1, factory_device), device=args.device)
                for i in range(args.workers)
            ]
            try:
                self.size_cases(size, trainer, workers)
            finally:
                for handle in [trainer, *workers]:
                    self.ray.kill(handle)
            for line in ratios(self.cases, size, len(workers)):
                self.summary.append(line)
                print(line, flush=True)
        if args.json:
            write_json(args.json, args, self.cases, self.summary)
        if args.plot:
            plot(self.cases, args.plot)
        if self.failed:
            print(f"failed cases (their setup raised): {', '.join(self.failed)}", flush=True)
            return 1
        return 0

    def size_cases(self, size: str, trainer: Any, workers: list[Any]) -> None:
        from weightsync.glue.coordinator import WeightSync

        args = self.args
        cuda = args.device == "cuda"
        parties = [trainer, workers[0]]
        built = self.get(trainer.ws_manifest.remote(SyncSettings(buffer_bytes=args.buffer_mib[0] * MIB)))
        self.get(trainer.ws_teardown.remote(forget=True))  # that session was only for the manifest
        if not built.ok:
            raise WeightSyncError(f"the bench's trainer could not build its manifest: {built.line()}")
        manifest = built.value
        nbytes = manifest.total_bytes
        copy_s = self.get(trainer.call.remote(probes.raw_copy_seconds, nbytes, args.repeats))
        self.cases.append(
            Case(
                size,
                "raw limit: one copy of one buffer",
                nbytes,
                times=[copy_s] * 2,
                limit_s=copy_s,
                note=f"{len(manifest.specs)} tensors",
            )
        )
        show(self.cases[-1])

        def sync_case(
            name: str,
            transport: str,
            buffer_mib: int | None,
            nbuf: int,
            limit: float | None,
            members: list[Any],
            inplace_bytes: int | None = None,
        ) -> None:
            """One weightsync case; ``buffer_mib=None``: the library's default ("auto");
            ``inplace_bytes=None``: the library's default threshold."""
            base = self.memory_base(parties)
            ws = WeightSync(
                trainer,
                members,
                transport=transport,
                buffer_bytes=buffer_mib * MIB if buffer_mib is not None else "auto",
                num_buffers=nbuf,
                inplace_bytes=inplace_bytes,
                timeout_s=self.timeout,
            )
            try:
                built = ws.setup()
            except Exception as exc:  # noqa: BLE001 - reported, counted in the exit code; the rest go on
                self.not_run(size, name, exc)
                return

            note = f"{built.inplace_count} in place" if transport == "broadcast" and built.inplace_count else ""
            case = Case(size, name, nbytes, built.agreed.buffer_bytes / MIB, nbuf, limit_s=limit, note=note)

            def one() -> float:
                report = ws.sync(self.next_version())
                case.send_times.append(report.send_seconds)
                return report.seconds

            self.timed(case, one, parties, base)
            ws.close()

        self.ray_floor_case(size, trainer, workers[0], nbytes, copy_s)
        first = args.buffer_mib[0]
        colocated = ["ipc", "direct"] if ("ipc" in args.transports or "direct" in args.transports) else []
        for transport in colocated:
            if transport not in args.transports:
                continue
            sync_case(f"weightsync {transport}", transport, None, 2, copy_s, workers[:1])
        if "direct" in args.transports:
            self.push_cases(size, trainer, workers[0], nbytes, copy_s)
        if "ipc" in args.transports and not args.quick:
            for buffer_mib in args.buffer_mib:
                for nbuf in (1, 2, 3):
                    if buffer_mib * MIB <= max(2 * nbytes, first * MIB):
                        sync_case("weightsync ipc (knobs)", "ipc", buffer_mib, nbuf, copy_s, workers[:1])
            self.reference_case(size, trainer, workers[0], nbytes, copy_s, first)
        raw: float | None = None
        if "broadcast" in args.transports and not cuda:
            raw = self.gloo_case(size, trainer, workers, nbytes, per_tensor=False)
            for n in sorted({1, len(workers)}):
                sync_case(
                    f"weightsync broadcast, {n} receiver(s)",
                    "broadcast",
                    None,
                    2,
                    raw if n == len(workers) else None,
                    workers[:n],
                )
            sync_case("weightsync broadcast (all packed)", "broadcast", None, 2, raw, workers, inplace_bytes=0)
            if not args.quick:
                for buffer_mib in args.buffer_mib:
                    sync_case("weightsync broadcast (knobs)", "broadcast", buffer_mib, 2, raw, workers)
                for nbuf in (1, 3):
                    sync_case("weightsync broadcast (knobs)", "broadcast", first, nbuf, raw, workers)
            self.gloo_case(size, trainer, workers, nbytes, per_tensor=True, limit=raw)
        if args.sharded_ranks and cuda:
            print(f"{size:>6} {'sharded trainer cases':<34} skipped: CPU only (gloo ranks)", flush=True)
        elif args.sharded_ranks:
            sharded_cases(self, size, workers, nbytes, {"broadcast": raw, "direct": copy_s, "ipc": copy_s})
        if args.vllm_tp and cuda:
            print(f"{size:>6} {'vllm TP cases':<34} skipped: CPU only (one GPU holds no TP pairs)", flush=True)
        elif args.vllm_tp:
            engine_tp_cases(self, size, copy_s)
        if args.lora_rank:
            lora_cases(self, size)
        if cuda and "naive" in args.transports:

            def naive() -> None:
                handles = self.get(trainer.call.remote(probes.export_per_tensor))
                self.get(workers[0].call.remote(probes.import_per_tensor, handles))

            self.timed(
                Case(size, "naive: one CUDA IPC handle per tensor", nbytes, limit_s=copy_s), lambda: naive(), parties
            )
        if "objectstore" in args.transports and nbytes <= args.object_store_max_mb * 1e6:

            def object_store() -> None:
                self.get(workers[0].call.remote(probes.load_state, trainer.call.remote(probes.state_cpu)))

            self.timed(
                Case(size, "ray object store (put/get state dict)", nbytes, limit_s=copy_s),
                lambda: object_store(),
                parties,
            )

    def push_cases(self, size: str, trainer: Any, worker: Any, nbytes: int, copy_s: float) -> None:
        """Direct in push mode: ``sync()`` as one Ray call (to the trainer), and a push from
        inside the trainer's own call (timed there: no Ray call for the sync at all)."""
        from weightsync.glue.coordinator import WeightSync

        base = self.memory_base([trainer, worker])
        ws = WeightSync(trainer, [worker], transport="direct", push=True, timeout_s=self.timeout)
        ws.setup()

        def by_sync() -> float:
            return ws.sync(self.next_version()).seconds

        def in_trainer() -> float:
            return float(self.get(trainer.push_seconds.remote(self.next_version())))

        self.timed(
            Case(size, "weightsync direct push, 1 Ray call", nbytes, limit_s=copy_s), by_sync, [trainer, worker], base
        )
        self.timed(
            Case(size, "weightsync direct push, in trainer", nbytes, limit_s=copy_s, note="timed in the trainer"),
            in_trainer,
            [trainer, worker],
        )
        ws.close()

    def ray_floor_case(self, size: str, trainer: Any, worker: Any, nbytes: int, copy_s: float) -> None:
        """The hand-off floor: a colocated sync's shape (one call per side, started
        together, waited for once), doing nothing; then the same with calls as long as one
        raw copy, from 1 ms up: Ray was measured to return a call that lasted a while
        later than a no-op (docs/benchmarks.md), so a sync's time minus the copy and this
        second row is what weightsync itself adds."""

        def one() -> None:
            self.get([worker.call.remote(probes.nothing), trainer.call.remote(probes.nothing)])

        self.timed(
            Case(size, "ray floor: one no-op call per side", nbytes, note="what any sync pays for Ray"),
            one,
            [trainer, worker],
        )
        if copy_s < 1e-3:
            return

        def long() -> float:
            start = time.perf_counter()
            self.get([worker.call.remote(probes.polling, copy_s), trainer.call.remote(probes.polling, copy_s)])
            return time.perf_counter() - start - copy_s

        self.timed(
            Case(size, "ray floor: calls as long as a copy", nbytes, note="Ray's share, the copy's length taken off"),
            long,
            [trainer, worker],
        )

    def reference_case(self, size: str, trainer: Any, worker: Any, nbytes: int, copy_s: float, buffer_mib: int) -> None:
        """The reference design: one slot, pack then consume, a Ray round trip each, per chunk."""
        from weightsync.glue.coordinator import WeightSync

        base = self.memory_base([trainer, worker])
        ws = WeightSync(
            trainer, [worker], transport="ipc", buffer_bytes=buffer_mib * MIB, num_buffers=1, timeout_s=self.timeout
        )
        manifest = ws.setup()

        def one() -> None:
            for chunk in manifest.chunks:
                handle = self.get(trainer.pack_chunk.remote(chunk.index, 0, ws.label))
                self.get(worker.consume_chunk.remote(handle))

        self.timed(
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
        self, size: str, trainer: Any, workers: list[Any], nbytes: int, per_tensor: bool, limit: float | None = None
    ) -> float:
        world = len(workers) + 1
        port = self.get(trainer.call.remote(probes.gloo_open_store, "127.0.0.1", world))
        self.get(
            [trainer.call.remote(probes.gloo_join_root, "127.0.0.1", world)]
            + [w.call.remote(probes.gloo_join, "127.0.0.1", port, r, world) for r, w in enumerate(workers, start=1)]
        )

        def one() -> None:
            self.get([p.call.remote(probes.gloo_broadcast, per_tensor, nbytes) for p in [trainer, *workers]])

        name = (
            "naive: one gloo broadcast per tensor"
            if per_tensor
            else f"raw limit: one gloo broadcast, {len(workers)} recv"
        )
        case = self.timed(Case(size, name, nbytes, limit_s=limit), one, [trainer, workers[0]])
        self.get([p.call.remote(probes.gloo_close) for p in [trainer, *workers]])
        if not per_tensor:
            case.limit_s = case.median
        return case.median
