"""Packed, multi-buffer broadcast over any :class:`Communicator` (gloo on CPU, NCCL on GPU),
with large tensors sent in place.

Both sides walk the Manifest's broadcast plan (``Manifest.broadcast_chunks``). A packed
chunk: the producer (rank 0, the trainer) packs it into buffer ``p % num_buffers`` (p counts
packed chunks) and starts its broadcast asynchronously, so with two or more buffers packing
chunk p+1 overlaps sending chunk p; each receiver unpacks it out of its own buffer. An
in-place chunk (one tensor of at least ``inplace_bytes``): the trainer broadcasts the
tensor's own storage when it is contiguous and of the wire dtype (else a contiguous
wire-dtype temporary, alive until its broadcast completed: at most ``num_buffers`` of them
at once), and a receiver whose sink gives a contiguous tensor of that dtype and shape
receives straight into it; any other receiver (a strided or differently typed destination,
a ``load_weights`` sink) receives into one reused scratch buffer, the size of the largest
such tensor, and unpacks from there exactly as it unpacks a packed chunk. In-place
operations hold no buffer, so both sides keep up to :data:`INPLACE_DEPTH` of them in flight
(``num_buffers`` when that is larger): on a CPU every gloo operation waits for a
receiver's ready message and a peer's wake-up, which several operations in flight hide
(see docs/benchmarks.md, "CPU broadcast knobs"). Receivers keep that many
operations posted ahead, whatever their kind; a packed chunk still waits for its buffer.
In-place operations run on their own stream (on a GPU). Buffers are allocated once per session and reused; an
in-flight chunk's buffer stays referenced until its broadcast completed, and both sides
drain every stream before returning. With ``verify``, every chunk of the plan, in-place
ones included, has a checksum on both sides.

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
from collections import deque
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from weightsync.core.halves import Landing, ReceiveHalf, SendHalf, Sources
from weightsync.core.packing import ChunkUnpacker, as_bytes, byte_checksum, contiguous_checksum, pack_chunk
from weightsync.core.wire.errors import PeerAborted, WeightSyncError
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.plan import Chunk
from weightsync.core.wire.session import Session
from weightsync.mechanisms.streams import SlotStreams

log = logging.getLogger("weightsync")

#: The fewest in-place operations each side keeps in flight (``num_buffers`` when larger).
#: Measured on the 2-core CPU machine, variants interleaved in one run (docs/benchmarks.md,
#: "CPU broadcast knobs"): under load, the 1 GB policy (all but 70 KB of it in place) to 2
#: receivers synced 1.03-1.27x faster with 4 in flight than with 2 (three runs), and 8 was
#: no better; on a quiet machine 2, 4 and 8 are within 4% of each other at 100 MB and 1 GB.
INPLACE_DEPTH = 4


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


class PackedGroup:
    """One broadcast group as a sync sees it: its members, streams, the agreement of the
    current sync and the operations in flight (the owners transport keeps one per rank)."""

    def __init__(self, comm: Communicator, session: Session, members: Sequence[str]) -> None:
        if len(members) != comm.world_size:
            raise WeightSyncError(f"broadcast group of {comm.world_size} ranks given {len(members)} member names")
        self.comm = comm
        self.session = session
        self.manifest = session.manifest
        self.deadlines = session.deadlines
        self.members = tuple(members)
        # num_buffers, never more than the plan has chunks.
        nbuf = self.nbuf = self.manifest.depth(self.manifest.broadcast_chunks)
        #: Operations in flight (sender: in-place ones; receiver: posted ahead, any kind).
        self.depth = max(nbuf, INPLACE_DEPTH)
        # One stream per buffer slot, and the last one for the in-place operations.
        self.streams = SlotStreams(comm.device, nbuf + 1)
        self.lane = nbuf
        self._buffers: list[torch.Tensor] = []
        self._scratch: torch.Tensor | None = None
        self.in_flight: list[Work] = []
        # This sync's agreement: "" (not yet), "asked", "refused" (nothing moved), "moving".
        self._agreement = ""
        self._broken = False

    @property
    def me(self) -> str:
        return self.members[self.comm.rank]

    def buffers(self) -> list[torch.Tensor]:
        """The packing buffers, allocated on first use: each as large as the plan's largest
        packed chunk (at most ``buffer_bytes``; with most bytes in place, much less)."""
        if not self._buffers:
            packed = [c.nbytes for c in self.manifest.broadcast_chunks if not c.inplace]
            # Packed chunk p uses buffer p % nbuf: never more buffers than packed chunks.
            self._buffers = [
                torch.empty(max(packed, default=0), dtype=torch.uint8, device=self.comm.device)
                for _ in range(max(1, min(self.nbuf, len(packed))))
            ]
        return self._buffers

    def scratch(self, nbytes: int) -> torch.Tensor:
        """The receiver's reused landing for in-place tensors it cannot take directly."""
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = None
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.comm.device)
        return self._scratch

    def agree(self, deadline: float) -> None:
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

    def done(self) -> None:
        """This sync finished on this rank: nothing in flight, the next sync agrees anew."""
        self.in_flight.clear()
        self._agreement = ""

    def abort(self, deadline: float | None = None) -> None:
        """Before this sync's agreement: refuse in it (every rank stops, the group survives),
        by ``deadline`` (default: the timeout from now). After a refused agreement: nothing
        moved, nothing to do. After bytes started to move: abort the group, which fails every
        peer's pending operation at once."""
        if self._agreement == "refused":
            return
        if self._agreement == "" and not self._broken:
            self._agreement = "refused"
            try:
                self.comm.agree(True, deadline if deadline is not None else self.deadlines.leader(time.monotonic()))
                return
            except Exception as exc:  # noqa: BLE001 - already failing; the group is aborted below
                log.warning("weightsync: %s could not refuse in the agreement (%s); aborting the group", self.me, exc)
        self._broken = True
        self.in_flight.clear()
        self.comm.abort()

    def close(self, abort: bool = False) -> None:
        self.in_flight.clear()
        self._buffers, self._scratch = [], None
        if abort or self._broken:
            self._broken = True
            self.comm.abort()
        else:
            self.comm.close()


