"""Running one step of Ray calls for the coordinator: submit together, await once, judge.

A step is a set of calls keyed by (party, phase). :meth:`Steps.gather` waits for all of
them within one deadline and turns every answer, or its absence, into an Outcome
(:func:`~weightsync.glue.calls.gather`). :meth:`Steps.run` is a setup step: on any failure
it applies the failure policy (:mod:`weightsync.core.policy`): dead workers are dropped,
the transports are torn down on every party that can still answer, and SetupError names
the culprits. :meth:`Steps.teardown` closes every transport on every live party.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from weightsync.core.policy import judge
from weightsync.core.wire.outcome import Outcome
from weightsync.core.wire.session import Deadlines
from weightsync.glue.calls import gather
from weightsync.glue.membership import Membership
from weightsync.glue.replies import Replies, ReplyRound

log = logging.getLogger("weightsync")
Calls = Mapping[tuple[str, str], Any]


class Steps:
    """The coordinator's way of calling its parties; ``deadlines`` gives the current policy."""

    def __init__(self, membership: Membership, deadlines: Callable[[], Deadlines], owner: str = "WeightSync") -> None:
        self.membership = membership
        self._deadlines = deadlines
        #: The coordinator's label, told to the trainer's parties with every teardown.
        self.owner = owner
        #: Called whenever a teardown ran: the coordinator is no longer set up.
        self.on_teardown: Callable[[], None] = lambda: None
        #: The reply board of the parties on this host (offered at setup, see Setup).
        self.replies = Replies(owner)

    @property
    def deadlines(self) -> Deadlines:
        return self._deadlines()

    def gather(
        self,
        calls: Calls,
        timeout_s: float | None = None,
        replies: ReplyRound | None = None,
        built: Mapping[tuple[str, str], Callable[[], Any]] | None = None,
    ) -> dict[tuple[str, str], Outcome]:
        """Every call's outcome (see :func:`~weightsync.glue.calls.gather`); ``replies``: the
        round whose reply board carries some of them; ``built``: answers other posts make."""
        return gather(calls, timeout_s or self.deadlines.coordinator_s, self.membership.handles(), replies, built)

    def run(self, calls: Calls, when: str, timeout_s: float | None = None) -> dict[str, Outcome]:
        """One setup step: every call's outcome by party (a party's failure wins over its
        other calls' success); on any failure, the policy's SetupError."""
        outs: dict[str, Outcome] = {}
        for (party, _), o in self.gather(calls, timeout_s).items():
            if party not in outs or not o.ok:
                outs[party] = o
        verdict = judge(outs, f"setup failed {when}")
        if verdict is not None:
            dropped = self.membership.drop(verdict.dead)
            self.teardown(abort=True, skip={*verdict.dead, *verdict.silent}, why=f"a failed setup, {when}")
            raise verdict.setup_error(dropped)
        return outs

    def teardown(
        self, abort: bool = False, skip: Iterable[str] = (), why: str = "a teardown", forget: bool = False
    ) -> None:
        """Close this coordinator's transports on every party not in ``skip``; failures are
        logged (a party that died is dropped by the step that saw it die, or named by the
        next setup). The trainer's parties are told who tore them down and ``why``; with
        ``forget`` (``close()``) they drop this coordinator's session altogether."""
        self.on_teardown()
        left_out = set(skip)
        calls = {
            (p, "teardown"): self.close_call(p, h, abort, why, forget)
            for p, h in self.membership.handles().items()
            if p not in left_out
        }
        for (party, _), o in self.gather(calls).items():
            if not o.ok:
                log.warning("weightsync: teardown on %s: %s", party, o.line())
        if forget:
            self.replies.close()

    def close_call(self, party: str, handle: Any, abort: bool, why: str, forget: bool = False) -> Any:
        """The teardown call of ``party`` for this coordinator's session (a worker another
        coordinator set up since keeps that one's): a trainer party is told who closes it,
        and why."""
        if party in self.membership.ranks.names:
            return handle.ws_teardown.remote(abort, f"{self.owner} ({why})", owner=self.owner, forget=forget)
        return handle.ws_teardown.remote(abort, owner=self.owner)

    def trainer_kwargs(self, party: str) -> dict[str, Any]:
        """What picks this coordinator's session in a call to ``party``: its label, for a
        trainer party (which holds one session per coordinator); nothing for a worker."""
        return {"owner": self.owner} if party in self.membership.ranks.names else {}
