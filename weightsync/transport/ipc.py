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

Every wait has a deadline; a side that fails raises an abort flag in the control block so
the others stop at once and name it, instead of waiting out the timeout.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from weightsync.packing import ChunkUnpacker, byte_checksum, pack_chunk
from weightsync.spec import Manifest, WeightSyncError
from weightsync.transport.broadcast import Deliver
from weightsync.transport.cuda_ipc import CudaIpcHandle, CudaRegion, map_cuda_ipc
from weightsync.transport.shm import ShmHandle, ShmRegion, map_shm
from weightsync.transport.streams import SlotStreams, TransferTimeout, wait_for_stream

RegionHandle = ShmHandle | CudaIpcHandle

_MAGIC = 0x5753594E43  # "WSYNC"
# Control block words: magic, abort code (1 = producer, 2 + i = consumer i), chunks
# published, the chunk the producer is waiting to write (0 when not waiting), then one
# acknowledged-count per consumer, then one checksum per slot.
_ABORT, _PUBLISHED, _WAITING, _FIRST_CONSUMER = 1, 2, 3, 4


class PeerAborted(WeightSyncError):
    """The other side of an IPC hand-off failed and raised the abort flag."""


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


def _wait(
    predicate: Callable[[], bool],
    deadline: float,
    control: np.ndarray,
    me: str,
    what: Callable[[], str],
    names: Sequence[str],
) -> None:
    """Spin, then back off, until ``predicate``; raise on the peer's abort flag or the deadline.

    ``what`` is called only to word an error, so it names who is late at that moment.
    """
    spins = 0
    delay = 10e-6
    while not predicate():
        code = int(control[_ABORT])
        if code:
            who = names[code - 1] if 0 < code <= len(names) else f"peer {code}"
            raise PeerAborted(f"{me}: {who} failed during the transfer; stopped waiting for {what()}")
        if time.monotonic() > deadline:
            raise TransferTimeout(
                f"{me}: timed out waiting for {what()}; that side is stuck, dead or too slow "
                "(raise timeout_s if it is only slow)"
            )
        spins += 1
        if spins > 2000:
            time.sleep(delay)
            delay = min(delay * 2, 100e-6)


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

    def export(self, consumer_names: Sequence[str]) -> IpcExport:
        """Allocate and export the slots and the control block, once per session."""
        if self._export is not None:
            raise WeightSyncError(f"{self.name}: IPC slots already exported for this session")
        nbuf, size = self.manifest.num_buffers, self.manifest.buffer_bytes
        self._slots = make_region(nbuf * size, self.device, tag="slots")
        self._consumer_names = list(consumer_names)
        words = _FIRST_CONSUMER + len(consumer_names) + nbuf
        self._control = ShmRegion(words * 8, tag="ctl")
        control = self._control.tensor.view(torch.int64)
        control.zero_()
        control[0] = _MAGIC
        self._control_np = control.numpy()
        session = uuid.uuid4().hex[:16]
        self._export = IpcExport(
            session=session,
            slots=self._slots.handle(),
            control=self._control.handle(),
            num_slots=nbuf,
            slot_bytes=size,
            consumer_names=tuple(consumer_names),
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

    def pack(self, chunk_index: int, slot: int, sources: Sequence[torch.Tensor], verify: bool = False) -> ChunkHandle:
        """Pack chunk ``chunk_index`` into ``slot`` and make it visible before returning."""
        assert self._export is not None
        if not 0 <= chunk_index < len(self.manifest.chunks):
            raise WeightSyncError(
                f"{self.name}: chunk {chunk_index} out of range (plan has {len(self.manifest.chunks)})"
            )
        buffer = self.slot_buffer(slot)
        chunk = self.manifest.chunks[chunk_index]
        deadline = time.monotonic() + self.timeout_s
        caller = self.streams.caller_stream()
        with self.streams.use(slot):
            self.streams.wait_for(slot, caller)
            pack_chunk(chunk, self.manifest.specs, sources, buffer)
            checksum = byte_checksum(buffer, chunk.nbytes) if verify else None
        self.streams.drain_slot(slot, deadline, f"{self.name}: packing chunk {chunk_index} timed out")
        return ChunkHandle(self._export.session, slot, chunk_index, chunk.nbytes, checksum)

    def send(
        self, sources: Sequence[torch.Tensor], sync_seq: int, consumers: Sequence[int], verify: bool = False
    ) -> list[int]:
        """Pack every chunk, handing slots over through the control block (one call per sync).

        ``sync_seq`` counts the syncs completed in this session (both sides are told the
        same); ``consumers`` are the indices, among those exported for, that take part.
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
                need = g - nbuf + 1

                def slot_free(need: int = need) -> bool:
                    return all(int(control[_FIRST_CONSUMER + c]) >= need for c in consumers)

                if not slot_free():
                    control[_WAITING] = g + 1
                    _wait(
                        slot_free,
                        deadline,
                        control,
                        self.name,
                        lambda need=need, slot=slot, k=chunk.index: (
                            f"{self._lagging(consumers, need)} to release slot {slot} before chunk {k}"
                        ),
                        names,
                    )
                    control[_WAITING] = 0
                handle = self.pack(chunk.index, slot, sources, verify)
                if verify:
                    assert handle.checksum is not None
                    checksums.append(handle.checksum)
                    control[_FIRST_CONSUMER + len(self._consumer_names) + slot] = np.int64(
                        np.uint64(handle.checksum).view(np.int64)
                    )
                control[_PUBLISHED] = g + 1
            final = base + len(self.manifest.chunks)
            _wait(
                lambda: all(int(control[_FIRST_CONSUMER + c]) >= final for c in consumers),
                deadline,
                control,
                self.name,
                lambda: f"{self._lagging(consumers, final)} to finish the last chunk",
                names,
            )
        except BaseException:
            if not int(control[_ABORT]):  # the first failure is the one to name
                control[_ABORT] = 1
            raise
        return checksums

    def _lagging(self, consumers: Sequence[int], need: int) -> str:
        assert self._control_np is not None
        late = [self._consumer_names[c] for c in consumers if int(self._control_np[_FIRST_CONSUMER + c]) < need]
        return ", ".join(late) or "workers"

    def close(self) -> None:
        for region in (self._slots, self._control):
            if region is not None:
                region.close()
        self._slots = self._control = None
        self._control_np = None
        self._export = None


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
        control = self.importer.map(export.control).view(torch.int64)
        if int(control[0]) != _MAGIC:
            raise WeightSyncError(f"{self.name}: IPC control block {export.control.path} is not weightsync's")
        self._control_np = control.numpy()
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
        return self._read(chunk.index, self._slot(handle.slot), unpacker, deliver, verify, handle.checksum)

    def _read(
        self,
        chunk_index: int,
        buffer: torch.Tensor,
        unpacker: ChunkUnpacker,
        deliver: Deliver,
        verify: bool,
        expected: int | None,
    ) -> int | None:
        chunk = self.manifest.chunks[chunk_index]
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
        if self.device.type == "cuda":
            wait_for_stream(
                torch.cuda.current_stream(self.device),
                time.monotonic() + self.timeout_s,
                f"{self.name}: copying chunk {chunk_index} out timed out",
            )
        return checksum

    def receive(self, sync_seq: int, unpacker: ChunkUnpacker, deliver: Deliver, verify: bool = False) -> list[int]:
        """Take every chunk as the producer publishes it (the per-sync partner of ``send``)."""
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
        csum_at = _FIRST_CONSUMER + self._export.num_consumers
        me = _FIRST_CONSUMER + self._index
        checksums: list[int] = []
        try:
            if int(control[me]) != base:
                raise WeightSyncError(
                    f"{self.name}: IPC session out of step (acknowledged {int(control[me])}, "
                    f"expected {base}); the session must be set up again"
                )
            for chunk in self.manifest.chunks:
                g = base + chunk.index
                _wait(
                    lambda g=g: int(control[_PUBLISHED]) > g,
                    deadline,
                    control,
                    self.name,
                    lambda k=chunk.index: f"the trainer to publish chunk {k}",
                    names,
                )
                expected = None
                if verify:
                    expected = int(np.int64(control[csum_at + g % nbuf]).view(np.uint64))
                got = self._read(chunk.index, self._slot(g % nbuf), unpacker, deliver, verify, expected)
                if got is not None:
                    checksums.append(got)
                control[me] = g + 1
            unpacker.finish()
        except BaseException:
            if not int(control[_ABORT]):
                control[_ABORT] = 2 + self._index
            raise
        return checksums

    def close(self) -> None:
        self._slots = None
        self._control_np = None
        self._export = None
        self.importer.release_all()


class ChecksumMismatch(WeightSyncError):
    """Bytes a worker received differ from what the trainer packed."""
