"""The owner-writes plug-in: every rank of a sharded trainer writes its rows into a colocated worker.

For a worker that every rank can write into (on a CPU: the ranks and the worker on one
node; on GPUs: all on the worker's GPU) and whose sink holds plain tensors, as ``direct``
serves it, but with no gather: each rank copies only the rows it holds
(halves: :mod:`weightsync.transports.owner_writes.halves`). ``transport="auto"`` picks it over
``direct`` for a sharded trainer whose every tensor is ``Shard(0)`` over a 1-D mesh,
``Replicate`` or plain (FSDP2's layout) when every rank fits; otherwise the worker keeps
``direct`` from the rank it shares a device with, which gathers.

Setup, run by the coordinator once, with every rank among the servers (again for workers
whose tensors moved since their export)::

    placements  every rank says how it holds each tensor (rows or whole); they must agree
    export      each worker moves its tensors into one exported region counting R writers
    map         every rank maps each export and keeps the views of its own part
    seal        each worker unlinks its shared-memory names
"""

from __future__ import annotations

from weightsync.core.owned_plan import OwnedLayout, agreed_layout, placements
from weightsync.core.placement import colocated_or_why, gpu_reason, shm_reason
from weightsync.core.plugin import Opening, Request, Serving, Slots, TrainerSide, Transport, WorkerSide
from weightsync.core.wire.messages import EndpointInfo
from weightsync.transports.direct.halves import DirectTarget
from weightsync.transports.direct.messages import DirectExport
from weightsync.transports.direct.plugin import export_target, seal_target
from weightsync.transports.owner_writes.halves import KIND, OwnerWriter, OwnerWriteTarget


def open_owner_writes(opening: Opening) -> None:
    ranks, members = opening.servers, opening.members
    layout = agreed_layout(opening, "direct")
    exports = opening.step(
        {name: Request(action="export", args=(ranks,)) for name in members}, "exporting owner-write targets"
    )
    mine = tuple(exports[name] for name in members)
    opening.step(
        {rank: Request(action="map", args=(mine, layout, i, ranks)) for i, rank in enumerate(ranks)},
        "mapping owner-write targets on every rank",
    )
    opening.step({name: Request(action="seal") for name in members}, "sealing owner-write exports")


def _map(
    side: TrainerSide, exports: tuple[DirectExport, ...], layout: OwnedLayout, writer: int, writers: tuple[str, ...]
) -> None:
    half = side.half(KIND)
    if not isinstance(half, OwnerWriter) or half.writers != writers or half.layout != layout:
        half = OwnerWriter(side.session, side.device, layout, writer, writers)
        side.install(half)
    for export in exports:
        half.map(export)


def _export(side: WorkerSide, writers: tuple[str, ...]) -> DirectExport:
    def make() -> DirectTarget:
        return OwnerWriteTarget(side.session, side.device, writers)

    return export_target(side, KIND, make, lambda target: target.writers == writers)


def _seal(side: WorkerSide) -> None:
    seal_target(side, KIND)


def fits(trainer: EndpointInfo, worker: EndpointInfo, name: str) -> str | None:
    """Checked against every rank (``Serving.EVERY``): each must share the worker's device."""
    if trainer.shards == "none":
        return "the trainer is not sharded (owner writes need the ranks of a DTensor trainer); use 'direct'"
    if trainer.shards != "owned":
        return (
            "the trainer's layout is not Shard(0) over a 1-D mesh, Replicate or plain for every tensor, so its "
            "ranks cannot write what they hold; use 'direct' (its rank gathers)"
        )
    far = colocated_or_why(trainer, worker, name, KIND, instead="direct")
    if far is not None:
        return far
    if not worker.sink_allows_direct:
        return "its sink transforms tensors on load and cannot take direct writes; use transport='ipc'"
    return None


def usable_here() -> list[tuple[str, str | None]]:
    return [(f"{KIND} (shared memory, CPU)", shm_reason()), (f"{KIND} (CUDA IPC)", gpu_reason())]


OWNER_WRITES = Transport(
    name=KIND,
    open=open_owner_writes,
    trainer_actions={"placements": placements, "map": _map},
    worker_actions={"export": _export, "seal": _seal},
    send_half=OwnerWriter,
    receive_half=OwnerWriteTarget,
    fits=fits,
    serving=Serving.EVERY,
    auto_rank=5,
    send_order=6,
    usable_here=usable_here,
    slots=Slots.NONE,
)
