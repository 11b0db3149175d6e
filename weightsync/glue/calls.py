"""Waiting on the Ray calls of one step, and turning every answer into an Outcome.

Each party answers with an :class:`~weightsync.core.wire.outcome.Outcome` of its own. What only
the coordinator sees becomes one too: an actor that died (``dead``; or, when the actor that
died was another party the call depended on, a failed consequence), a call that gave no
answer by the deadline (``timed_out``: frozen, stuck or far too slow).

Call order: submit every party's call, then ``gather(calls, timeout)`` once.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from weightsync.core.wire.outcome import Outcome, Status


def _cause(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(exc, RayTaskError) and isinstance(cause, BaseException) else exc


def _from_error(party: str, phase: str, exc: BaseException, handle: Any) -> Outcome:
    if isinstance(exc, RayActorError):
        died = getattr(exc, "actor_id", None)
        mine = getattr(handle, "_actor_id", None)
        if died is None or mine is None or str(died) == mine.hex():
            return Outcome(party=party, phase=phase, status=Status.DEAD, error=type(exc).__name__, message=str(exc))
        return Outcome(
            party=party,
            phase=phase,
            status=Status.FAILED,
            error=type(exc).__name__,
            message=f"stopped: an actor it depended on died ({str(exc)[:300]})",
            consequence=True,
        )
    cause = _cause(exc)
    return Outcome(
        party=party,
        phase=phase,
        status=Status.FAILED,
        error=type(cause).__name__,
        message=str(cause),
        blames=tuple(getattr(cause, "blames", ())),
        consequence=bool(getattr(cause, "consequence", False)),
    )


def _named(party: str, phase: str, value: Any) -> Outcome:
    if isinstance(value, Outcome):
        if value.party == party and value.phase == phase:
            return value
        return Outcome(
            party=party,
            phase=phase,
            status=value.status,
            error=value.error,
            message=value.message,
            blames=value.blames,
            consequence=value.consequence,
            value=value.value,
        )
    return Outcome(party=party, phase=phase, status=Status.OK, value=value)


def gather(
    calls: Mapping[tuple[str, str], Any], timeout_s: float, handles: Mapping[str, Any]
) -> dict[tuple[str, str], Outcome]:
    """Every call's Outcome, keyed by (party, phase), waiting at most ``timeout_s`` in all.

    ``handles`` maps each party to its actor handle, to tell a party's own death from that
    of an actor its call depended on.
    """
    keys = list(calls)
    refs = [calls[k] for k in keys]
    deadline = time.monotonic() + timeout_s
    try:  # the common case, in one call
        values = ray.get(refs, timeout=timeout_s)
        return {k: _named(k[0], k[1], v) for k, v in zip(keys, values)}
    except RayError:
        pass  # a failure or a timeout: told apart per call below
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
    done = set(ready)
    out: dict[tuple[str, str], Outcome] = {}
    for key, ref in zip(keys, refs):
        party, phase = key
        if ref not in done:
            out[key] = Outcome(
                party=party,
                phase=phase,
                status=Status.TIMED_OUT,
                error="no answer",
                message=f"no answer within {timeout_s:.1f}s",
            )
            continue
        try:
            out[key] = _named(party, phase, ray.get(ref, timeout=max(1.0, deadline - time.monotonic())))
        except RayError as exc:
            out[key] = _from_error(party, phase, exc, handles.get(party))
    return out
