"""One sync round: every party's call submitted together, awaited once, failures judged once.

A round, as :class:`Round` runs it::

    per trainer rank:  ws_send(call for the workers it serves)     (ranks first: their checks
                                                                    and first chunk overlap the
                                                                    workers' calls starting)
    per worker:        ws_receive(call)
    per worker whose transport cannot tell that the sender finished, every worker fed
    part by part that stages, and every worker
    with verify:       ws_commit(call, receive ref, lead's send ref  (chained on the answers by
                                 with verify, *send refs)            object refs: no round trip;
                                                                     every rank's with owner
                                                                     sends; the destination is
                                                                     checked against the lead's
                                                                     checksums)
    gather once -> each party's final outcome -> all ok, or the failure policy

The parties on the coordinator's host answer on its reply board as well as through Ray
(:mod:`weightsync.glue.replies`), which spares a colocated sync Ray's return leg.

In push mode a round is one call, to the trainer, which wakes the listening workers
itself. On a failure (:meth:`Round.fail`): the policy's verdict names the culprits, dead
workers are dropped, every worker that can still answer settles (a worker left mid-write
is dirty), the transports are torn down, and SyncError carries what each worker holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, NoReturn

from weightsync.core import registry
from weightsync.core.plugin import Serving
from weightsync.core.policy import Verdict, judge
from weightsync.core.wire.errors import SyncError
from weightsync.core.wire.messages import ReceiveResult, SendResult, SyncCall
from weightsync.core.wire.outcome import Outcome
from weightsync.glue.membership import Member, Membership
from weightsync.glue.push_parts import PushParts
from weightsync.glue.ranks import TrainerRanks
from weightsync.glue.steps import Steps

log = logging.getLogger("weightsync")
Results = tuple[SendResult, dict[str, ReceiveResult]]


def commits_alone(member: Member) -> bool:
    """Whether ``member`` commits as its receive returns (without verify): its transport's
    rule, except that a worker fed part by part whose sink stages (``EndpointInfo.stages``)
    commits in a chained call, once every part received, so all parts load or none does."""
    transport = registry.get(member.transport)
    staged_parts = transport.feeds_parts and member.info is not None and member.info.stages
    return transport.commits_alone and not staged_parts


def targets(members: Sequence[Member]) -> dict[str, tuple[str, ...]]:
    """Per transport, in the order the trainer drives them, the workers on it."""
    order = {t.name: (t.send_order, i) for i, t in enumerate(registry.transports())}
    kinds = sorted({m.transport for m in members}, key=lambda k: order.get(k, (1 << 30, 0)))
    return {kind: tuple(m.name for m in members if m.transport == kind) for kind in kinds}


def with_every_rank(lead: SendResult, every: Sequence[SendResult]) -> SendResult:
    """The lead rank's answer with ``sent_bytes`` summed over every rank's, per transport
    (owner sends, and colocated workers served by their own rank, move bytes on each)."""
    if len(every) < 2:
        return lead
    sent: dict[str, int] = {}
    for result in every:
        for kind, nbytes in result.sent_bytes.items():
            sent[kind] = sent.get(kind, 0) + nbytes
    return replace(lead, sent_bytes=sent)


class Round:
    """Runs rounds for one WeightSync (its membership and its way of calling parties)."""

    def __init__(self, membership: Membership, steps: Steps) -> None:
        self.membership = membership
        self.ranks: TrainerRanks = membership.ranks
        self.steps = steps

    def run(self, call: SyncCall, members: Sequence[Member]) -> Results:
        """One round over ``members`` (all workers, or those re-exported)."""
        lead = self.ranks.lead
        calls: dict[tuple[str, str], Any] = {}
        every = {m.name for m in members if registry.get(m.transport).serving is Serving.EVERY}
        # With verify every worker commits in a chained call: its destination is compared
        # with the lead's checksums (one reference for every rank's workers). The workers
        # are told which of them wait for that call rather than commit in their receive.
        chained = {m.name for m in members if call.verify or not commits_alone(m)}
        call = replace(call, chained=tuple(sorted(chained)))
        replies = self.steps.replies.round()

        def told(key: tuple[str, str], told_call: SyncCall) -> SyncCall:
            return replies.call(key, told_call) if replies is not None else told_call

        for r, (rank, handle) in enumerate(self.ranks.parties().items()):
            mine = [m.name for m in members if m.rank == r or m.name in every]
            calls[(rank, "send")] = handle.ws_send.remote(told((rank, "send"), TrainerRanks.call_for(call, mine)))
        for m in members:
            calls[(m.name, "receive")] = m.handle.ws_receive.remote(told((m.name, "receive"), call))
        reference = calls[(lead, "send")]
        waits: dict[str, set[str]] = {}  # per chained commit, whose answers Ray waits for
        for m in (m for m in members if m.name in chained):
            servers = self.ranks.names if m.name in every else [self.ranks.names[m.rank]]
            sent = [calls[(server, "send")] for server in servers]
            waits[m.name] = {*servers, *([lead] if call.verify else [])}
            calls[(m.name, "commit")] = m.handle.ws_commit.remote(
                told((m.name, "commit"), call), calls[(m.name, "receive")], reference if call.verify else None, *sent
            )
        outs = self.steps.gather(calls, replies=replies)
        final = {rank: outs[(rank, "send")] for rank in self.ranks.names}
        for m in members:
            received = outs[(m.name, "receive")]
            final[m.name] = outs[(m.name, "commit")] if m.name in chained and received.ok else received
        verdict = judge(final, f"sync failed during the transfer of version {call.version}")
        if verdict is not None:
            self.fail(verdict, waits)
        return with_every_rank(final[lead].value, [final[r].value for r in self.ranks.names]), {
            m.name: final[m.name].value for m in members
        }

    def push(self, call: SyncCall, set_up: Callable[[], object]) -> Results:
        """Push mode: one call to the trainer; an earlier in-trainer push that failed makes
        the trainer ask for a new setup first (``set_up``), once."""
        when = f"during the push of version {call.version}"
        lead = self.ranks.lead
        trainer = self.ranks.handles[0]
        for attempt in range(2):
            replies = self.steps.replies.round()
            key = (lead, "push")
            pushed, built = call, {}
            if replies is not None:
                pushed = replies.call(key, call)
                workers = [w for names in (call.targets or {}).values() for w in names]
                parts = PushParts.ask(replies, lead, workers, call.version) if pushed.reply is not None else None
                if parts is not None:
                    pushed, built = parts.call(pushed), {key: parts.answer}
            ref = trainer.ws_push.remote(pushed, self.steps.owner)
            o = self.steps.gather({key: ref}, replies=replies, built=built)[key]
            verdict = judge({lead: o}, f"sync failed {when}")
            if verdict is not None:
                self.fail(verdict)
            if not o.value.setup_needed or attempt:
                break
            set_up()
        result = o.value
        if result.setup_needed:
            raise SyncError(f"the trainer still refuses pushes after a new setup {when}", {lead: o}, [lead])
        final: dict[str, Outcome] = {lead: result.sent, **{n: a.outcome for n, a in result.workers.items()}}
        verdict = judge(final, f"sync failed {when}")
        if verdict is not None:
            self.fail(verdict)
        return result.sent.value, {n: a.outcome.value for n, a in result.workers.items()}

    def fail(self, verdict: Verdict, waits: Mapping[str, set[str]] | None = None) -> NoReturn:
        """Carry out ``verdict``: drop the dead, settle who can answer, tear down, raise.

        ``waits``: per worker whose commit was chained on other parties' answers, those
        parties. Ray starts an actor's calls in order, and a call still waiting for an
        argument holds back the ones after it: a worker whose commit waits for a silent
        party (a frozen trainer rank) would take a settle or teardown only once that party
        answered, so neither is sent (each would wait a deadline for nothing); the error
        names what the worker waits for.
        """
        dropped = self.membership.drop(verdict.dead)
        silent = set(verdict.silent)
        waiting = {
            name: sorted(parties & silent)
            for name, parties in (waits or {}).items()
            if parties & silent and name in self.membership.members
        }
        settle = [name for name in verdict.settle(self.membership.members) if name not in waiting]
        settled = self.steps.gather(
            {
                (name, "settle"): self.membership.members[name].handle.ws_settle.remote(owner=self.steps.owner)
                for name in settle
            }
        )
        held: dict[str, tuple[int | None, str]] = {}
        for (name, _), o in settled.items():
            if o.ok:
                held[name] = o.value
            else:
                log.warning("weightsync: could not settle %s after a failed sync: %s", name, o.line())
        self.steps.teardown(abort=True, skip={*verdict.silent, *waiting}, why="a failed sync")
        raise verdict.sync_error(held, dropped, waiting)


def stale_members(results: Mapping[str, ReceiveResult], membership: Membership) -> list[Member]:
    """The workers that answered "stale": their tensors moved since their export, nothing written."""
    return [membership.members[n] for n, r in results.items() if r.stale and n in membership.members]
