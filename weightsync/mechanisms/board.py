"""A coordinator's reply board: the answers of a sync's calls without Ray's return leg.

A Ray call's answer reaches its caller through several threads of both processes, and on
the hosts measured that return leg of a sync's calls took 0.3-1.0 ms (longer after a long
call, when those threads had gone idle), a large part of a small or colocated sync. A
party on the coordinator's host also writes its answer into a slot of a ``/dev/shm``
region the coordinator polls, and the coordinator goes on once every answer is there.
Ray's answer still comes, and is the one read when a slot stays empty (a party that died,
or one whose answer is too big for its slot). Slot layout, int64 words then bytes::

    word 0  TAG      the round the answer belongs to (0 while it is being written)
    word 1  LENGTH   bytes of the answer; -1: too big for the slot, read Ray's answer
    word 2  DIGEST   the answer bytes' 64-bit BLAKE2b digest
    word 3  (spare)
    then    the answer's bytes

Within a round each slot has one writer, but a party late for an earlier round may write a
slot that a later round gave another party: the tag, the digest and the answer's own
identity (checked by the caller) make the reader take only one writer's complete answer
of this round, never a mixture.

Call order: the coordinator ``ReplyBoard.create(slots, slot_bytes)``, hands
:meth:`ReplyBoard.handle` to each party, which ``ReplyBoard.attach(handle)`` once; once all
have, the coordinator :meth:`unlink` s the name. Per round each party
``post(slot, tag, bytes)``; the coordinator ``take(slot, tag)`` until it has every answer.
"""

from __future__ import annotations

import hashlib

import numpy as np

from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.messages import ShmHandle
from weightsync.mechanisms.control import ControlBlock
from weightsync.mechanisms.shm import map_shm

TAG, LENGTH, DIGEST = range(3)
_HEADER_WORDS = 4
#: What :meth:`ReplyBoard.take` returns for an answer too big for its slot.
TOO_BIG = object()


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


class ReplyBoard:
    """``slots`` slots of ``slot_bytes`` answer bytes each, in the transport words of one
    control block (:class:`~weightsync.mechanisms.control.ControlBlock`: its magic, its
    region's handle and end; no abort pairs)."""

    def __init__(self, block: ControlBlock, slots: int, slot_bytes: int) -> None:
        self._block = block
        self.path = block.path
        self.slots = slots
        self.slot_bytes = slot_bytes
        per_slot = _HEADER_WORDS + slot_bytes // 8
        self._slots = block.words[block.first : block.first + slots * per_slot].reshape(slots, per_slot)

    @staticmethod
    def words(slots: int, slot_bytes: int) -> int:
        return slots * (_HEADER_WORDS + slot_bytes // 8)

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> ReplyBoard:
        """A zeroed board owned by this process (the coordinator's)."""
        if slots < 1 or slot_bytes < 8 or slot_bytes % 8:
            raise ValueError(
                f"a reply board needs slots >= 1 and slot_bytes a multiple of 8, got {slots}, {slot_bytes}"
            )
        return cls(ControlBlock.create(cls.words(slots, slot_bytes), tag="reply"), slots, slot_bytes)

    @classmethod
    def attach(cls, handle: ShmHandle, slots: int, slot_bytes: int) -> ReplyBoard:
        """The board behind ``handle`` mapped in this process (a party's); raises
        :class:`~weightsync.core.wire.errors.ExportNotFound` where it cannot be mapped (another
        host, or another ``/dev/shm``)."""
        if slots < 1 or slot_bytes % 8 or handle.nbytes < cls.words(slots, slot_bytes) * 8:
            raise WeightSyncError(
                f"reply board {handle.path}: {handle.nbytes} bytes cannot hold {slots} slot(s) of {slot_bytes} "
                "bytes: a malformed offer"
            )
        block = ControlBlock.attach(map_shm(handle), "a party", handle.path)
        if block.first + cls.words(slots, slot_bytes) > len(block.words):
            raise WeightSyncError(f"reply board {handle.path} is too small for {slots} slot(s): a malformed offer")
        return cls(block, slots, slot_bytes)

    def handle(self) -> ShmHandle:
        return self._block.handle()

    def post(self, slot: int, tag: int, data: bytes | None) -> bool:
        """Write ``data`` as round ``tag``'s answer in ``slot``; None, or bytes too big for the
        slot, say "read Ray's answer" instead. Returns whether the bytes were written."""
        row = self._slots[slot]
        row[TAG] = 0
        fits = data is not None and len(data) <= self.slot_bytes
        if fits:
            assert data is not None
            row[_HEADER_WORDS:].view(np.uint8)[: len(data)] = np.frombuffer(data, dtype=np.uint8)
            row[DIGEST] = _digest(data)
            row[LENGTH] = len(data)
        else:
            row[LENGTH] = -1
        row[TAG] = tag
        return fits

    def take(self, slot: int, tag: int) -> bytes | object | None:
        """Round ``tag``'s answer in ``slot``: its bytes, :data:`TOO_BIG`, or None while
        there is none (or one being written)."""
        row = self._slots[slot]
        if row[TAG] != tag:
            return None
        length = int(row[LENGTH])
        if length < 0:
            return TOO_BIG if row[TAG] == tag else None
        if length > self.slot_bytes:
            return None
        digest = int(row[DIGEST])
        data = row[_HEADER_WORDS:].view(np.uint8)[:length].tobytes()
        if row[TAG] != tag or _digest(data) != digest:
            return None  # a late writer of another round is mid-write: look again
        return data

    def unlink(self) -> None:
        """Remove the name once every party mapped it (the mappings stay)."""
        self._block.unlink()

    def close(self) -> None:
        self._block.close()

    def __enter__(self) -> ReplyBoard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
