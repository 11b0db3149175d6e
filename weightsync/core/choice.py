"""Which transport each worker gets: a pure function of where the two endpoints live.

``auto`` takes the first of the registry's candidates (:func:`~weightsync.core.registry.auto_candidates`,
by their ``auto_rank``) whose fit accepts the pair: with the built-ins, the same device (the
same GPU by UUID, or the same node on CPU) gives ``direct`` when the worker's sink holds
plain tensors and ``ipc`` when it transforms them on load; elsewhere ``broadcast``. A
request the layout cannot serve is refused with the transport's reason and what to use
instead.
"""

from __future__ import annotations

from weightsync.core import registry
from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.messages import EndpointInfo


def requests() -> tuple[str, ...]:
    """What a worker's transport may be set to: ``auto`` or a registered transport."""
    return ("auto", *registry.names())


def check_request(requested: object, name: str) -> str:
    """``requested`` when it names ``auto`` or a registered transport; else SettingsError naming the worker."""
    allowed = requests()
    if requested not in allowed:
        raise SettingsError(f"transport for {name} must be one of {', '.join(allowed)}; got {requested!r}")
    return requested  # type: ignore[return-value]


def choose_transport(trainer: EndpointInfo, worker: EndpointInfo, requested: str, name: str) -> str:
    """The transport for worker ``name``, given what was requested for it."""
    check_request(requested, name)
    if requested == "auto":
        reasons = []
        for candidate in registry.auto_candidates():
            why = candidate.fits(trainer, worker, name)
            if why is None:
                return candidate.name
            reasons.append(f"{candidate.name}: {why}")
        raise SettingsError(f"{name}: no transport can serve it ({'; '.join(reasons)})")
    why = registry.get(requested).fits(trainer, worker, name)
    if why is not None:
        raise SettingsError(f"{name}: {why}")
    return requested
