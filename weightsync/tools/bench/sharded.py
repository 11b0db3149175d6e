"""The bench's sharded-source cases: the same model as an FSDP2 trainer of R ranks.

For each ``--sharded-ranks`` count R, R rank actors each build the size's policy, join one
gloo group and shard it with ``fully_shard`` (every block, then the root), as an FSDP2
user's trainer does; then each case syncs through the real product path
(``WeightSync(ranks, workers)``) to the very workers the unsharded trainer just synced in
the same run, so the rows compare directly:

* ``owners``: owner sends, every rank broadcasts the rows it holds to every worker (no gather);
* ``broadcast``: the ranks gather bucket by bucket, rank 0 broadcasts to every worker;
* ``owner-writes``: every rank writes the rows it holds into the first worker, colocated
  (same node: shared memory), with no gather;
* ``direct`` / ``ipc``: the first worker, colocated, served by rank 0, which gathers and
  writes it.

Memory is each rank's peak resident size during the case over its size before the case's
setup, per rank, in the row's note; ``trainMB`` is the largest of them. CPU only: on one
GPU the ranks would need gloo over CUDA tensors (see the README's sharded section).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any, Literal, Protocol

from torch import nn

import weightsync.tools.bench.probes as probes
from weightsync.core.wire.settings import DEFAULT_NUM_BUFFERS, MIB
from weightsync.tools.bench.report import Case
from weightsync.tools.models import SIZES, PolicyConfig, build_policy


class ShardedPolicyFactory:
    """One rank's model (picklable): join the group from the rank's environment
    (:class:`~weightsync.glue.ranks.RankSpec`), build the size's policy, shard it with FSDP2."""

    def __init__(self, size: str, seed: int, timeout_s: float) -> None:
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
        self.cfg = PolicyConfig(**{**SIZES[size].__dict__, "seed": seed})
        self.timeout_s = timeout_s

    def __call__(self) -> nn.Module:
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        model = build_policy(self.cfg, "cpu")
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model


class Timer(Protocol):
    """What these cases need of :class:`weightsync.tools.bench.driver.Bench`."""

    args: Any
    timeout_s: float

    def get(self, ref: Any) -> Any: ...

    def next_version(self) -> int: ...

    def not_run(self, size: str, name: str, exc: Exception) -> None: ...

    def memory_base(self, parties: list[Any]) -> list[int]: ...

    def timed(
        self, case: Case, one: Callable[[], float | None], parties: list[Any], base: list[int] | None = None
    ) -> Case: ...


def sharded_buffer_bytes(args: Any) -> int | Literal["auto"]:
    """The sharded rows' buffer size: the library's default ("auto"), as for the unsharded
    rows they sit next to, unless ``--buffer-mib`` was given (then its first value)."""
    if getattr(args, "buffer_mib_given", False):
        return int(args.buffer_mib[0] * MIB)
    return "auto"


def sharded_cases(bench: Timer, size: str, workers: list[Any], nbytes: int, limits: dict[str, float | None]) -> None:
    """Every ``--sharded-ranks`` count at ``size``: start the ranks, run the cases, kill them.

    ``limits``: per transport, the raw limit the unsharded rows use (one gloo broadcast of
    the model's bytes; one copy of one buffer).
    """
    import ray

    from weightsync.glue.actors import trainer_ranks

    for world in bench.args.sharded_ranks:
        ranks = trainer_ranks(ShardedPolicyFactory(size, 0, bench.timeout_s), world, actor_options={"num_cpus": 0})
        try:
            bench.get([r.pid.remote() for r in ranks])  # built and sharded before anything is timed
            for transport in ("owners", "broadcast", "owner-writes", "direct", "ipc"):
                # Owner sends serve what broadcast serves, owner writes what direct serves:
                # each runs whenever the transport it stands beside does.
                asked = {"owners": "broadcast", "owner-writes": "direct"}.get(transport, transport)
                if asked in bench.args.transports:
                    members = workers if asked == "broadcast" else workers[:1]
                    _one_case(bench, size, ranks, transport, members, nbytes, limits.get(asked))
        finally:
            for handle in ranks:
                ray.kill(handle)


def _one_case(
    bench: Timer,
    size: str,
    ranks: list[Any],
    transport: str,
    members: list[Any],
    nbytes: int,
    limit: float | None,
) -> None:
    from weightsync.glue.coordinator import WeightSync

    args = bench.args
    world = len(ranks)
    parties = [*ranks, members[0]]
    base = bench.memory_base(parties)
    ws = WeightSync(
        ranks,
        members,
        transport=transport,
        buffer_bytes=sharded_buffer_bytes(args),
        num_buffers=DEFAULT_NUM_BUFFERS,
        timeout_s=bench.timeout_s,
    )
    recv = f", {len(members)} recv" if transport in ("broadcast", "owners") else ""
    name = f"sharded {world} ranks: {transport}{recv}"
    try:
        built = ws.setup()
    except Exception as exc:  # noqa: BLE001 - reported, counted in the exit code; the rest go on
        bench.not_run(size, name, exc)
        return
    case = Case(size, name, nbytes, built.agreed.buffer_bytes / MIB, built.agreed.num_buffers, limit_s=limit)

    def one() -> float:
        report = ws.sync(bench.next_version())
        case.send_times.append(report.send_seconds)
        return report.seconds

    try:
        # Rank 0 and the first worker fill the row's memory columns; every rank's peak is
        # read from the same counters afterwards (nothing resets them in between).
        bench.timed(case, one, [ranks[0], members[0]], [base[0], base[-1]])
    finally:
        ws.close()
    peaks = bench.get([r.call.remote(probes.memory_peak) for r in ranks])
    extra = [(p - b) / 1e6 for p, b in zip(peaks, base)]
    case.trainer_extra_mb = max(extra)
    case.note = "per rank MB " + "/".join(f"{mb:.0f}" for mb in extra)
    if transport == "owner-writes":
        # A rank's resident size counts the pages of the worker's region it wrote into.
        case.note += " (incl. the worker's shared pages written)"
    print(f"{'':>6} {'':<34} {case.note}", flush=True)