class BroadcastSender(PackedGroup, SendHalf):
    """Rank 0's side: agree, then broadcast every chunk of the broadcast plan."""

    kind = "broadcast"

    @property
    def peers(self) -> tuple[str, ...]:
        return self.members[1:]

    def send(self, sources: Sources, call: SyncCall, deadline: float) -> tuple[list[int], tuple[str, ...]]:
        self.agree(deadline)
        nbuf = self.nbuf
        in_flight: list[Work | None] = [None] * nbuf
        # In-place broadcasts in flight, with the tensor each reads and whether that is a
        # temporary (at most nbuf temporaries are alive at once).
        inplace: deque[tuple[Work, torch.Tensor, bool]] = deque()
        caller = self.streams.caller_stream()
        checksums: list[int] = []
        packed = 0
        for chunk in self.manifest.broadcast_chunks:
            if chunk.inplace:
                temporary = self._needs_temporary(chunk, sources)
                while len(inplace) >= self.depth or (temporary and sum(t for *_, t in inplace) >= nbuf):
                    inplace.popleft()[0].wait(deadline)
                with self.streams.use(self.lane), torch.no_grad():
                    self.streams.wait_for(self.lane, caller)
                    wire = self._wire_tensor(chunk, sources)
                    if call.verify:
                        checksums.append(contiguous_checksum(wire))
                    work = self.comm.broadcast(as_bytes(wire), 0, self.streams.stream_pointer(self.lane))
                inplace.append((work, wire, temporary))
                self.in_flight.append(work)
                continue
            slot = packed % nbuf
            packed += 1
            pending = in_flight[slot]
            if pending is not None:
                pending.wait(deadline)
                in_flight[slot] = None
            buffer = self.buffers()[slot]
            with self.streams.use(slot), torch.no_grad():
                self.streams.wait_for(slot, caller)
                pack_chunk(chunk, self.manifest.specs, sources.tensors, buffer)
                if call.verify:
                    checksums.append(byte_checksum(buffer, chunk.nbytes))
                work = self.comm.broadcast(buffer[: chunk.nbytes], 0, self.streams.stream_pointer(slot))
                in_flight[slot] = work
                self.in_flight.append(work)
        for last in in_flight:
            if last is not None:
                last.wait(deadline)
        for work, _, _ in inplace:
            work.wait(deadline)
        self.streams.drain(deadline, self._timeout_message("the final broadcast"))
        inplace.clear()
        self.done()
        return checksums, ()

    def _needs_temporary(self, chunk: Chunk, sources: Sources) -> bool:
        """Whether :meth:`_wire_tensor` makes a copy for this in-place chunk."""
        index = chunk.pieces[0].spec_index
        source = sources.tensors[index]
        return (
            not source.is_contiguous()
            or source.dtype != self.manifest.specs[index].torch_dtype
            or source.device != self.comm.device
        )

    def _wire_tensor(self, chunk: Chunk, sources: Sources) -> torch.Tensor:
        """The tensor an in-place chunk broadcasts: the source itself when it is contiguous,
        of the wire dtype and on the group's device; else a contiguous wire-dtype copy."""
        index = chunk.pieces[0].spec_index
        spec = self.manifest.specs[index]
        return sources.tensors[index].detach().to(device=self.comm.device, dtype=spec.torch_dtype).contiguous()

    def _timeout_message(self, what: str) -> str:
        return f"{self.me}: {what} did not complete in time; a peer in the group is dead, stuck or too slow"


