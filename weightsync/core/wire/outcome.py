"""Failures as data: every party's answer to a call is an :class:`Outcome`.

A party that fails turns its exception into an Outcome at once (:func:`failed`), with the
error's class name, its message, and the two facts the coordinator needs: whether the
failure is a consequence of another party's (a peer aborted, a wait on a peer ran out) and
whom it blames. The coordinator adds the outcomes it sees itself (a call whose actor died,
a call that gave no answer in time) and decides teardown and blame with
:func:`assign_blame`, a pure function of the outcomes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class Status(str, enum.Enum):
    OK = "ok"
    FAILED = "failed"  # the call raised; ``error`` and ``message`` say what
    DEAD = "dead"  # the party's actor died
    TIMED_OUT = "timed_out"  # no answer within the deadline: frozen, stuck or far too slow


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One party's outcome of one call (``phase``: describe, accept, send, receive, ...)."""

    party: str
    phase: str
    status: Status
    error: str = ""
    message: str = ""
    blames: tuple[str, ...] = ()
    consequence: bool = False
    value: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.status, Status):
            object.__setattr__(self, "status", Status(self.status))
        if self.status is Status.OK and self.error:
            raise ValueError(f"{self.party}/{self.phase}: an ok outcome cannot carry error {self.error!r}")
        object.__setattr__(self, "blames", tuple(self.blames))

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def line(self) -> str:
        """One line for an error message: who, what happened."""
        if self.ok:
            return f"{self.party}: ok"
        what = {
            Status.DEAD: "actor died",
            Status.TIMED_OUT: "gave no answer in time (frozen, stuck or too slow)",
        }.get(self.status, self.error)
        detail = f": {self.message}" if self.message else ""
        return f"{self.party} ({self.phase}): {what}{detail}".replace("\n", "\n    ")


def ok(party: str, phase: str, value: Any = None) -> Outcome:
    return Outcome(party=party, phase=phase, status=Status.OK, value=value)


def failed(party: str, phase: str, exc: BaseException) -> Outcome:
    """The outcome of a call that raised ``exc``, read from the exception's type and attributes."""
    return Outcome(
        party=party,
        phase=phase,
        status=Status.FAILED,
        error=type(exc).__name__,
        message=str(exc) or type(exc).__name__,
        blames=tuple(getattr(exc, "blames", ())),
        consequence=bool(getattr(exc, "consequence", False)),
    )


def assign_blame(outcomes: Mapping[str, Outcome]) -> list[str]:
    """The parties to blame for the failures among ``outcomes``, sorted.

    A party whose actor died or that never answered is blamed. A failure of its own (not a
    consequence) is blamed on the parties it names, or on itself when it names none. A
    consequence (a peer aborted, a wait on a peer ran out) passes the blame on to the
    parties it names, following their own outcomes. When that leaves nobody, every failing
    party is blamed.
    """

    def roots(party: str, seen: frozenset[str]) -> set[str]:
        o = outcomes[party]
        if o.ok:
            return set()
        if o.status is not Status.FAILED:
            return {party}
        named = [b for b in o.blames if b in outcomes and b != party and b not in seen]
        if not o.consequence:
            return set(named) or {party}
        found: set[str] = set()
        for b in named:
            found |= roots(b, seen | {party})
        return found

    bad = sorted(party for party, o in outcomes.items() if not o.ok)
    culprits: set[str] = set()
    for party in bad:
        culprits |= roots(party, frozenset())
    return sorted(culprits) or bad


def describe_failure(title: str, outcomes: Mapping[str, Outcome], culprits: Sequence[str]) -> str:
    """A failure's message: the title, whom it blames, then one line per failing party
    (the culprits first)."""
    bad = [o for o in outcomes.values() if not o.ok]
    bad.sort(key=lambda o: (o.party not in culprits, o.party))
    return f"{title}; blamed: {', '.join(culprits) or 'nobody'}\n  " + "\n  ".join(o.line() for o in bad)
