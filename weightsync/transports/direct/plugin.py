"""The direct plug-in: a worker on the trainer's device holding plain tensors, written in one copy.

Setup, run by the coordinator for each trainer party with direct workers (again for the
workers whose tensors moved since their export: a reload replaced them)::

    export   each worker moves its tensors into one exported region (under its gate) and
             installs DirectTarget
    map      the trainer party maps each export once (DirectWriter; a new export of the
             same worker replaces its mapping)
    seal     each worker unlinks its shared-memory names

A worker commits as soon as its receive returns: the control block tells it the writer
finished.
"""

from __future__ import annotations

from collections.abc import Callable

from weightsync.core.placement import colocated_or_why, gpu_reason, shm_reason
from weightsync.core.plugin import Opening, Request, Serving, Slots, TrainerSide, Transport, WorkerSide
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.messages import EndpointInfo
from weightsync.transports.direct.halves import DirectTarget, DirectWriter
from weightsync.transports.direct.messages import DirectExport


def open_direct(opening: Opening) -> None:
    """Each member exports its tensors, the serving party maps the exports, the members seal."""
    me, members = opening.server, opening.members
    exports = opening.step({name: Request(action="export") for name in members}, "exporting direct targets")
    opening.step({me: Request(action="map", args=(tuple(exports[n] for n in members),))}, "mapping direct targets")
    opening.step({name: Request(action="seal") for name in members}, "sealing direct exports")


def _map(side: TrainerSide, exports: tuple[DirectExport, ...]) -> None:
    writer = side.half("direct")
    if not isinstance(writer, DirectWriter):
        writer = DirectWriter(side.session, side.device)
        side.install(writer)
    for export in exports:
        writer.map(export)


def export_target(
    side: WorkerSide, kind: str, make: Callable[[], DirectTarget], fits: Callable[[DirectTarget], bool]
) -> DirectExport:
    """The worker's export for a transport of direct writes (``kind``): the target it holds
    when ``fits`` accepts it, else a new one from ``make``; refused for a sink that
    transforms tensors on load."""
    session = side.session
    tensors = side.sink.direct_tensors(session.manifest)
    if tensors is None:
        raise WeightSyncError(
            f"{session.party}: its sink ({type(side.sink).__name__}) transforms tensors on load "
            f"and cannot take {kind} writes; use transport='ipc' for this worker"
        )
    with side.gate:
        target = side.half(kind)
        if not isinstance(target, DirectTarget) or not fits(target):
            target = make()
            side.install(target)
        return target.export(tensors, side.sink.rebind)


def seal_target(side: WorkerSide, kind: str) -> None:
    """Once every writer mapped the export: unlink its shared-memory names."""
    target = side.half(kind)
    if not isinstance(target, DirectTarget):
        raise WeightSyncError(f"{side.session.party}: no {kind} export to seal; the export step did not run")
    target.seal()


def _export(side: WorkerSide) -> DirectExport:
    return export_target(side, "direct", lambda: DirectTarget(side.session, side.device), lambda _: True)


def _seal(side: WorkerSide) -> None:
    seal_target(side, "direct")


def fits(trainer: EndpointInfo, worker: EndpointInfo, name: str) -> str | None:
    far = colocated_or_why(trainer, worker, name, "direct")
    if far is not None:
        return far
    if not worker.sink_allows_direct:
        return "its sink transforms tensors on load and cannot take direct writes; use transport='ipc'"
    return None


def usable_here() -> list[tuple[str, str | None]]:
    return [("direct (shared memory, CPU)", shm_reason()), ("direct (CUDA IPC)", gpu_reason())]


DIRECT = Transport(
    name="direct",
    open=open_direct,
    trainer_actions={"map": _map},
    worker_actions={"export": _export, "seal": _seal},
    send_half=DirectWriter,
    receive_half=DirectTarget,
    fits=fits,
    serving=Serving.NEAREST,
    auto_rank=10,
    send_order=10,
    usable_here=usable_here,
    slots=Slots.NONE,
)
