"""The broadcast transport's worker half (the whole story: :mod:`weightsync.transports.broadcast.halves`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from weightsync.core.delta.landing import DeltaReceiving
from weightsync.core.halves import Landing, ReceiveHalf
from weightsync.core.packing import ChunkUnpacker, as_bytes, byte_checksum, contiguous_checksum
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.plan import Chunk
from weightsync.transports.broadcast.group import PackedGroup, Work


class BroadcastReceiver(PackedGroup, ReceiveHalf):
    """Ranks 1..N: agree, then receive every chunk of the broadcast plan into the sink."""

    kind = "broadcast"
    carries_deltas = True
    knows_sender_finished = False

    def _direct_target(
        self, chunk: Chunk, manifest: Manifest, destinations: list[torch.Tensor | None]
    ) -> torch.Tensor | None:
        """Where an in-place chunk may land as it arrives: the destination's own bytes when it
        is a contiguous tensor of the spec's dtype and shape on the group's device; else None
        (the scratch buffer, unpacked from there)."""
        if not chunk.inplace:
            return None
        index = chunk.pieces[0].spec_index
        spec = manifest.specs[index]
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
        buffers: Sequence[torch.Tensor],
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
            buffer = self.scratch(scratch_bytes) if held < 0 else buffers[held]
            handed = unpacker.unpack(chunk, buffer)
            if handed:
                sink.consume(handed)
            return byte_checksum(buffer, chunk.nbytes) if verify else None

    def receive(self, sink: Landing, call: SyncCall, begin: Callable[[], None]) -> tuple[list[int], tuple[str, ...]]:
        deadline = self.deadlines.follower(time.monotonic())
        manifest: Manifest | None = self.manifest
        landing: Landing = sink
        self.agree(deadline)
        if isinstance(sink, DeltaReceiving):  # a delta session: the header says what follows
            raw = torch.empty(sink.header_nbytes, dtype=torch.uint8, device=self.comm.device)
            self.header(raw, deadline)
            manifest, landing = sink.open(raw)
        begin()
        checksums = self._receive_plan(manifest, landing, call.verify, deadline) if manifest is not None else []
        if isinstance(sink, DeltaReceiving):
            sink.finish()  # a loader that takes every tensor of a delta sync gets the rest
        self.done()
        return checksums, ()

    def _receive_plan(self, manifest: Manifest, sink: Landing, verify: bool, deadline: float) -> list[int]:
        destinations = sink.destinations(manifest)
        unpacker = ChunkUnpacker(manifest.specs, destinations.__getitem__, sink.keeps_references)
        plan = manifest.broadcast_chunks
        buffers = self.buffers(None if manifest is self.manifest else plan)
        direct = [self._direct_target(c, manifest, destinations) for c in plan]
        scratch_bytes = max((c.nbytes for c, d in zip(plan, direct) if c.inplace and d is None), default=0)
        resource = self._resources(plan, direct)
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
                    target = buffers[held][: chunk.nbytes]
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
            checksum = self._land(chunk, held, direct[index], buffers, scratch_bytes, unpacker, sink, verify)
            if checksum is not None:
                checksums.append(checksum)
            if held is not None:
                busy.discard(held)
        self.streams.drain(deadline, f"{self.me}: unpacking the last chunk did not complete in time")
        unpacker.finish()
        return checksums