class BroadcastReceiver(PackedGroup, ReceiveHalf):
    """Ranks 1..N: agree, then receive every chunk of the broadcast plan into the sink."""

    kind = "broadcast"
    knows_sender_finished = False

    def _direct_target(self, chunk: Chunk, destinations: list[torch.Tensor | None]) -> torch.Tensor | None:
        """Where an in-place chunk may land as it arrives: the destination's own bytes when it
        is a contiguous tensor of the spec's dtype and shape on the group's device; else None
        (it lands in the scratch buffer and is unpacked from there, never written raw)."""
        if not chunk.inplace:
            return None
        index = chunk.pieces[0].spec_index
        spec = self.manifest.specs[index]
        dest = destinations[index]
        if (
            dest is None
            or not dest.is_contiguous()
            or dest.dtype != spec.torch_dtype
            or tuple(dest.shape) != spec.shape
            or dest.device != self.comm.device
        ):
            return None
        return as_bytes(dest.detach())

    def _resources(self, plan: Sequence[Chunk], direct: Sequence[torch.Tensor | None]) -> list[int | None]:
        """What each chunk lands in besides its destination: a buffer slot (its index), the
        scratch (-1), or nothing (None: an in-place chunk received straight into it)."""
        resource: list[int | None] = []
        packed = 0
        for chunk, target in zip(plan, direct):
            if not chunk.inplace:
                resource.append(packed % self.nbuf)
                packed += 1
            else:
                resource.append(None if target is not None else -1)
        return resource

    def _land(
        self,
        chunk: Chunk,
        held: int | None,
        landed: torch.Tensor | None,
        scratch_bytes: int,
        unpacker: ChunkUnpacker,
        sink: Landing,
        verify: bool,
    ) -> int | None:
        """Hand a received chunk to the sink: unpack it from the slot or scratch it was
        received into (``held``), or nothing to do for one already ``landed`` in its
        destination; its checksum with ``verify``."""
        lane = self.lane if chunk.inplace else held
        assert lane is not None
        with self.streams.use(lane):
            if held is None:
                assert landed is not None
                return contiguous_checksum(landed) if verify else None
            buffer = self.scratch(scratch_bytes) if held < 0 else self.buffers()[held]
            handed = unpacker.unpack(chunk, buffer)
            if handed:
                sink.consume(handed)
            return byte_checksum(buffer, chunk.nbytes) if verify else None

    def receive(self, sink: Landing, call: SyncCall, begin: Callable[[], None]) -> tuple[list[int], tuple[str, ...]]:
        deadline = self.deadlines.follower(time.monotonic())
        manifest = self.manifest
        destinations = sink.destinations(manifest)
        unpacker = ChunkUnpacker(manifest.specs, destinations.__getitem__, sink.keeps_references)
        plan = manifest.broadcast_chunks
        direct = [self._direct_target(c, destinations) for c in plan]
        scratch_bytes = max((c.nbytes for c, d in zip(plan, direct) if c.inplace and d is None), default=0)
        resource = self._resources(plan, direct)
        self.agree(deadline)
        begin()
        posted: dict[int, Work] = {}
        busy: set[int] = set()
        ahead = 0

        def post_ahead(done: int) -> None:
            nonlocal ahead
            while ahead < len(plan) and ahead - done < self.depth:
                chunk, held = plan[ahead], resource[ahead]
                if held is not None and held in busy:
                    return
                if held is None:
                    target = direct[ahead]
                    assert target is not None
                elif held < 0:
                    target = self.scratch(scratch_bytes)[: chunk.nbytes]
                else:
                    target = self.buffers()[held][: chunk.nbytes]
                lane = self.lane if chunk.inplace else held
                assert lane is not None
                with self.streams.use(lane):
                    work = self.comm.broadcast(target, 0, self.streams.stream_pointer(lane))
                posted[ahead] = work
                self.in_flight.append(work)
                if held is not None:
                    busy.add(held)
                ahead += 1

        checksums: list[int] = []
        for index, chunk in enumerate(plan):
            post_ahead(index)
            posted.pop(index).wait(deadline)
            held = resource[index]
            checksum = self._land(chunk, held, direct[index], scratch_bytes, unpacker, sink, call.verify)
            if checksum is not None:
                checksums.append(checksum)
            if held is not None:
                busy.discard(held)
        self.streams.drain(deadline, f"{self.me}: unpacking the last chunk did not complete in time")
        unpacker.finish()
        self.done()
        return checksums, ()
