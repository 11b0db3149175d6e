"""The ipc plug-in: a worker on the trainer's device whose sink transforms tensors on load.

Setup, run by the coordinator for each trainer party with ipc workers (the rank on their
device, for a sharded trainer)::

    export   the trainer party exports its slots and control block for its consumers
    attach   each worker maps them (consumer i of the export) and installs IpcReceiver
    seal     the trainer unlinks the shared-memory names (nothing can leak from here on)

A worker commits as soon as its receive returns: the control block tells it the producer
finished.
"""

from __future__ import annotations

from weightsync.core.placement import colocated_or_why, gpu_reason, shm_reason
from weightsync.core.plugin import Opening, Request, Serving, Slots, TrainerSide, Transport, WorkerSide
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.messages import EndpointInfo
from weightsync.transports.ipc.halves import IpcReceiver, IpcSender
from weightsync.transports.ipc.messages import IpcExport


def open_ipc(opening: Opening) -> None:
    """One slot export for every ipc worker of the serving party, attached by each, sealed."""
    me, members = opening.server, opening.members
    export = opening.step({me: Request(action="export", args=(members,))}, "exporting IPC slots")[me]
    opening.step(
        {name: Request(action="attach", args=(export, i)) for i, name in enumerate(members)}, "attaching IPC slots"
    )
    opening.step({me: Request(action="seal")}, "sealing IPC exports")


def _export(side: TrainerSide, consumers: tuple[str, ...]) -> IpcExport:
    half = IpcSender(side.session, side.device)
    side.install(half)
    return half.export(consumers)


def _seal(side: TrainerSide) -> None:
    half = side.half("ipc")
    if not isinstance(half, IpcSender):
        raise WeightSyncError(f"{side.session.party}: no IPC export to seal; the export step did not run")
    half.seal()


def _attach(side: WorkerSide, export: IpcExport, index: int) -> None:
    half = IpcReceiver(side.session, side.device)
    half.attach(export, index)
    side.install(half)


def fits(trainer: EndpointInfo, worker: EndpointInfo, name: str) -> str | None:
    return colocated_or_why(trainer, worker, name, "ipc")


def usable_here() -> list[tuple[str, str | None]]:
    return [("ipc (shared memory, CPU)", shm_reason()), ("ipc (CUDA IPC)", gpu_reason())]


IPC = Transport(
    name="ipc",
    open=open_ipc,
    trainer_actions={"export": _export, "seal": _seal},
    worker_actions={"attach": _attach},
    send_half=IpcSender,
    receive_half=IpcReceiver,
    fits=fits,
    serving=Serving.NEAREST,
    auto_rank=20,
    send_order=20,
    usable_here=usable_here,
    slots=Slots.ONE_DEVICE,
)
