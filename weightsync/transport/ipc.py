"""Packed transfer through slots the producer exports once and consumers map once.

For a trainer and workers that share a device (one GPU, or one host on CPU), where a
collective is impossible (NCCL refuses two ranks on one GPU) or wasteful. The producer
allocates ``num_buffers`` slots in one exported region, packs chunk k into a slot, and the
consumer copies out of its mapping of the same memory.

Two ways to drive it:

* per chunk, as in vLLM: ``handle = sender.pack(k, slot, sources)`` on the producer, then
  ``receiver.consume(handle, ...)`` on each consumer; the caller must not pack into that
  slot again before every consumer's ``consume`` has returned.
* per sync (what the coordinator uses): ``sender.send(...)`` and ``receiver.receive(...)``
  started together, one call per side. The slot hand-off then runs through a small shared
  control block of counters instead of a round trip per chunk: the producer publishes
  chunk g after its bytes are visible, each consumer acknowledges g after its copy out
  finished, and the producer writes slot ``g % num_buffers`` only once every consumer has
  acknowledged chunk ``g - num_buffers``. So with two slots the producer packs chunk k+1
  while consumers read chunk k, and a slot is never rewritten while anyone reads it.

On a GPU no side waits on the host for a copy to finish, chunk by chunk: the producer
records an interprocess CUDA event after packing a slot and publishes at once; a consumer's
stream waits on that event, unpacks, records its own event for the slot and acknowledges at
once; the producer's stream waits on every consumer's event before it packs that slot
again. The host only moves the counters while the GPU runs pack and unpack back to back,
and each side synchronizes once, at the end of a sync. An event is always waited on before
its next record (a slot is packed again only after every consumer acknowledged, which it
does after queueing its wait), so a wait never sees a later chunk's record.

Every wait has a deadline; a side that fails raises an abort flag in the control block so
the others stop at once and name it, and a side whose process ended is noticed by its pid.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from weightsync.packing import ChunkUnpacker, byte_checksum, pack_chunk
from weightsync.spec import Manifest, WeightSyncError
from weightsync.transport.broadcast import Deliver
from weightsync.transport.control import (
    FIRST_FREE_WORD,
    PeerAborted,
    create_control,
    raise_abort,
    view_control,
    wait_until,
)
from weightsync.transport.cuda_ipc import CudaIpcHandle, CudaRegion, map_cuda_ipc
from weightsync.transport.shm import ShmHandle, ShmRegion, map_shm
from weightsync.transport.streams import SlotStreams, wait_for_stream

__all__ = ["ChecksumMismatch", "ChunkHandle", "IpcExport", "IpcReceiver", "IpcSender", "PeerAborted", "RegionImporter"]

RegionHandle = ShmHandle | CudaIpcHandle

# Control block words after magic and abort (abort codes: 1 = producer, 2 + i = consumer
# i): chunks published, the chunk the producer waits to write (0 when not waiting), the
# producer's pid; then per consumer its acknowledged-count and its pid; then one checksum
# per slot.
_PUBLISHED, _WAITING, _PRODUCER_PID = FIRST_FREE_WORD, FIRST_FREE_WORD + 1, FIRST_FREE_WORD + 2
_FIRST_CONSUMER = FIRST_FREE_WORD + 3


def _ack_word(consumer: int) -> int:
    return _FIRST_CONSUMER + 2 * consumer


def _pid_word(consumer: int) -> int:
    return _FIRST_CONSUMER + 2 * consumer + 1


def _checksum_word(num_consumers: int, slot: int) -> int:
    return _FIRST_CONSUMER + 2 * num_consumers + slot


class Region(Protocol):
    tensor: torch.Tensor

    def handle(self) -> RegionHandle: ...

    def unlink(self) -> None: ...

    def close(self) -> None: ...


def make_region(nbytes: int, device: torch.device, tag: str) -> Region:
    """A region of ``nbytes`` on ``device``: CUDA IPC on a GPU, ``/dev/shm`` on a CPU."""
    if device.type == "cuda":
        return CudaRegion(nbytes, device, session=uuid.uuid4().hex[:16])
    return ShmRegion(nbytes, tag=tag)


def map_region(handle: RegionHandle, who: str) -> torch.Tensor:
    if isinstance(handle, CudaIpcHandle):
        return map_cuda_ipc(handle, who)
    if isinstance(handle, ShmHandle):
        return map_shm(handle)
    raise TypeError(f"{who}: not an export handle: {type(handle).__name__}")


class RegionImporter:
    """Maps each export once and releases it once.

    One importer is kept per consumer for the whole session and reused across chunks and
    syncs; ``maps`` and ``releases`` count what it did, so tests can hold it to one each.
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self._mapped: dict[str, torch.Tensor] = {}
        self.maps = 0
        self.releases = 0

    def map(self, handle: RegionHandle) -> torch.Tensor:
        key = f"{type(handle).__name__}:{handle.session}"
        tensor = self._mapped.get(key)
        if tensor is None:
            tensor = map_region(handle, self.who)
            self._mapped[key] = tensor
            self.maps += 1
        return tensor

    def release_all(self) -> None:
        for key in list(self._mapped):
            del self._mapped[key]
            self.releases += 1

    @property
    def mapped(self) -> int:
        return len(self._mapped)


