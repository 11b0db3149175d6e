"""How long one sync held generation off on an engine, measured by the engine's actor.

The coordinator's calls on a worker for one sync are ``ws_receive`` and, when its transport
cannot tell that the sender finished (broadcast) or with ``verify``, a ``ws_commit``. An
engine actor holds generation off from the start of ``ws_receive`` (the first call that
loads) until a call leaves the receiver out of ``receiving`` (committed, or dirty after a
failure) or a ``ws_settle`` / ``ws_teardown`` ends the sync. Call order in the actor::

    if hold.begins(method): hold.start(in_flight)      # then pause (or block) generation,
                                                       # hold.paused() once paused
    reply = <the call, forwarded to the engine's workers>
    if hold.ends(method, reply.state):                 # resume generation, then
        value = with_held_off(value, hold.stop(state, method))   # the answer carries the seconds
    (a call that raises: resume generation, hold.stop("failed", method), raise)

The seconds go back in the :class:`~weightsync.core.wire.messages.ReceiveResult` of the
call that ended the hold, so the coordinator's :class:`~weightsync.SyncReport` shows them
per worker (``WorkerReport.held_off_s``). A hold that a ``ws_settle`` or ``ws_teardown``
ends belongs to a failed sync, which has no report: :attr:`SyncHold.last` (the actors'
``last_hold()``) records every hold, with the call that ended it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from weightsync import WorkerState
from weightsync.core.wire.messages import ReceiveResult
from weightsync.core.wire.outcome import Outcome

#: The call that opens a hold (if none is open).
OPENS = "ws_receive"
#: Calls that end an open hold whatever the receiver's state: the sync is over.
RELEASES = ("ws_settle", "ws_teardown")
#: vLLM's pause modes, what an actor that pauses generation (rather than blocking it) takes.
PAUSE_MODES = ("keep", "wait", "abort")


def check_pause_mode(mode: str) -> str:
    """``mode`` when it is one of :data:`PAUSE_MODES`; else ValueError naming them."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return mode


@dataclass(frozen=True, kw_only=True)
class HoldRecord:
    """One completed hold, as :meth:`VLLMWorker.last_hold` returns it."""

    #: Seconds from pausing (or blocking) generation to resuming it.
    seconds: float
    #: Of ``seconds``, the time pausing took (vLLM's ``pause_generation``; with "wait" the
    #: in-flight requests' drain); 0 for a synchronous ``LLM``, blocked at once.
    pausing_s: float
    #: Generation requests the engine had unfinished when the hold began.
    in_flight: int
    #: How in-flight requests were treated: "block" (a synchronous ``LLM``: a running
    #: ``generate`` call finishes first) or vLLM's pause mode ("keep", "wait", "abort").
    mode: str
    #: The receiver's state when the hold ended ("committed", "dirty", ...; "failed" when
    #: the call that ended it raised).
    state: str
    #: The coordinator's call that ended it: ``ws_receive`` or ``ws_commit`` when the sync
    #: went through (or failed in that call), ``ws_settle`` or ``ws_teardown`` when the sync
    #: failed elsewhere and the coordinator cleaned up (a failed sync has no report: its
    #: hold is only here).
    ended_by: str

    def __post_init__(self) -> None:
        if not self.ended_by:
            raise ValueError("HoldRecord.ended_by must name the call that ended the hold, got ''")
        if not self.seconds >= self.pausing_s >= 0:
            raise ValueError(
                f"HoldRecord needs seconds >= pausing_s >= 0, got seconds={self.seconds!r}, pausing_s={self.pausing_s!r}"
            )
        if self.in_flight < 0:
            raise ValueError(f"HoldRecord.in_flight must be >= 0, got {self.in_flight!r}")


class SyncHold:
    """The hold bookkeeping of one engine actor (not thread-safe: use it under the actor's lock)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._started: float | None = None
        self._in_flight = 0
        self._paused: float | None = None
        self.last: HoldRecord | None = None

    @property
    def open(self) -> bool:
        return self._started is not None

    def begins(self, method: str) -> bool:
        return method == OPENS and self._started is None

    def start(self, in_flight: int) -> None:
        self._started = time.perf_counter()
        self._paused = None
        self._in_flight = in_flight

    def paused(self) -> None:
        """Generation is paused now (the hold began with a request to pause)."""
        self._paused = time.perf_counter()

    def ends(self, method: str, state: tuple[int | None, str] | None) -> bool:
        """Whether the hold ends after ``method`` answered with receiver ``state``."""
        if self._started is None:
            return False
        return method in RELEASES or state is None or state[1] != WorkerState.RECEIVING.value

    def stop(self, state: str, ended_by: str) -> float:
        """Close the open hold, recorded as ended by call ``ended_by`` with receiver
        ``state``; returns its seconds."""
        if self._started is None:
            raise RuntimeError("SyncHold.stop without an open hold")
        seconds = time.perf_counter() - self._started
        pausing = self._paused - self._started if self._paused is not None else 0.0
        self._started = None
        self.last = HoldRecord(
            seconds=seconds,
            pausing_s=pausing,
            in_flight=self._in_flight,
            mode=self.mode,
            state=state,
            ended_by=ended_by,
        )
        return seconds


def with_held_off(value: Any, seconds: float) -> Any:
    """``value`` (a call's answer) with ``held_off_s`` set when it carries a ReceiveResult."""
    if isinstance(value, Outcome) and isinstance(value.value, ReceiveResult):
        return dataclasses.replace(value, value=dataclasses.replace(value.value, held_off_s=seconds))
    return value
