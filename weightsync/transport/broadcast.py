"""Packed, multi-buffer broadcast over any :class:`Communicator` (gloo on CPU, NCCL on GPU).

The producer (rank 0, the trainer) packs chunk k into buffer ``k % num_buffers`` and starts
its broadcast asynchronously, so with two or more buffers packing chunk k+1 overlaps sending
chunk k. Each receiver keeps ``num_buffers`` receives posted ahead and unpacks chunk k while
chunk k+1 arrives. Buffers are allocated once per session and reused; an in-flight chunk's
buffer stays referenced until its broadcast completed, and both sides drain every slot
before returning.

Every sync starts with an agreement, one tiny all-reduce in which each rank says whether it
can go ahead: a rank that failed before any byte moved (a worker refusing the version, a
trainer whose model changed) says no there, and every rank stops at once, naming it, with
the group intact and nobody's weights touched. A failure after that aborts the group, which
fails every peer's pending operation instead of leaving it to its deadline. Per sync, on
every rank at once::

    BroadcastSender.send(sources, call)              # rank 0
    BroadcastReceiver.receive(sink, call, begin)     # ranks 1..N
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from weightsync.packing import byte_checksum, pack_chunk
from weightsync.transport.base import Landing, ReceiveHalf, SendHalf, Sources, unpacker_for
from weightsync.transport.control import Deadlines
from weightsync.transport.streams import SlotStreams
from weightsync.wire.errors import PeerAborted, WeightSyncError
from weightsync.wire.manifest import Manifest
from weightsync.wire.messages import SyncCall

log = logging.getLogger("weightsync")


class Work(Protocol):
    """An asynchronous collective in flight."""

    def wait(self, deadline: float) -> None:
        """Block the host until the operation completed, or raise at ``deadline``."""


class Communicator(Protocol):
    """The collectives a packed broadcast needs; rank 0 is the trainer."""

    rank: int
    world_size: int
    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int, stream_pointer: int) -> Work:
        """Start broadcasting ``tensor`` from ``src`` (on ``stream_pointer`` for CUDA)."""

    def agree(self, refuse: bool, deadline: float) -> list[int]:
        """All ranks at once: the ranks that refuse to go ahead (empty: everyone agrees)."""

    def abort(self) -> None:
        """Fail every pending operation on every rank; the group is unusable after."""

    def close(self) -> None:
        """Release the group after a clean finish."""


class _PackedBroadcast:
    def __init__(self, comm: Communicator, manifest: Manifest, timeout_s: float, members: Sequence[str]) -> None:
        if len(members) != comm.world_size:
            raise WeightSyncError(f"broadcast group of {comm.world_size} ranks given {len(members)} member names")
        self.comm = comm
        self.manifest = manifest
        self.deadlines = Deadlines(timeout_s)
        self.members = tuple(members)
        self.streams = SlotStreams(comm.device, manifest.num_buffers)
        self._buffers: list[torch.Tensor] = []
        self._in_flight: list[Work] = []
        # This sync's agreement: "" (not yet), "asked", "refused" (nothing moved), "moving".
        self._agreement = ""
        self._broken = False

    @property
    def me(self) -> str:
        return self.members[self.comm.rank]

    def buffers(self) -> list[torch.Tensor]:
        if not self._buffers:
            self._buffers = [
                torch.empty(self.manifest.buffer_bytes, dtype=torch.uint8, device=self.comm.device)
                for _ in range(self.manifest.num_buffers)
            ]
        return self._buffers

    def _agree(self, deadline: float) -> None:
        self._agreement = "asked"
        try:
            refused = self.comm.agree(False, deadline)
        except BaseException:
            self._broken = True
            raise
        if refused:
            self._agreement = "refused"
            names = [self.members[r] for r in refused]
            raise PeerAborted(f"{self.me}: {', '.join(names)} refused the sync before any byte moved", blames=names)
        self._agreement = "moving"

    def abort(self) -> None:
        """Before this sync's agreement: refuse in it (every rank stops, the group survives).
        After a refused agreement: nothing moved, nothing to do. After bytes started to move:
        abort the group, which fails every peer's pending operation at once."""
        if self._agreement == "refused":
            return
        if self._agreement == "" and not self._broken:
            self._agreement = "refused"
            try:
                self.comm.agree(True, self.deadlines.leader(time.monotonic()))
                return
            except Exception as exc:  # noqa: BLE001 - already failing; the group is aborted below
                log.warning("weightsync: %s could not refuse in the agreement (%s); aborting the group", self.me, exc)
        self._broken = True
        self._in_flight.clear()
        self.comm.abort()

    def close(self, abort: bool = False) -> None:
        self._in_flight.clear()
        if abort or self._broken:
            self._broken = True
            self.comm.abort()
        else:
            self.comm.close()


