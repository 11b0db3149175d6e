"""A push's answer built from its parties' own posts on the reply board.

Through ``WeightSync.sync`` a push is one call to the trainer, whose answer carries every
listening worker's: each worker answers into its mailbox, and the trainer reads the answers
before it answers the coordinator, one more hand-off between processes after the copy.
With a reply board the trainer party also leaves its send's outcome, and each worker its
answer, in a slot of the round of their own (``SyncCall.parts``), and the coordinator takes
the push's answer as soon as every part is there and every one succeeded. A failure, or a
part missing or too big for its slot, leaves the answer to the trainer's call, which then
decides as it does without parts (deaths, timeouts, blame). In order::

    pushed = round.call(key, call)                       the trainer's own slot first
    parts = PushParts.ask(round, lead, workers, version)   None unless every party has one
    pushed = parts.call(pushed)
    gather({key: ws_push ref}, replies=round, built={key: parts.answer})

The trainer's call still ends, and Ray still answers it, after the coordinator went on;
the trainer runs one call at a time, so the next sync waits for it there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from weightsync.core.wire.messages import PushAnswer, PushResult, SendResult, SyncCall
from weightsync.core.wire.outcome import Outcome, ok
from weightsync.glue.replies import Key, ReplyRound
from weightsync.mechanisms.board import TOO_BIG


class PushParts:
    """The slots of one push's parts in a round, and the answer once they all came."""

    def __init__(self, replies: ReplyRound, keys: dict[str, Key], lead: str, version: int) -> None:
        self._replies = replies
        self._keys = keys
        self._lead = lead
        self._version = version
        self._got: dict[str, object] = {}
        self._declined = False

    @classmethod
    def ask(cls, replies: ReplyRound, lead: str, workers: Sequence[str], version: int) -> PushParts | None:
        """Slots for trainer party ``lead``'s send and each of ``workers``' answers; None
        when one of them does not answer on the board (the trainer's answer is the one)."""
        keys: dict[str, Key] = {lead: (lead, "sent"), **{w: (w, "pushed") for w in workers}}
        if not workers or any(party not in replies.parties for party in keys):
            return None
        if any(replies.slot(key) is None for key in keys.values()):
            return None
        return cls(replies, keys, lead, version)

    def call(self, call: SyncCall) -> SyncCall:
        """``call`` naming every part's slot."""
        return replace(call, parts=tuple((party, self._replies.slots[key]) for party, key in self._keys.items()))

    def answer(self) -> Outcome | None:
        """The push's answer, as the trainer's call would give it, once every part came and
        succeeded; None until then, and for good once one failed or did not fit its slot."""
        if self._declined:
            return None
        for party, key in self._keys.items():
            if party in self._got:
                continue
            value = self._replies.take(key)
            if value is None:
                return None
            if value is TOO_BIG or not _succeeded(value, party == self._lead):
                self._declined = True
                return None
            self._got[party] = value
        sent = self._got[self._lead]
        assert isinstance(sent, Outcome)
        workers = {p: a for p, a in self._got.items() if isinstance(a, PushAnswer)}
        return ok(self._lead, "push", PushResult(version=self._version, sent=sent, workers=workers))


def _succeeded(value: object, sent: bool) -> bool:
    """Whether ``value`` is a part that succeeded: the send's outcome, or a worker's answer."""
    if sent:
        return isinstance(value, Outcome) and value.ok and isinstance(value.value, SendResult)
    return isinstance(value, PushAnswer) and value.outcome.ok
