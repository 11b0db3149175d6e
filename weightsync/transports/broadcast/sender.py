"""The broadcast transport's trainer half (the whole story: :mod:`weightsync.transports.broadcast.halves`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from weightsync.core.delta.encoder import half_plan
from weightsync.core.halves import SendHalf, Sources
from weightsync.core.packing import as_bytes, byte_checksum, contiguous_checksum, pack_chunk
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.plan import Chunk
from weightsync.transports.broadcast.group import PackedGroup, Work


class BroadcastSender(PackedGroup, SendHalf):
    """Rank 0's side: agree, then broadcast every chunk of the broadcast plan (in a delta
    session: the header first, then the plan it announces)."""

    kind = "broadcast"
    carries_deltas = True

    @property
    def peers(self) -> tuple[str, ...]:
        return self.members[1:]

    def send(self, sources: Sources, call: SyncCall, deadline: float) -> tuple[list[int], tuple[str, ...]]:
        self.agree(deadline)
        manifest: Manifest | None = self.manifest
        tensors = sources.tensors
        if self.manifest.agreed.delta:  # a delta session: the header first, then its plan
            header, manifest, tensors = half_plan(sources, self.manifest, call.to(self.kind))
            raw = header.to_tensor(self.manifest, self.comm.device)
            self.header(raw, deadline)
            self.sent_nbytes = raw.numel() + (manifest.total_bytes if manifest is not None else 0)
        checksums = self._send_plan(manifest, tensors, call.verify, deadline) if manifest is not None else []
        self.done()
        return checksums, ()

    def _send_plan(
        self, manifest: Manifest, tensors: Sequence[torch.Tensor], verify: bool, deadline: float
    ) -> list[int]:
        nbuf = self.nbuf
        in_flight: list[Work | None] = [None] * nbuf
        # In-place broadcasts in flight, with the tensor each reads and whether that is a
        # temporary (at most nbuf temporaries are alive at once).
        inplace: deque[tuple[Work, torch.Tensor, bool]] = deque()
        caller = self.streams.caller_stream()
        checksums: list[int] = []
        packed = 0
        buffers = self.buffers(None if manifest is self.manifest else manifest.broadcast_chunks)
        for chunk in manifest.broadcast_chunks:
            if chunk.inplace:
                temporary = self._needs_temporary(chunk, manifest, tensors)
                while len(inplace) >= self.depth or (temporary and sum(t for *_, t in inplace) >= nbuf):
                    inplace.popleft()[0].wait(deadline)
                with self.streams.use(self.lane), torch.no_grad():
                    self.streams.wait_for(self.lane, caller)
                    wire = self._wire_tensor(chunk, manifest, tensors)
                    if verify:
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
            buffer = buffers[slot]
            with self.streams.use(slot), torch.no_grad():
                self.streams.wait_for(slot, caller)
                pack_chunk(chunk, manifest.specs, tensors, buffer)
                if verify:
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
        return checksums

    def _needs_temporary(self, chunk: Chunk, manifest: Manifest, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether :meth:`_wire_tensor` makes a copy for this in-place chunk."""
        index = chunk.pieces[0].spec_index
        source = tensors[index]
        return (
            not source.is_contiguous()
            or source.dtype != manifest.specs[index].torch_dtype
            or source.device != self.comm.device
        )

    def _wire_tensor(self, chunk: Chunk, manifest: Manifest, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tensor an in-place chunk broadcasts: the source itself when it is contiguous,
        of the wire dtype and on the group's device; else a contiguous wire-dtype copy."""
        index = chunk.pieces[0].spec_index
        spec = manifest.specs[index]
        return tensors[index].detach().to(device=self.comm.device, dtype=spec.torch_dtype).contiguous()

    def _timeout_message(self, what: str) -> str:
        return f"{self.me}: {what} did not complete in time; a peer in the group is dead, stuck or too slow"
