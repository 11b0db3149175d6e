"""Which transport each worker gets: a pure function of where the two endpoints live.

Same device (the same GPU by UUID, or the same node on CPU): ``direct`` when the worker's
sink holds plain tensors, ``ipc`` when it transforms them on load. Elsewhere: ``broadcast``.
A request the layout cannot serve is refused with the reason and what to use instead.
"""

from __future__ import annotations

from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.messages import TRANSPORTS, EndpointInfo

REQUESTS = ("auto", *TRANSPORTS)


def same_node(a: EndpointInfo, b: EndpointInfo) -> bool:
    """Same Ray node when both know their node id; otherwise the same host name."""
    if a.node_id and b.node_id:
        return a.node_id == b.node_id
    return a.hostname == b.hostname


def same_device(a: EndpointInfo, b: EndpointInfo) -> bool:
    return same_node(a, b) and a.device == b.device and (a.device == "cpu" or a.gpu_uuid == b.gpu_uuid)


def _where(info: EndpointInfo) -> str:
    return f"node {info.node_id[:8] or info.hostname} {info.device}{' ' + info.gpu_uuid if info.gpu_uuid else ''}"


def choose_transport(trainer: EndpointInfo, worker: EndpointInfo, requested: str, name: str) -> str:
    """The transport for worker ``name``, given what was requested for it."""
    if requested not in REQUESTS:
        raise SettingsError(f"transport for {name} must be one of {', '.join(REQUESTS)}; got {requested!r}")
    colocated = same_device(trainer, worker)
    if requested == "auto":
        if colocated:
            return "direct" if worker.sink_allows_direct else "ipc"
        return "broadcast"
    if requested in ("ipc", "direct") and not colocated:
        raise SettingsError(
            f"{name}: transport {requested!r} needs the worker on the trainer's device "
            f"(trainer: {_where(trainer)}; {name}: {_where(worker)}); use transport='broadcast' for it"
        )
    if requested == "direct" and not worker.sink_allows_direct:
        raise SettingsError(
            f"{name}: its sink transforms tensors on load and cannot take direct writes; use transport='ipc'"
        )
    if requested == "broadcast" and colocated and trainer.device == "cuda":
        raise SettingsError(
            f"{name}: shares GPU {trainer.gpu_uuid} with the trainer, and NCCL refuses two "
            "ranks on one GPU; use transport='ipc' or 'direct' (or 'auto')"
        )
    return requested
