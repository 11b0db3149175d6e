"""A listening worker's mailbox and doorbell: how a trainer starts a sync without a Ray call.

A direct worker in push mode (``WeightSync(..., push=True)``) runs a listener thread that
sleeps on its doorbell, a datagram socket on this host. The trainer posts the sync's
numbers in the worker's mailbox, rings, and writes as usual (the direct transport's own
control block carries the announcement and the completion); the listener runs the
worker's receive and leaves its answer, an :class:`~weightsync.core.wire.messages.PushAnswer`,
in the mailbox. Word layout after the control block's header::

    word 0  CALL        seq + 1 of the posted sync (0: none yet)
    word 1  VERSION     the version to commit
    word 2  FLAGS       bit 0 verify, bit 1 force
    word 3  ANSWERED    seq + 1 once the answer below is complete
    word 4  LENGTH      bytes of the pickled answer
    word 5  STOP        set by the worker when its listener ended (the trainer stops waiting)
    word 6  PART        slot + 1 on the coordinator's reply board where the worker also
                        leaves its answer (0: none; ``SyncCall.parts``)
    word 7  PART_TAG    that board's round tag
    then    the answer's bytes

Both sides of a mailbox live on one host; the doorbell is in
:mod:`weightsync.mechanisms.doorbell`.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import numpy as np
import torch

from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.messages import PushAnswer, ShmHandle, SyncCall
from weightsync.mechanisms.control import ControlBlock

CALL, VERSION, FLAGS, ANSWERED, LENGTH, STOP, PART, PART_TAG = range(8)
_HEADER_WORDS = 8
#: Room for an answer: a ReceiveResult without checksums, or an error with its message.
ANSWER_BYTES = 64 * 1024


class Mailbox:
    """One worker's mailbox (the worker creates it, the trainer attaches)."""

    def __init__(self, control: ControlBlock) -> None:
        self.control = control

    @classmethod
    def create(cls) -> Mailbox:
        return cls(ControlBlock.create(_HEADER_WORDS + ANSWER_BYTES // 8, tag="mbox"))

    @classmethod
    def attach(cls, mapped: torch.Tensor, who: str, path: str) -> Mailbox:
        return cls(ControlBlock.attach(mapped, who, path))

    def _area(self) -> np.ndarray:
        return self.control.words[self.control.first + _HEADER_WORDS :].view(np.uint8)

    # the trainer's side -------------------------------------------------------------------
    def post(self, call: SyncCall, part: tuple[int, int] | None = None) -> int:
        """Post ``call`` (``part``: the worker's (slot, round tag) on the coordinator's reply
        board); returns the call word it replaced (what :meth:`withdraw` restores)."""
        replaced = self.control[CALL]
        self.control[VERSION] = call.version
        self.control[FLAGS] = int(call.verify) | int(call.force) << 1
        self.control[PART], self.control[PART_TAG] = (part[0] + 1, part[1]) if part is not None else (0, 0)
        self.control[CALL] = call.seq + 1
        return replaced

    def withdraw(self, seq: int, replaced: int) -> None:
        """Take back call ``seq`` (its worker could not be woken, and its trainer gave up on
        it): the call word is ``replaced`` again, the call the listener answered last, so a
        listener that looks later finds nothing new to run."""
        if self.control[CALL] == seq + 1:
            self.control[CALL] = replaced

    def answer(self) -> PushAnswer:
        length = self.control[LENGTH]
        answer = pickle.loads(self._area()[:length].tobytes())
        if not isinstance(answer, PushAnswer):
            raise WeightSyncError(f"mailbox {self.control.path} holds a {type(answer).__name__}, not a PushAnswer")
        return answer

    # the worker's side --------------------------------------------------------------------
    def posted(self) -> SyncCall | None:
        """The sync posted last (its ``reply``: the slot where the worker also leaves its
        answer), or None."""
        call = self.control[CALL]
        if not call:
            return None
        flags, part = self.control[FLAGS], self.control[PART]
        return SyncCall(
            seq=call - 1,
            version=self.control[VERSION],
            verify=bool(flags & 1),
            force=bool(flags & 2),
            reply=(part - 1, self.control[PART_TAG]) if part else None,
        )

    def reply(self, seq: int, answer: PushAnswer, shorten: Callable[[PushAnswer], PushAnswer]) -> None:
        """Write ``answer`` (or, when it does not fit, ``shorten(answer)``) as sync ``seq``'s."""
        data = pickle.dumps(answer)
        if len(data) > ANSWER_BYTES:
            data = pickle.dumps(shorten(answer))
        if len(data) > ANSWER_BYTES:
            raise WeightSyncError(f"an answer of {len(data)} bytes does not fit a mailbox of {ANSWER_BYTES}")
        self._area()[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.control[LENGTH] = len(data)
        self.control[ANSWERED] = seq + 1

    def handle(self) -> ShmHandle:
        return self.control.handle()

    @property
    def stopped(self) -> bool:
        return bool(self.control[STOP])
