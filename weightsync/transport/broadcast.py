"""Packed, multi-buffer broadcast over any :class:`Communicator` (gloo on CPU, NCCL on GPU).

The producer (rank 0) packs chunk k into buffer ``k % num_buffers`` and starts its
broadcast asynchronously, so with two or more buffers packing chunk k+1 overlaps sending
chunk k. The consumer keeps ``num_buffers`` receives posted ahead and unpacks chunk k while
chunk k+1 arrives. Buffers are allocated once per engine and reused for every sync; each
in-flight chunk's buffer stays referenced by the engine until its broadcast completed, and
both sides drain every slot before returning.

Call order, per sync, on every rank at once::

    sender.send(sources)                      # rank 0
    receiver.receive(unpacker, deliver)       # ranks 1..N
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from weightsync.packing import ChunkUnpacker, byte_checksum, pack_chunk
from weightsync.spec import Manifest
from weightsync.transport.streams import SlotStreams

Deliver = Callable[[list[tuple[str, torch.Tensor]]], None]


class Work(Protocol):
    """An asynchronous collective in flight."""

    def wait(self, deadline: float) -> None:
        """Block the host until the operation completed, or raise at ``deadline``."""


class Communicator(Protocol):
    """The collective a packed broadcast needs; rank 0 is the trainer."""

    rank: int
    world_size: int
    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int, stream_pointer: int) -> Work:
        """Start broadcasting ``tensor`` from ``src`` (on ``stream_pointer`` for CUDA)."""

    def abort(self) -> None:
        """Fail every pending operation so no rank waits forever; the group is unusable after."""

    def close(self) -> None:
        """Release the group after a clean finish."""


class _PackedBroadcast:
    def __init__(self, comm: Communicator, manifest: Manifest, timeout_s: float) -> None:
        self.comm = comm
        self.manifest = manifest
        self.timeout_s = timeout_s
        self.streams = SlotStreams(comm.device, manifest.num_buffers)
        self._buffers: list[torch.Tensor] = []

    def buffers(self) -> list[torch.Tensor]:
        if not self._buffers:
            self._buffers = [
                torch.empty(self.manifest.buffer_bytes, dtype=torch.uint8, device=self.comm.device)
                for _ in range(self.manifest.num_buffers)
            ]
        return self._buffers

    def _timeout_message(self, what: str) -> str:
        return (
            f"rank {self.comm.rank}: {what} did not complete within {self.timeout_s:.1f}s; a "
            "peer in the group is dead, stuck or too slow (raise timeout_s for slow links)"
        )


class BroadcastSender(_PackedBroadcast):
    """Rank 0's side: pack and broadcast every chunk of the Manifest."""

    def send(self, sources: Sequence[torch.Tensor], verify: bool = False) -> list[int]:
        """Broadcast ``sources`` (aligned with ``manifest.specs``); returns per-chunk checksums
        when ``verify`` is set, else an empty list. Aborts the communicator on any failure."""
        deadline = time.monotonic() + self.timeout_s
        buffers = self.buffers()
        nbuf = self.manifest.num_buffers
        in_flight: list[Work | None] = [None] * nbuf
        caller = self.streams.caller_stream()
        checksums: list[int] = []
        try:
            for chunk in self.manifest.chunks:
                slot = chunk.index % nbuf
                pending = in_flight[slot]
                if pending is not None:
                    pending.wait(deadline)
                    in_flight[slot] = None
                with self.streams.use(slot):
                    self.streams.wait_for(slot, caller)
                    pack_chunk(chunk, self.manifest.specs, sources, buffers[slot])
                    if verify:
                        checksums.append(byte_checksum(buffers[slot], chunk.nbytes))
                    in_flight[slot] = self.comm.broadcast(
                        buffers[slot][: chunk.nbytes], 0, self.streams.stream_pointer(slot)
                    )
            for work in in_flight:
                if work is not None:
                    work.wait(deadline)
            self.streams.drain(deadline, self._timeout_message("the final broadcast"))
        except BaseException:
            self.comm.abort()
            raise
        return checksums


class BroadcastReceiver(_PackedBroadcast):
    """Ranks 1..N: receive every chunk and unpack it into the sink."""

    def receive(self, unpacker: ChunkUnpacker, deliver: Deliver, verify: bool = False) -> list[int]:
        deadline = time.monotonic() + self.timeout_s
        buffers = self.buffers()
        chunks = self.manifest.chunks
        nbuf = self.manifest.num_buffers
        posted: dict[int, Work] = {}
        checksums: list[int] = []

        def post(index: int) -> None:
            if index < len(chunks):
                slot = index % nbuf
                with self.streams.use(slot):
                    posted[index] = self.comm.broadcast(
                        buffers[slot][: chunks[index].nbytes], 0, self.streams.stream_pointer(slot)
                    )

        try:
            for index in range(min(nbuf, len(chunks))):
                post(index)
            for chunk in chunks:
                slot = chunk.index % nbuf
                posted.pop(chunk.index).wait(deadline)
                with self.streams.use(slot):
                    handed = unpacker.unpack(chunk, buffers[slot])
                    if handed:
                        deliver(handed)
                    if verify:
                        checksums.append(byte_checksum(buffers[slot], chunk.nbytes))
                post(chunk.index + nbuf)
            self.streams.drain(deadline, self._timeout_message("unpacking the last chunk"))
            unpacker.finish()
        except BaseException:
            self.comm.abort()
            raise
        return checksums
