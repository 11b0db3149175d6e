"""The glue every ``ws_*`` method shares: failures turned into outcomes, the device, the
endpoint's description, the model a mixin serves; and the check, when a WeightSync is made,
that each party it is handed is an actor speaking this protocol.

Used by :mod:`weightsync.glue.trainer_mixin`, :mod:`weightsync.glue.worker_mixin` and the
coordinator's membership.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import torch
from torch import nn

from weightsync.core.placement import describe_here
from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.messages import EndpointInfo
from weightsync.core.wire.outcome import Outcome, failed, ok

#: Per role, the methods the coordinator calls first, and what to pass instead of a party without them.
_ROLES = {
    "trainer": (
        ("ws_describe", "ws_manifest", "ws_send", "ws_teardown"),
        "weightsync.TrainerActor.remote(model_factory) (the factory builds the model inside the actor), or an "
        "actor of your own class that mixes in weightsync.TrainerMixin and sets self.model",
    ),
    "worker": (
        ("ws_describe", "ws_accept", "ws_receive", "ws_teardown"),
        "weightsync.WorkerActor.remote(model_factory), a weightsync.vllm engine actor, or an actor of your own "
        "class that mixes in weightsync.WorkerMixin and sets self.model",
    ),
}


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


def model_of(actor: object, mixin: str) -> nn.Module:
    """``actor.model``, what a mixin serves unless ``weightsync_model()`` is overridden;
    :class:`SettingsError` naming the actor's class and what to set when it is not a module."""
    model = getattr(actor, "model", None)
    if isinstance(model, nn.Module):
        return model
    found = "no self.model" if model is None else f"a self.model of type {type(model).__name__}, not an nn.Module"
    raise SettingsError(
        f"{type(actor).__name__} mixes in {mixin} but has {found}: set self.model to the model in its __init__, "
        "or override weightsync_model() to return it"
    )


def check_party(handle: Any, role: str, name: str) -> None:
    """Refuse, naming party ``name`` and what to pass, a ``handle`` that cannot be a ``role``
    ("trainer" or "worker") party: a model instead of an actor, an actor class that was never
    started, or an actor whose class lacks the protocol. Anything else (a stand-in) passes."""
    methods, instead = _ROLES[role]
    if isinstance(handle, nn.Module):
        what = f"a {type(handle).__name__} (an nn.Module), not an actor"
    elif isinstance(handle, ray.actor.ActorClass):
        what = "an actor class, not an actor: start it with .remote(...)"
    elif isinstance(handle, ray.actor.ActorHandle):
        missing = [m for m in methods if not hasattr(handle, m)]
        if not missing:
            return
        descriptor = getattr(handle, "_ray_actor_creation_function_descriptor", None)
        cls = str(getattr(descriptor, "class_name", "its class")).rsplit(".", 1)[-1]  # a qualname
        what = f"an actor of class {cls}, which lacks the {role} protocol ({', '.join(missing)})"
    else:
        return
    raise SettingsError(f"{name} is {what}; pass {instead}")