class BroadcastSender(_PackedBroadcast, SendHalf):
    """Rank 0's side: agree, then pack and broadcast every chunk of the Manifest."""

    kind = "broadcast"

    def send(self, sources: Sources, call: SyncCall, deadline: float) -> tuple[list[int], tuple[str, ...]]:
        self._agree(deadline)
        buffers = self.buffers()
        nbuf = self.manifest.num_buffers
        in_flight: list[Work | None] = [None] * nbuf
        caller = self.streams.caller_stream()
        checksums: list[int] = []
        for chunk in self.manifest.chunks:
            slot = chunk.index % nbuf
            pending = in_flight[slot]
            if pending is not None:
                pending.wait(deadline)
                in_flight[slot] = None
            with self.streams.use(slot), torch.no_grad():
                self.streams.wait_for(slot, caller)
                pack_chunk(chunk, self.manifest.specs, sources.tensors, buffers[slot])
                if call.verify:
                    checksums.append(byte_checksum(buffers[slot], chunk.nbytes))
                work = self.comm.broadcast(buffers[slot][: chunk.nbytes], 0, self.streams.stream_pointer(slot))
                in_flight[slot] = work
                self._in_flight.append(work)
        for last in in_flight:
            if last is not None:
                last.wait(deadline)
        self.streams.drain(deadline, self._timeout_message("the final broadcast"))
        self._in_flight.clear()
        self._agreement = ""
        return checksums, ()

    def _timeout_message(self, what: str) -> str:
        return f"{self.me}: {what} did not complete in time; a peer in the group is dead, stuck or too slow"


class BroadcastReceiver(_PackedBroadcast, ReceiveHalf):
    """Ranks 1..N: agree, then receive every chunk and unpack it into the sink."""

    kind = "broadcast"
    knows_sender_finished = False

    def receive(self, sink: Landing, call: SyncCall, begin: Callable[[], None]) -> tuple[list[int], tuple[str, ...]]:
        deadline = self.deadlines.follower(time.monotonic())
        unpacker = unpacker_for(self.manifest, sink)
        self._agree(deadline)
        begin()
        buffers = self.buffers()
        chunks = self.manifest.chunks
        nbuf = self.manifest.num_buffers
        posted: dict[int, Work] = {}
        checksums: list[int] = []

        def post(index: int) -> None:
            if index < len(chunks):
                slot = index % nbuf
                with self.streams.use(slot):
                    work = self.comm.broadcast(
                        buffers[slot][: chunks[index].nbytes], 0, self.streams.stream_pointer(slot)
                    )
                posted[index] = work
                self._in_flight.append(work)

        for index in range(min(nbuf, len(chunks))):
            post(index)
        for chunk in chunks:
            slot = chunk.index % nbuf
            posted.pop(chunk.index).wait(deadline)
            with self.streams.use(slot):
                handed = unpacker.unpack(chunk, buffers[slot])
                if handed:
                    sink.consume(handed)
                if call.verify:
                    checksums.append(byte_checksum(buffers[slot], chunk.nbytes))
            post(chunk.index + nbuf)
        self.streams.drain(deadline, f"{self.me}: unpacking the last chunk did not complete in time")
        unpacker.finish()
        self._in_flight.clear()
        self._agreement = ""
        return checksums, ()
