"""Waiting on the Ray calls of one step, and turning every answer into an Outcome.

Each party answers with an :class:`~weightsync.core.wire.outcome.Outcome` of its own. What only
the coordinator sees becomes one too: an actor that died (``dead``; or, when the actor that
died was another party the call depended on, a failed consequence), a call that gave no
answer by the deadline (``timed_out``: frozen, stuck or far too slow).

Call order: submit every party's call, then ``gather(calls, timeout)`` once. With a reply
board (:mod:`weightsync.glue.replies`), the calls it carries are read from it first and
only the others, and any it does not carry after all, from Ray.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

from weightsync.core.wire.outcome import Outcome, Status
from weightsync.mechanisms.board import TOO_BIG
from weightsync.mechanisms.streams import precise_sleeps

if TYPE_CHECKING:
    from weightsync.glue.replies import ReplyRound

#: How often a wait on the reply board asks Ray whether a call it waits for ended without
#: posting (its actor died): what such a death costs in delay.
_RAY_EVERY_S = 0.002
#: The board is polled with sleeps of at most _SHORT_SLEEP_S for the first _SHORT_FOR_S of a
#: wait, then of _LONG_SLEEP_S (a sync that long gains nothing from finer polling).
_SHORT_SLEEP_S, _SHORT_FOR_S, _LONG_SLEEP_S = 20e-6, 0.1, 200e-6


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
    calls: Mapping[tuple[str, str], Any],
    timeout_s: float,
    handles: Mapping[str, Any],
    replies: ReplyRound | None = None,
    built: Mapping[tuple[str, str], Callable[[], Any]] | None = None,
) -> dict[tuple[str, str], Outcome]:
    """Every call's Outcome, keyed by (party, phase), waiting at most ``timeout_s`` in all.

    ``handles`` maps each party to its actor handle, to tell a party's own death from that
    of an actor its call depended on. ``replies``: the round whose board carries some of
    the calls' answers. ``built``: per call, another way its answer comes: a function
    polled with the board that returns the answer once other posts of the round make it
    (:mod:`weightsync.glue.push_parts`), None until then.
    """
    deadline = time.monotonic() + timeout_s
    out: dict[tuple[str, str], Outcome] = {}
    if replies is not None and replies.slots:
        out = _from_board(calls, replies, deadline, built or {})
    rest = {k: ref for k, ref in calls.items() if k not in out}
    if rest:
        out.update(_from_ray(rest, timeout_s, deadline, handles))
    return out


def _from_board(
    calls: Mapping[tuple[str, str], Any],
    replies: ReplyRound,
    deadline: float,
    built: Mapping[tuple[str, str], Callable[[], Any]],
) -> dict[tuple[str, str], Outcome]:
    """The answers the board carries, as they come; stops waiting for a call once Ray has
    its answer instead (it raised, its answer did not fit, or its party died), or at the
    deadline (the rest is Ray's to answer or time out)."""
    waiting = [k for k in replies.slots if k in calls]
    out: dict[tuple[str, str], Outcome] = {}
    start = time.monotonic()
    ask_ray = start + _RAY_EVERY_S
    delay = 10e-6
    doorbell = replies.doorbell
    with precise_sleeps() if doorbell is None else contextlib.nullcontext():
        while waiting:
            for key in list(waiting):
                value = replies.take(key)
                if value is None and key in built:
                    value = built[key]()
                if value is None:
                    continue
                waiting.remove(key)
                if value is not TOO_BIG:
                    out[key] = _named(key[0], key[1], value)
            now = time.monotonic()
            if not waiting or now > deadline:
                break
            if now >= ask_ray:
                ask_ray = now + _RAY_EVERY_S
                refs = [calls[k] for k in waiting]
                ended = set(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0])
                # Ended without an answer on the board (a death; a post lost to a kill): Ray's.
                waiting = [k for k in waiting if calls[k] not in ended or replies.take(k) is not None]
            if doorbell is not None:
                doorbell.wait(max(0.0, min(ask_ray, deadline) - time.monotonic()))
                continue
            time.sleep(delay)
            # Short sleeps while a colocated sync's answers are due; long syncs poll less often.
            delay = min(delay * 2, _SHORT_SLEEP_S if now - start < _SHORT_FOR_S else _LONG_SLEEP_S)
    if doorbell is not None:
        doorbell.drain()  # the rings of answers read without waiting: none is left for the next round
    return out


def _from_ray(
    calls: Mapping[tuple[str, str], Any], timeout_s: float, deadline: float, handles: Mapping[str, Any]
) -> dict[tuple[str, str], Outcome]:
    keys = list(calls)
    refs = [calls[k] for k in keys]
    try:  # the common case, in one call
        values = ray.get(refs, timeout=max(0.0, deadline - time.monotonic()))
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
