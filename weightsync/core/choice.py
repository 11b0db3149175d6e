"""Which transport each worker gets: a pure function of where the two endpoints live.

``auto`` takes the first of the registry's candidates (:func:`~weightsync.core.registry.auto_candidates`,
by their ``auto_rank``) whose fit accepts the pair: with the built-ins, the same device (the
same GPU by UUID, or the same node on CPU) gives ``direct`` when the worker's sink holds
plain tensors and ``ipc`` when it transforms them on load; elsewhere ``broadcast``. A
request the layout cannot serve is refused with the transport's reason and what to use
instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.core import registry
from weightsync.core.plugin import Serving, Transport
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


def _why_not(
    transport: Transport, trainer: EndpointInfo, every: Sequence[EndpointInfo], worker: EndpointInfo, name: str
) -> str | None:
    """Why ``transport`` cannot serve ``worker``: checked against ``trainer``, or, for a
    transport every rank serves at once, against each of ``every`` (the ranks in order)."""
    if transport.fits_every is not None:
        why = transport.fits_every(every or (trainer,), worker, name)
        if why is not None:
            return why
    if transport.serving is not Serving.EVERY or len(every) < 2:
        return transport.fits(trainer, worker, name)
    for rank, info in enumerate(every):
        why = transport.fits(info, worker, name)
        if why is not None:
            return f"(trainer rank {rank}) {why}"
    return None


def choose_transport(
    trainer: EndpointInfo, worker: EndpointInfo, requested: str, name: str, every: Sequence[EndpointInfo] = ()
) -> str:
    """The transport for worker ``name``, given what was requested for it. ``trainer``: the
    trainer party that would serve it alone; ``every``: all the trainer's ranks (for the
    transports that every rank serves)."""
    check_request(requested, name)
    if requested == "auto":
        reasons = []
        for candidate in registry.auto_candidates():
            why = _why_not(candidate, trainer, every, worker, name)
            if why is None:
                return candidate.name
            reasons.append(f"{candidate.name}: {why}")
        raise SettingsError(f"{name}: no transport can serve it ({'; '.join(reasons)})")
    why = _why_not(registry.get(requested), trainer, every, worker, name)
    if why is not None:
        raise SettingsError(f"{name}: {why}")
    return requested