@dataclass(frozen=True)
class IpcExport:
    """What a consumer needs to attach: the slot region, the control block, the layout."""

    session: str
    slots: RegionHandle
    control: ShmHandle
    num_slots: int
    slot_bytes: int
    consumer_names: tuple[str, ...]
    #: On a GPU: per slot, the interprocess event the producer records after packing it;
    #: per consumer and slot, the event that consumer records after unpacking it.
    packed_events: tuple[bytes, ...] = ()
    freed_events: tuple[tuple[bytes, ...], ...] = ()

    @property
    def num_consumers(self) -> int:
        return len(self.consumer_names)


@dataclass(frozen=True)
class ChunkHandle:
    """Chunk ``chunk_index`` sits in ``slot`` of session ``session``'s region."""

    session: str
    slot: int
    chunk_index: int
    nbytes: int
    checksum: int | None = None


class IpcSender:
    """The producer: exports ``num_buffers`` slots once and packs chunks into them."""

    def __init__(self, manifest: Manifest, device: torch.device, timeout_s: float, name: str = "trainer") -> None:
        self.manifest = manifest
        self.device = device
        self.timeout_s = timeout_s
        self.name = name
        self.streams = SlotStreams(device, manifest.num_buffers)
        self._slots: Region | None = None
        self._control: ShmRegion | None = None
        self._control_np: np.ndarray | None = None
        self._export: IpcExport | None = None
        self._consumer_names: list[str] = []
        self._packed: list[torch.cuda.Event] = []
        self._freed: list[list[torch.cuda.Event]] = []

    def export(self, consumer_names: Sequence[str]) -> IpcExport:
        """Allocate and export the slots and the control block, once per session."""
        if self._export is not None:
            raise WeightSyncError(f"{self.name}: IPC slots already exported for this session")
        nbuf, size = self.manifest.num_buffers, self.manifest.buffer_bytes
        self._slots = make_region(nbuf * size, self.device, tag="slots")
        self._consumer_names = list(consumer_names)
        self._control, control = create_control(_checksum_word(len(consumer_names), nbuf), tag="ctl")
        control[_PRODUCER_PID] = os.getpid()
        self._control_np = control
        packed: tuple[bytes, ...] = ()
        freed: tuple[tuple[bytes, ...], ...] = ()
        if self.streams.is_cuda:
            with torch.cuda.device(self.device):
                self._packed = [torch.cuda.Event(interprocess=True) for _ in range(nbuf)]
                self._freed = [[torch.cuda.Event(interprocess=True) for _ in range(nbuf)] for _ in consumer_names]
                packed = tuple(e.ipc_handle() for e in self._packed)
                freed = tuple(tuple(e.ipc_handle() for e in row) for row in self._freed)
        self._export = IpcExport(
            session=uuid.uuid4().hex[:16],
            slots=self._slots.handle(),
            control=self._control.handle(),
            num_slots=nbuf,
            slot_bytes=size,
            consumer_names=tuple(consumer_names),
            packed_events=packed,
            freed_events=freed,
        )
        return self._export

    def seal(self) -> None:
        """Call once every consumer attached: unlinks shared-memory names (nothing can leak)."""
        for region in (self._slots, self._control):
            if region is not None:
                region.unlink()

    def slot_buffer(self, slot: int) -> torch.Tensor:
        if self._slots is None or self._export is None:
            raise WeightSyncError(f"{self.name}: export() must run before packing")
        if not 0 <= slot < self.manifest.num_buffers:
            raise WeightSyncError(f"{self.name}: slot {slot} out of range (0..{self.manifest.num_buffers - 1})")
        size = self.manifest.buffer_bytes
        return self._slots.tensor[slot * size : (slot + 1) * size]

    def _enqueue_pack(
        self, chunk_index: int, slot: int, sources: Sequence[torch.Tensor], verify: bool, after: Sequence[int] = ()
    ) -> int | None:
        """Queue chunk ``chunk_index``'s copies into ``slot`` on the slot's stream.

        The stream first waits for the caller's stream (parameters it is still writing) and,
        on a GPU, for the ``after`` consumers' last unpack of this slot. Returns the checksum
        when ``verify`` (which waits for the copies on the host).
        """
        if not 0 <= chunk_index < len(self.manifest.chunks):
            raise WeightSyncError(
                f"{self.name}: chunk {chunk_index} out of range (plan has {len(self.manifest.chunks)})"
            )
        buffer = self.slot_buffer(slot)
        chunk = self.manifest.chunks[chunk_index]
        caller = self.streams.caller_stream()
        with self.streams.use(slot):
            self.streams.wait_for(slot, caller)
            stream = torch.cuda.current_stream(self.device) if self.streams.is_cuda else None
            if stream is not None:
                for consumer in after:
                    stream.wait_event(self._freed[consumer][slot])
            pack_chunk(chunk, self.manifest.specs, sources, buffer)
            checksum = byte_checksum(buffer, chunk.nbytes) if verify else None
            if stream is not None and self._packed:
                self._packed[slot].record(stream)
        return checksum

    def pack(self, chunk_index: int, slot: int, sources: Sequence[torch.Tensor], verify: bool = False) -> ChunkHandle:
        """Pack chunk ``chunk_index`` into ``slot``; the bytes are complete when this returns
        (the per-chunk API: the caller hands the handle to consumers itself)."""
        assert self._export is not None
        checksum = self._enqueue_pack(chunk_index, slot, sources, verify)
        deadline = time.monotonic() + self.timeout_s
        self.streams.drain_slot(slot, deadline, f"{self.name}: packing chunk {chunk_index} timed out")
        nbytes = self.manifest.chunks[chunk_index].nbytes
        return ChunkHandle(self._export.session, slot, chunk_index, nbytes, checksum)

    def send(
        self, sources: Sequence[torch.Tensor], sync_seq: int, consumers: Sequence[int], verify: bool = False
    ) -> list[int]:
        """Pack every chunk, handing slots over through the control block (one call per sync).

        ``sync_seq`` counts the syncs completed in this session (both sides are told the
        same); ``consumers`` are the indices, among those exported for, that take part.
        Returns after every consumer took every chunk and this side's copies finished.
        """
        assert self._control_np is not None
        control = self._control_np
        nbuf = self.manifest.num_buffers
        base = sync_seq * len(self.manifest.chunks)
        deadline = time.monotonic() + self.timeout_s
        names = [self.name, *self._consumer_names]
        checksums: list[int] = []
        try:
            if int(control[_PUBLISHED]) != base:
                raise WeightSyncError(
                    f"{self.name}: IPC session out of step (published {int(control[_PUBLISHED])}, "
                    f"expected {base}); the session must be set up again"
                )
            for chunk in self.manifest.chunks:
                g = base + chunk.index
                slot = g % nbuf
                self._await_acks(
                    consumers, g - nbuf + 1, deadline, names, g + 1, f"release slot {slot} before chunk {chunk.index}"
                )
                checksum = self._enqueue_pack(chunk.index, slot, sources, verify, after=consumers if g >= nbuf else ())
                if checksum is not None:
                    checksums.append(checksum)
                    control[_checksum_word(len(self._consumer_names), slot)] = np.int64(
                        np.uint64(checksum).view(np.int64)
                    )
                control[_PUBLISHED] = g + 1
            final = base + len(self.manifest.chunks)
            self._await_acks(consumers, final, deadline, names, 0, "finish the last chunk")
            self.streams.drain(deadline, f"{self.name}: packing timed out")
        except BaseException:
            raise_abort(control, 1)  # the first failure is the one to name
            raise
        return checksums

    def _await_acks(
        self, consumers: Sequence[int], need: int, deadline: float, names: list[str], waiting: int, what: str
    ) -> None:
        assert self._control_np is not None
        control = self._control_np

        def done() -> bool:
            return all(int(control[_ack_word(c)]) >= need for c in consumers)

        if need <= 0 or done():
            return
        control[_WAITING] = waiting
        wait_until(
            done,
            deadline,
            control,
            self.name,
            lambda: f"{self._lagging(consumers, need)} to {what}",
            names,
            peer_pid=lambda: self._lagging_pid(consumers, need),
        )
        control[_WAITING] = 0

    def _late(self, consumers: Sequence[int], need: int) -> list[int]:
        assert self._control_np is not None
        return [c for c in consumers if int(self._control_np[_ack_word(c)]) < need]

    def _lagging(self, consumers: Sequence[int], need: int) -> str:
        return ", ".join(self._consumer_names[c] for c in self._late(consumers, need)) or "workers"

    def _lagging_pid(self, consumers: Sequence[int], need: int) -> int:
        assert self._control_np is not None
        late = self._late(consumers, need)
        return int(self._control_np[_pid_word(late[0])]) if late else 0

    def close(self) -> None:
        for region in (self._slots, self._control):
            if region is not None:
                region.close()
        self._slots = self._control = None
        self._control_np = None
        self._export = None
        self._packed, self._freed = [], []


