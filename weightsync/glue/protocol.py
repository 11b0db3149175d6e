"""The glue every ``ws_*`` method shares: failures turned into outcomes, the device, and the
endpoint's description.

Used by :mod:`weightsync.glue.trainer_mixin` and :mod:`weightsync.glue.worker_mixin`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import torch

from weightsync.core.placement import describe_here
from weightsync.core.wire.messages import EndpointInfo
from weightsync.core.wire.outcome import Outcome, failed, ok


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
    if not ray.is_initialized():
        return describe_here(device, allows_direct)
    return describe_here(
        device,
        allows_direct,
        node_id=ray.get_runtime_context().get_node_id(),
        node_ip=ray.util.get_node_ip_address(),
    )
