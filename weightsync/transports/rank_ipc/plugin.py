"""The rank-ipc plug-in: every trainer rank feeds, over ipc, the part of a worker on its device.

For a worker of several processes (``EndpointInfo.parts``: an inference engine's TP ranks,
each loading every tensor and keeping its shard) whose part k shares a device with trainer
rank k: the hybrid layout of RLHF, where trainer and engine take turns on the same GPUs.
``transport="auto"`` picks it over ``ipc`` when the trainer has as many ranks as the worker
has parts and each pair shares a device; otherwise the worker keeps ``ipc`` (or
``broadcast``) into part 0, which hands the tensors on to its other parts itself. Halves:
:mod:`weightsync.transports.rank_ipc.halves`.

Setup, run by the coordinator once, with every rank among the servers; every part of each
worker runs each worker action (``Transport.feeds_parts``)::

    export   every rank exports its own slots and control block, for its part of each worker
    attach   each part k of each worker maps rank k's export (its consumer index: the
             worker's place among the members) and installs RankIpcReceiver
    seal     every rank unlinks its shared-memory names

The worker answers each call for its parts together. A part commits as its own receive
returns (its rank's control block says the rank finished), unless the worker stages its
updates (``EndpointInfo.stages``): then the coordinator chains a commit on the worker's
whole receive and every rank's send, and every part commits there, so all parts load the
version or none does.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.core.placement import colocated_or_why, gpu_reason, shm_reason
from weightsync.core.plugin import Opening, Request, Serving, TrainerSide, Transport, WorkerSide
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.messages import EndpointInfo
from weightsync.transports.ipc.messages import IpcExport
from weightsync.transports.rank_ipc.halves import KIND, RankIpcReceiver, RankIpcSender


def open_rank_ipc(opening: Opening) -> None:
    ranks, members = opening.servers, opening.members
    exported = opening.step(
        {rank: Request(action="export", args=(members,)) for rank in ranks}, "exporting IPC slots on every rank"
    )
    exports = tuple(exported[rank] for rank in ranks)
    opening.step(
        {name: Request(action="attach", args=(exports, ranks, i)) for i, name in enumerate(members)},
        "attaching every part to its rank's IPC slots",
    )
    opening.step({rank: Request(action="seal") for rank in ranks}, "sealing IPC exports on every rank")


def _export(side: TrainerSide, consumers: tuple[str, ...]) -> IpcExport:
    half = RankIpcSender(side.session, side.device)
    side.install(half)
    return half.export(consumers)


def _seal(side: TrainerSide) -> None:
    half = side.half(KIND)
    if not isinstance(half, RankIpcSender):
        raise WeightSyncError(f"{side.session.party}: no rank-ipc export to seal; the export step did not run")
    half.seal()


def _attach(side: WorkerSide, exports: tuple[IpcExport, ...], ranks: tuple[str, ...], index: int) -> None:
    part, parts = side.part
    if parts != len(exports):
        raise WeightSyncError(
            f"{side.session.party}: part {part} of {parts}, but {len(exports)} trainer rank(s) export slots for it: "
            "rank-ipc feeds part k from trainer rank k, so the worker needs one part per rank; use transport='ipc'"
        )
    half = RankIpcReceiver(side.session, side.device, ranks[part], part)
    half.attach(exports[part], index)
    side.install(half)


def fits(trainer: EndpointInfo, worker: EndpointInfo, name: str) -> str | None:
    if not worker.parts:
        return (
            f"{name} receives in one process (rank-ipc feeds each process of a worker of several, such as an "
            "engine's TP ranks, from the trainer rank beside it); use 'ipc'"
        )
    return None


def fits_every(ranks: Sequence[EndpointInfo], worker: EndpointInfo, name: str) -> str | None:
    """Part k is fed by rank k: as many ranks as parts, each pair on one device."""
    if worker.parts and len(ranks) != len(worker.parts):
        return (
            f"the trainer has {len(ranks)} rank(s) and {name} {len(worker.parts)} parts; rank-ipc feeds part k from "
            "trainer rank k, so the counts must match; use 'ipc' (part 0 receives and hands the tensors on)"
        )
    for k, (rank, part) in enumerate(zip(ranks, worker.parts)):
        why = colocated_or_why(rank, part, f"{name} part {k}", KIND, instead="ipc")
        if why is not None:
            return f"(trainer rank {k}) {why}"
    return None


def usable_here() -> list[tuple[str, str | None]]:
    return [("rank-ipc (shared memory, CPU)", shm_reason()), ("rank-ipc (CUDA IPC)", gpu_reason())]


RANK_IPC = Transport(
    name=KIND,
    open=open_rank_ipc,
    trainer_actions={"export": _export, "seal": _seal},
    worker_actions={"attach": _attach},
    send_half=RankIpcSender,
    receive_half=RankIpcReceiver,
    fits=fits,
    fits_every=fits_every,
    serving=Serving.EVERY,
    feeds_parts=True,
    auto_rank=15,
    send_order=21,
    usable_here=usable_here,
)