class IpcReceiver:
    """A consumer: maps the producer's export once and copies chunks out of it."""

    def __init__(self, manifest: Manifest, device: torch.device, timeout_s: float, name: str = "worker") -> None:
        self.manifest = manifest
        self.device = device
        self.timeout_s = timeout_s
        self.name = name
        self.importer = RegionImporter(name)
        self._export: IpcExport | None = None
        self._index = -1
        self._slots: torch.Tensor | None = None
        self._control_np: np.ndarray | None = None
        self._packed: list[torch.cuda.Event] = []
        self._freed: list[torch.cuda.Event] = []

    def attach(self, export: IpcExport, consumer_index: int) -> None:
        if not 0 <= consumer_index < export.num_consumers:
            raise WeightSyncError(
                f"{self.name}: consumer index {consumer_index} out of range for an export "
                f"made for {export.num_consumers} consumer(s)"
            )
        if export.slot_bytes != self.manifest.buffer_bytes or export.num_slots != self.manifest.num_buffers:
            raise WeightSyncError(
                f"{self.name}: IPC export has {export.num_slots} slot(s) of {export.slot_bytes} "
                f"bytes, the manifest says {self.manifest.num_buffers} of {self.manifest.buffer_bytes}"
            )
        self._slots = self.importer.map(export.slots)
        control = view_control(self.importer.map(export.control), self.name, export.control.path)
        if self._slots.device.type == "cuda" and export.packed_events:
            self._packed = [torch.cuda.Event.from_ipc_handle(self._slots.device, h) for h in export.packed_events]
            self._freed = [
                torch.cuda.Event.from_ipc_handle(self._slots.device, h) for h in export.freed_events[consumer_index]
            ]
        control[_pid_word(consumer_index)] = os.getpid()
        self._control_np = control
        self._export = export
        self._index = consumer_index

    def progress(self) -> tuple[int, int]:
        """(chunks published, chunk the producer waits to write or 0): for instrumentation."""
        assert self._control_np is not None
        return int(self._control_np[_PUBLISHED]), int(self._control_np[_WAITING])

    def _slot(self, slot: int) -> torch.Tensor:
        assert self._slots is not None
        size = self.manifest.buffer_bytes
        return self._slots[slot * size : (slot + 1) * size]

    def consume(
        self, handle: ChunkHandle, unpacker: ChunkUnpacker, deliver: Deliver, verify: bool = False
    ) -> int | None:
        """Copy chunk ``handle`` out of its slot into the sink; synchronized on return.

        Refuses, before reading a byte, a handle from another session, a slot or chunk
        index out of range, or a size that disagrees with the plan.
        """
        if self._export is None:
            raise WeightSyncError(f"{self.name}: attach() must run before consume()")
        if handle.session != self._export.session:
            raise WeightSyncError(
                f"{self.name}: chunk handle belongs to session {handle.session}, attached to "
                f"{self._export.session}: a handle from a previous session; nothing was read"
            )
        if not 0 <= handle.slot < self._export.num_slots:
            raise WeightSyncError(f"{self.name}: slot {handle.slot} out of range (0..{self._export.num_slots - 1})")
        chunks = self.manifest.chunks
        if not 0 <= handle.chunk_index < len(chunks):
            raise WeightSyncError(
                f"{self.name}: chunk index {handle.chunk_index} out of range (plan has {len(chunks)} chunks)"
            )
        chunk = chunks[handle.chunk_index]
        if handle.nbytes != chunk.nbytes:
            raise WeightSyncError(
                f"{self.name}: chunk {handle.chunk_index} handle says {handle.nbytes} bytes, "
                f"the plan says {chunk.nbytes}"
            )
        checksum = self._read(chunk.index, handle.slot, unpacker, deliver, verify, handle.checksum)
        self._synchronize(f"copying chunk {chunk.index} out")
        return checksum

    def _read(
        self,
        chunk_index: int,
        slot: int,
        unpacker: ChunkUnpacker,
        deliver: Deliver,
        verify: bool,
        expected: int | None,
    ) -> int | None:
        """Queue chunk ``chunk_index``'s copies out of ``slot`` on this process's stream
        (after the producer's packing event, on a GPU), then record this consumer's event."""
        chunk = self.manifest.chunks[chunk_index]
        buffer = self._slot(slot)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None and self._packed:
            stream.wait_event(self._packed[slot])
        handed = unpacker.unpack(chunk, buffer)
        if handed:
            deliver(handed)
        checksum = None
        if verify:
            # Over the bytes just unpacked, so the check covers what the worker now holds.
            checksum = byte_checksum(buffer, chunk.nbytes)
            if expected is not None and checksum != expected:
                raise ChecksumMismatch(
                    f"{self.name}: chunk {chunk_index} checksum {checksum:#x} != trainer's "
                    f"{expected:#x}: bytes were corrupted in transit"
                )
        if stream is not None and self._freed:
            self._freed[slot].record(stream)
        return checksum

    def _synchronize(self, what: str) -> None:
        if self.device.type == "cuda":
            wait_for_stream(
                torch.cuda.current_stream(self.device),
                time.monotonic() + self.timeout_s,
                f"{self.name}: {what} timed out",
            )

    def receive(self, sync_seq: int, unpacker: ChunkUnpacker, deliver: Deliver, verify: bool = False) -> list[int]:
        """Take every chunk as the producer publishes it (the per-sync partner of ``send``).

        Returns once every byte landed in the sink (this side's stream synchronized).
        """
        if self._export is None or self._control_np is None:
            raise WeightSyncError(f"{self.name}: attach() must run before receive()")
        control = self._control_np
        nbuf = self.manifest.num_buffers
        nchunks = len(self.manifest.chunks)
        base = sync_seq * nchunks
        # A consumer gives the producer a margin: the producer sees which consumer is late
        # and should be the one to time out and name it.
        deadline = time.monotonic() + self.timeout_s * 1.25 + 1.0
        names = ["trainer", *self._export.consumer_names]
        csum_at = _checksum_word(self._export.num_consumers, 0)
        me = _ack_word(self._index)
        checksums: list[int] = []
        try:
            if int(control[me]) != base:
                raise WeightSyncError(
                    f"{self.name}: IPC session out of step (acknowledged {int(control[me])}, "
                    f"expected {base}); the session must be set up again"
                )
            for chunk in self.manifest.chunks:
                g = base + chunk.index

                def published(g: int = g) -> bool:
                    return int(control[_PUBLISHED]) > g

                def awaited(k: int = chunk.index) -> str:
                    return f"the trainer to publish chunk {k}"

                wait_until(
                    published,
                    deadline,
                    control,
                    self.name,
                    awaited,
                    names,
                    peer_pid=lambda: int(control[_PRODUCER_PID]),
                )
                expected = None
                if verify:
                    expected = int(np.int64(control[csum_at + g % nbuf]).view(np.uint64))
                got = self._read(chunk.index, g % nbuf, unpacker, deliver, verify, expected)
                if got is not None:
                    checksums.append(got)
                control[me] = g + 1
            unpacker.finish()
            self._synchronize("copying the last chunks out")
        except BaseException:
            raise_abort(control, 2 + self._index)
            raise
        return checksums

    def close(self) -> None:
        self._slots = None
        self._control_np = None
        self._export = None
        self._packed, self._freed = [], []
        self.importer.release_all()


class ChecksumMismatch(WeightSyncError):
    """Bytes a worker received differ from what the trainer packed."""
