"""Where two endpoints live relative to each other: the facts every transport's fit reads.

Pure functions of two :class:`~weightsync.core.wire.messages.EndpointInfo`: the same Ray
node (or host), the same device (the same GPU by UUID, or the same node on CPU).
"""

from __future__ import annotations

import os
import socket

import torch

from weightsync.core.wire.messages import EndpointInfo
from weightsync.core.wire.shm_names import pid_namespace
from weightsync.core.wire.sizing import free_memory_bytes


def same_node(a: EndpointInfo, b: EndpointInfo) -> bool:
    """Same Ray node when both know their node id; otherwise the same host name."""
    if a.node_id and b.node_id:
        return a.node_id == b.node_id
    return a.hostname == b.hostname


def same_device(a: EndpointInfo, b: EndpointInfo) -> bool:
    return same_node(a, b) and a.device == b.device and (a.device == "cpu" or a.gpu_uuid == b.gpu_uuid)


def where(info: EndpointInfo) -> str:
    """One readable phrase for an error message: the node and the device."""
    return f"node {info.node_id[:8] or info.hostname} {info.device}{' ' + info.gpu_uuid if info.gpu_uuid else ''}"


def colocated_or_why(
    trainer: EndpointInfo, worker: EndpointInfo, name: str, transport: str, instead: str = "broadcast"
) -> str | None:
    """None when ``worker`` shares the trainer's device and pid namespace; else why
    ``transport`` cannot serve it, suggesting ``instead``."""
    if not same_device(trainer, worker):
        return (
            f"transport {transport!r} needs the worker on the trainer's device (trainer: {where(trainer)}; "
            f"{name}: {where(worker)}); use transport={instead!r} for it"
        )
    if trainer.pidns and worker.pidns and trainer.pidns != worker.pidns:
        return (
            f"transport {transport!r} watches its peer's process by pid, and the trainer (pid namespace "
            f"{trainer.pidns}) and {name} (pid namespace {worker.pidns}) do not share one, so neither could tell "
            f"whether the other is alive; run both in one pid namespace (one container, or --pid=host) or use "
            f"transport={instead!r} for it"
        )
    return None


def describe_here(
    device: torch.device, allows_direct: bool = True, node_id: str = "", node_ip: str | None = None
) -> EndpointInfo:
    """Where this process's endpoint on ``device`` lives. ``node_id``/``node_ip``: the Ray
    node's, when there is one (otherwise the host name decides what is the same node)."""
    uuid = None
    if device.type == "cuda":
        from weightsync.mechanisms.cuda_ipc import gpu_uuid

        uuid = gpu_uuid(device.index or 0)
    return EndpointInfo(
        node_id=node_id,
        node_ip=node_ip if node_ip is not None else socket.gethostbyname(socket.gethostname()),
        hostname=socket.gethostname(),
        pid=os.getpid(),
        device=device.type,
        gpu_uuid=uuid,
        sink_allows_direct=allows_direct,
        free_bytes=free_memory_bytes(device),
        pidns=pid_namespace(),
    )


def gpu_reason() -> str | None:
    """None when a CUDA GPU is visible here, else why not (for the doctor)."""
    return None if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "no GPU visible"


def shm_reason() -> str | None:
    """None when shared memory is writable here, else why not (for the doctor)."""
    from weightsync.mechanisms.shm import SHM_DIR

    return None if os.access(SHM_DIR, os.W_OK) else f"{SHM_DIR} is not writable"
