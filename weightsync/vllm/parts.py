"""An engine whose TP ranks each receive on their own: which calls every rank runs, and one answer.

vLLM runs an engine with tensor parallelism as N worker processes. The coordinator sees the
engine as one worker and the engine actor forwards each of its calls to every rank at once
(``collective_rpc``). Two ways of serving the call:

- **relay** (the default): TP rank 0 is the worker; it runs the call and hands every tensor
  it loads on to the other ranks over vLLM's TP group (``relay.py``); they follow.
- **parts**: every rank runs the call as a receiver of its own, with its own Session and its
  own transport half (``rank-ipc``: each rank fed by the trainer rank on its device, all at
  once, no relay). The engine then answers for its parts together (:func:`combine`).

:class:`PartRouting`, held by the engine actor, decides per call and sends the decision
with it (``Call.every_rank``), so all ranks serve a call the same way::

    ws_describe, ws_accept      every rank (each has its Session; describe lists the parts)
    ws_open of a plug-in that
    feeds parts                 every rank; from here the engine is fed by parts
    any other call              every rank while fed by parts, else rank 0 leads
    ws_teardown                 as above; afterwards the engine is no longer fed by parts
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from weightsync import WeightSyncError, WorkerState
from weightsync.core.wire.messages import EndpointInfo, ReceiveResult
from weightsync.core.wire.outcome import Outcome, Status
from weightsync.vllm.codec import Reply

#: Calls every rank runs whether or not the engine is fed by parts: nothing in them moves
#: tensors, and a rank fed on its own needs its Session before its transport opens.
ALWAYS_EVERY_RANK = ("ws_describe", "ws_accept")

State = tuple[int | None, str]


class PartRouting:
    """Which calls every TP rank runs on its own (see the module doc); ``ranks``: the TP size
    (1, or native mode, where vLLM's own update path drives rank 0: never)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        #: True from a successful-or-not ``ws_open`` of a parts-feeding plug-in until teardown.
        self.fed_by_parts = False

    def every_rank(self, method: str, args: Sequence[Any]) -> bool:
        if self.ranks < 2:
            return False
        if method in ALWAYS_EVERY_RANK:
            return True
        if method == "ws_open":
            return bool(args) and bool(getattr(args[0], "feeds_parts", False))
        return self.fed_by_parts

    def refuse_staging_change(self, name: str, staged: bool, current: bool) -> None:
        """A coordinator feeding the engine by parts read its staging at setup and chains
        the parts' commits by it (all parts load or none does); a change meanwhile would go
        unseen until its next setup, so it is refused until the transport is torn down."""
        if self.fed_by_parts and staged != current:
            raise WeightSyncError(
                f"{name}: stage_updates({staged}) while a WeightSync feeds this engine part by part (rank-ipc); "
                f"it read stage_updates={current} at setup and commits the TP ranks by it. Change staging before "
                "building the WeightSync, or after closing it"
            )

    def forwarded(self, method: str, every_rank: bool) -> None:
        """Record a call that went to the ranks (also when it failed: every rank ran it)."""
        if method == "ws_open":
            self.fed_by_parts = every_rank
        elif method == "ws_teardown":
            self.fed_by_parts = False


def answer(method: str, replies: Sequence[Reply], every_rank: bool, name: str) -> tuple[Any, State | None]:
    """The engine's answer to a forwarded ``method`` and its (version, state) after it: rank
    0's, or with ``every_rank`` all ranks' combined."""
    if not every_rank:
        return replies[0].value, replies[0].state
    return combine(method, [r.value for r in replies], name), combine_states([r.state for r in replies])


def combine_states(states: Sequence[State | None]) -> State | None:
    """One (version, state) for the engine: the ranks' own when they agree; otherwise the
    engine is a mix of versions, so dirty, at the oldest version any rank holds."""
    known = [s for s in states if s is not None]
    if not known:
        return None
    if all(s == known[0] for s in known):
        return known[0]
    versions = [v for v, _ in known if v is not None]
    return (min(versions) if versions else None, WorkerState.DIRTY.value)


def combine(method: str, values: Sequence[Any], name: str) -> Any:
    """One answer for the engine from each rank's answer to ``method``, in rank order.

    A failure of any rank fails the engine's call, naming each failing rank; blame is what
    the ranks blame (``trainer-rank-<k>`` for the rank feeding a part that waited in vain).
    A describe lists every rank as a part; receive and commit report the state of the whole
    engine; checksums must agree between ranks (each loaded the same full tensors).
    """
    if method == "ws_status":
        return combine_states(values)
    outcomes: list[Outcome] = list(values)
    bad = [(k, o) for k, o in enumerate(outcomes) if not o.ok]
    if bad:
        return _failure(bad, name)
    first = outcomes[0]
    if method == "ws_describe":
        infos: list[EndpointInfo] = [o.value for o in outcomes]
        return dataclasses.replace(first, value=dataclasses.replace(infos[0], parts=tuple(infos)))
    if method in ("ws_receive", "ws_commit"):
        return dataclasses.replace(first, value=_result([o.value for o in outcomes], name))
    if method == "ws_settle":
        return dataclasses.replace(first, value=combine_states([o.value for o in outcomes]))
    if method == "ws_checksums":
        for k, o in enumerate(outcomes[1:], start=1):
            if o.value != first.value:
                why = (
                    f"{name}: TP rank {k} holds other bytes than TP rank 0 (per-tensor checksums differ, "
                    f"{_first_difference(first.value, o.value)}); every rank loads the same full tensors, so "
                    "one of them was written wrongly: sync again"
                )
                return Outcome(
                    party=name,
                    phase=first.phase,
                    status=Status.FAILED,
                    error="VerificationError",
                    message=why,
                    blames=(name,),
                )
    return first


def _first_difference(a: Any, b: Any) -> str:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{len(a)} against {len(b)} tensors"
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"first at tensor #{i}"
    return "they differ"


def _result(results: Sequence[ReceiveResult], name: str) -> ReceiveResult:
    state = combine_states([(r.version, r.state) for r in results])
    assert state is not None
    stale = tuple(dict.fromkeys(s for r in results for s in r.stale))
    return dataclasses.replace(
        results[0],
        worker=name,
        version=state[0],
        state=state[1],
        seconds=max(r.seconds for r in results),
        stale=stale,
        parts=tuple(dataclasses.replace(r, parts=()) for r in results),
    )


def _failure(bad: Sequence[tuple[int, Outcome]], name: str) -> Outcome:
    """One failed outcome naming every failing rank; its own failure (not a consequence of
    another party's) leads."""
    own = [o for _, o in bad if not o.consequence]
    lead = own[0] if own else bad[0][1]
    lines = "; ".join(f"TP rank {k}: {o.error}: {o.message}" for k, o in bad)
    # A rank's own failure is the engine's: what the other ranks blame (their peers, who
    # aborted because of it) would pass the blame away from it.
    blames = tuple(dict.fromkeys(b for o in (own or [o for _, o in bad]) for b in o.blames))
    return Outcome(
        party=name,
        phase=lead.phase,
        status=Status.FAILED,
        error=lead.error,
        message=lines,
        blames=blames,
        consequence=all(o.consequence for _, o in bad),
    )
