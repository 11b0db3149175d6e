"""The glue every ``ws_*`` method shares: failures turned into outcomes, the device, the
endpoint's description, and the broadcast communicator a group spec asks for.

Used by :mod:`weightsync.glue.trainer_mixin` and :mod:`weightsync.glue.worker_mixin`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import ray
import torch

from weightsync.core.transport.gloo import GlooCommunicator
from weightsync.core.wire.messages import EndpointInfo, GroupSpec
from weightsync.core.wire.outcome import Outcome, failed, ok
from weightsync.core.wire.sizing import free_memory_bytes


def answer(party: str, phase: str, fn: Callable[..., Any], *args: Any) -> Outcome:
    """Run ``fn(*args)`` and turn its result, or the exception it raised, into an Outcome."""
    try:
        return ok(party, phase, fn(*args))
    except Exception as exc:  # noqa: BLE001 - the failure travels as data, with its class and blame
        return failed(party, phase, exc)


def resolve_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def describe(device: torch.device, allows_direct: bool) -> EndpointInfo:
    # An engine's worker process outside Ray (driven by an actor that forwards to it) has
    # no Ray node id; the coordinator then compares host names.
    in_ray = ray.is_initialized()
    uuid = None
    if device.type == "cuda":
        from weightsync.core.transport.cuda_ipc import gpu_uuid

        uuid = gpu_uuid(device.index or 0)
    return EndpointInfo(
        node_id=ray.get_runtime_context().get_node_id() if in_ray else "",
        node_ip=ray.util.get_node_ip_address() if in_ray else socket.gethostbyname(socket.gethostname()),
        hostname=socket.gethostname(),
        pid=os.getpid(),
        device=device.type,
        gpu_uuid=uuid,
        sink_allows_direct=allows_direct,
        free_bytes=free_memory_bytes(device),
    )


def communicator(spec: GroupSpec, device: torch.device, members: Sequence[str], store: Any = None) -> Any:
    if spec.backend == "nccl":
        from weightsync.core.transport.nccl import NcclCommunicator

        assert spec.nccl_id is not None
        return NcclCommunicator(spec.nccl_id, spec.rank, spec.world_size, device, spec.timeout_s, members)
    return GlooCommunicator(
        spec.store_host,
        spec.store_port,
        spec.rank,
        spec.world_size,
        spec.name,
        spec.timeout_s,
        bind_host=spec.store_host,
        store=store,
    )
