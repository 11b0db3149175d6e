"""Packed transfer through slots the trainer exports once and each worker maps once.

For a trainer and workers on one device (one GPU, or one host on CPU) whose sink transforms
tensors on load, where a collective is impossible (NCCL refuses two ranks on one GPU). The
producer allocates ``num_buffers`` slots (never more than the plan has chunks:
``Manifest.depth``) in one exported region and packs chunk k into slot ``k % num_buffers``;
each consumer copies out of its mapping of the same memory.

Per sync, one call per side (``send`` and ``receive``, started together). Slots are handed
over on the control block: the producer publishes chunk g after its bytes are visible, each
consumer acknowledges g after its copy out finished, and the producer writes slot
``g % num_buffers`` only once every consumer acknowledged chunk ``g - num_buffers``; so with
two slots the producer packs chunk k+1 while consumers read chunk k, and a slot is never
rewritten while anyone reads it. On a GPU no side waits on the host per chunk: the producer
records an interprocess CUDA event after packing a slot and publishes at once; a consumer's
stream waits on it, unpacks, records its own event and acknowledges; the producer's stream
waits on every consumer's event before packing that slot again. Each side synchronizes
once, at the end of a sync. With CuPy, packing and unpacking a chunk are one launch of the
batched copy kernel each (:mod:`weightsync.transports.ipc.slot_copies`).

Both halves are made from their party's Session: the consumers name the trainer party that
serves them (``session.server``) when it fails or is late. ``IpcSender.pack_slot`` and
``IpcReceiver.read_slot`` move one chunk through one slot, synchronized, for callers that
hand chunks over themselves (the bench's model of the reference design): such a caller must
not pack into a slot again before every consumer's read of it returned.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence

import numpy as np
import torch

from weightsync.core.halves import Landing, ReceiveHalf, SendHalf, Sources
from weightsync.core.packing import ChunkUnpacker, byte_checksum, pack_chunk
from weightsync.core.wire.errors import ChecksumMismatch, WeightSyncError
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.session import Session
from weightsync.mechanisms.batched_copy import BatchedCopier
from weightsync.mechanisms.control import TRAINER, ControlBlock, worker_code
from weightsync.mechanisms.regions import Region, RegionImporter, make_region
from weightsync.mechanisms.streams import SlotStreams, wait_for_stream
from weightsync.transports.ipc.messages import IpcExport
from weightsync.transports.ipc.slot_copies import PackPlans, UnpackPlans

# Control words: chunks published, the chunk the producer waits to write (0 when not
# waiting), the producer's pid; then per consumer its acknowledged count and its pid; then
# one checksum per slot.
_PUBLISHED, _WAITING, _PRODUCER_PID = 0, 1, 2
_FIRST_CONSUMER = 3


def _ack_word(consumer: int) -> int:
    return _FIRST_CONSUMER + 2 * consumer


def _pid_word(consumer: int) -> int:
    return _FIRST_CONSUMER + 2 * consumer + 1


def _checksum_word(num_consumers: int, slot: int) -> int:
    return _FIRST_CONSUMER + 2 * num_consumers + slot


def _as_word(checksum: int) -> int:
    return int(np.uint64(checksum).view(np.int64))


def _from_word(word: int) -> int:
    return int(np.int64(word).view(np.uint64))


class IpcSender(SendHalf):
    """The producer: exports ``num_buffers`` slots once and packs chunks into them."""

    kind = "ipc"

    def __init__(self, session: Session, device: torch.device) -> None:
        self.session = session
        self.manifest = session.manifest
        self.device = device
        self.deadlines = session.deadlines
        self.name = session.party
        self.streams = SlotStreams(device, self.manifest.depth(self.manifest.chunks))
        self._slots: Region | None = None
        self._control: ControlBlock | None = None
        self._export: IpcExport | None = None
        self._packed: list[torch.cuda.Event] = []
        self._freed: list[list[torch.cuda.Event]] = []
        #: Packs each chunk in one kernel launch (None: one ``copy_`` per tensor; off CUDA or without CuPy).
        self.copier: BatchedCopier | None = BatchedCopier.create(device)
        self._plans: PackPlans | None = None

    @property
    def peers(self) -> tuple[str, ...]:
        return self._export.consumer_names if self._export is not None else ()

    def export(self, consumer_names: Sequence[str]) -> IpcExport:
        """Allocate and export the slots and the control block, once per session."""
        if self._export is not None:
            raise WeightSyncError(f"{self.name}: IPC slots already exported for this session")
        nbuf, size = self.manifest.depth(self.manifest.chunks), self.manifest.agreed.buffer_bytes
        self._slots = make_region(nbuf * size, self.device, tag="slots")
        self._control = ControlBlock.create(
            _checksum_word(len(consumer_names), nbuf), tag="ctl", parties=1 + len(consumer_names)
        )
        self._control[_PRODUCER_PID] = os.getpid()
        self._control.precise = self.streams.is_cuda
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
        if self._slots is not None:
            self._slots.unlink()
        if self._control is not None:
            self._control.unlink()

    def slot_buffer(self, slot: int) -> torch.Tensor:
        if self._slots is None or self._export is None:
            raise WeightSyncError(f"{self.name}: export() must run before packing")
        if not 0 <= slot < self.manifest.depth(self.manifest.chunks):
            raise WeightSyncError(
                f"{self.name}: slot {slot} out of range (0..{self.manifest.depth(self.manifest.chunks) - 1})"
            )
        size = self.manifest.agreed.buffer_bytes
        return self._slots.tensor[slot * size : (slot + 1) * size]

    def _enqueue_pack(
        self,
        chunk_index: int,
        slot: int,
        sources: Sequence[torch.Tensor],
        verify: bool,
        after: Sequence[int] = (),
        plans: PackPlans | None = None,
    ) -> int | None:
        """Queue chunk ``chunk_index``'s copies into ``slot`` on the slot's stream.

        The stream first waits for the caller's stream (parameters it is still writing) and,
        on a GPU, for the ``after`` consumers' last unpack of this slot. Returns the checksum
        when ``verify`` (which waits for the copies on the host). ``plans``: pack through
        the batched kernel (sources whose key the plans began this sync with).
        """
        if not 0 <= chunk_index < len(self.manifest.chunks):
            raise WeightSyncError(
                f"{self.name}: chunk {chunk_index} out of range (plan has {len(self.manifest.chunks)})"
            )
        buffer = self.slot_buffer(slot)
        chunk = self.manifest.chunks[chunk_index]
        caller = self.streams.caller_stream()
        with self.streams.use(slot), torch.no_grad():
            self.streams.wait_for(slot, caller)
            stream = torch.cuda.current_stream(self.device) if self.streams.is_cuda else None
            if stream is not None:
                for consumer in after:
                    stream.wait_event(self._freed[consumer][slot])
            if plans is None:
                pack_chunk(chunk, self.manifest.specs, sources, buffer)
            else:
                plans.pack(chunk, slot, buffer, sources, stream)
            checksum = byte_checksum(buffer, chunk.nbytes) if verify else None
            if stream is not None and self._packed:
                self._packed[slot].record(stream)
        return checksum

    def pack_slot(
        self, chunk_index: int, slot: int, sources: Sequence[torch.Tensor], verify: bool = False
    ) -> int | None:
        """Pack chunk ``chunk_index`` into ``slot``, complete when this returns; its checksum
        with ``verify``. For callers that hand the chunk to each consumer themselves."""
        if self._export is None:
            raise WeightSyncError(f"{self.name}: export() must run before packing")
        checksum = self._enqueue_pack(chunk_index, slot, sources, verify)
        deadline = self.deadlines.leader(time.monotonic())
        self.streams.drain_slot(slot, deadline, f"{self.name}: packing chunk {chunk_index} timed out", own=True)
        return checksum

    @property
    def export_session(self) -> str | None:
        """The id of this session's export (what a consumer attached to), if exported."""
        return self._export.session if self._export is not None else None

    def send(self, sources: Sources, call: SyncCall, deadline: float) -> tuple[list[int], tuple[str, ...]]:
        """Pack every chunk, handing slots over on the control block.

        Returns after every consumer took every chunk and this side's copies finished.
        """
        control, export = self._ctl()
        consumers = range(export.num_consumers)
        nbuf = self.manifest.depth(self.manifest.chunks)
        base = call.seq * len(self.manifest.chunks)
        checksums: list[int] = []
        if control[_PUBLISHED] != base:
            raise WeightSyncError(
                f"{self.name}: IPC session out of step (published {control[_PUBLISHED]}, expected {base}); "
                "run setup() again"
            )
        plans = self._pack_plans(sources)
        for chunk in self.manifest.chunks:
            g = base + chunk.index
            slot = g % nbuf
            self._await_acks(g - nbuf + 1, deadline, g + 1, f"release slot {slot} before chunk {chunk.index}")
            after = consumers if g >= nbuf else ()
            checksum = self._enqueue_pack(chunk.index, slot, sources.tensors, call.verify, after, plans)
            if checksum is not None:
                checksums.append(checksum)
                control[_checksum_word(export.num_consumers, slot)] = _as_word(checksum)
            control[_PUBLISHED] = g + 1
        self._await_acks(base + len(self.manifest.chunks), deadline, 0, "finish the last chunk")
        self.streams.drain(deadline, f"{self.name}: packing timed out", own=True)
        return checksums, ()

    def _ctl(self) -> tuple[ControlBlock, IpcExport]:
        if self._control is None or self._export is None:
            raise WeightSyncError(f"{self.name}: no IPC export is open; run setup()")
        return self._control, self._export

    def _pack_plans(self, sources: Sources) -> PackPlans | None:
        """This sync's batched packing, or None (no copier; sources made as they are read,
        or without a key, have no stable addresses to plan on; sources that moved since the
        last sync, see :meth:`PackPlans.begin`)."""
        if self.copier is None or sources.streamed or sources.key is None:
            return None
        if self._plans is None or self._plans.copier is not self.copier:
            self._plans = PackPlans(self.copier, self.manifest.specs)
        return self._plans if self._plans.begin(sources.key) else None

    def _await_acks(self, need: int, deadline: float, waiting: int, what: str) -> None:
        control, export = self._ctl()

        def late() -> list[str]:
            return [n for c, n in enumerate(export.consumer_names) if control[_ack_word(c)] < need]

        def done() -> bool:
            return all(control[_ack_word(c)] >= need for c in range(export.num_consumers))

        if need <= 0 or done():
            return

        def lagging_pid() -> int:
            names = late()
            return control[_pid_word(export.consumer_names.index(names[0]))] if names else 0

        control[_WAITING] = waiting
        control.wait(
            done,
            deadline,
            self.name,
            lambda: f"{', '.join(late()) or 'workers'} to {what}",
            [self.name, *export.consumer_names],
            peer_pid=lagging_pid,
            late=late,
        )
        control[_WAITING] = 0

    def start(self, call: SyncCall) -> None:
        if self._control is not None:
            self._control.epoch = call.seq + 1

    def abort(self) -> None:
        if self._control is not None:
            self._control.abort(TRAINER)

    def close(self, abort: bool = False) -> None:
        if abort:
            self.abort()
        if self._slots is not None:
            self._slots.close()
        if self._control is not None:
            self._control.close()
        self._slots = self._control = None
        self._export = None
        self._packed, self._freed = [], []
        self._plans = None


class IpcReceiver(ReceiveHalf):
    """A consumer: maps the producer's export once and copies chunks out of it."""

    kind = "ipc"
    knows_sender_finished = True

    def __init__(self, session: Session, device: torch.device) -> None:
        self.session = session
        self.manifest = session.manifest
        self.device = device
        self.deadlines = session.deadlines
        self.name = session.party
        self.server = session.server
        self.importer = RegionImporter(self.name)
        self._export: IpcExport | None = None
        self._index = -1
        self._slots: torch.Tensor | None = None
        self._control: ControlBlock | None = None
        self._packed: list[torch.cuda.Event] = []
        self._freed: list[torch.cuda.Event] = []
        #: Unpacks each chunk in one kernel launch (None: one ``copy_`` per tensor; off CUDA or without CuPy).
        self.copier: BatchedCopier | None = BatchedCopier.create(device)
        self._plans: UnpackPlans | None = None

    def attach(self, export: IpcExport, consumer_index: int) -> None:
        if not 0 <= consumer_index < export.num_consumers:
            raise WeightSyncError(
                f"{self.name}: consumer index {consumer_index} out of range for an export "
                f"made for {export.num_consumers} consumer(s)"
            )
        agreed, depth = self.manifest.agreed, self.manifest.depth(self.manifest.chunks)
        if export.slot_bytes != agreed.buffer_bytes or export.num_slots != depth:
            raise WeightSyncError(
                f"{self.name}: IPC export has {export.num_slots} slot(s) of {export.slot_bytes} "
                f"bytes, the manifest says {depth} of {agreed.buffer_bytes}"
            )
        self._slots = self.importer.map(export.slots)
        control = ControlBlock.attach(self.importer.map(export.control), self.name, export.control.path)
        if self._slots.device.type == "cuda" and export.packed_events:
            self._packed = [torch.cuda.Event.from_ipc_handle(self._slots.device, h) for h in export.packed_events]
            self._freed = [
                torch.cuda.Event.from_ipc_handle(self._slots.device, h) for h in export.freed_events[consumer_index]
            ]
        control[_pid_word(consumer_index)] = os.getpid()
        control.precise = self._slots.device.type == "cuda"
        self._control = control
        self._export = export
        self._index = consumer_index

    def mappings(self) -> tuple[int, int]:
        return self.importer.maps, self.importer.releases

    def progress(self) -> tuple[int, int]:
        """(chunks published, chunk the producer waits to write or 0): for instrumentation."""
        control, _ = self._ctl()
        return control[_PUBLISHED], control[_WAITING]

    def _ctl(self) -> tuple[ControlBlock, IpcExport]:
        if self._control is None or self._export is None:
            raise WeightSyncError(f"{self.name}: no IPC export attached; run setup()")
        return self._control, self._export

    def _slot(self, slot: int) -> torch.Tensor:
        assert self._slots is not None
        size = self.manifest.agreed.buffer_bytes
        return self._slots[slot * size : (slot + 1) * size]

    def read_slot(
        self,
        chunk_index: int,
        slot: int,
        unpacker: ChunkUnpacker,
        deliver: Callable[[list[tuple[str, torch.Tensor]]], None],
        verify: bool = False,
        expected: int | None = None,
    ) -> int | None:
        """Copy chunk ``chunk_index`` out of ``slot`` into the sink, synchronized on return;
        its checksum with ``verify``. For callers that hand chunks over themselves."""
        _, export = self._ctl()
        if not 0 <= slot < export.num_slots:
            raise WeightSyncError(f"{self.name}: slot {slot} out of range (0..{export.num_slots - 1})")
        if not 0 <= chunk_index < len(self.manifest.chunks):
            raise WeightSyncError(
                f"{self.name}: chunk index {chunk_index} out of range (plan has {len(self.manifest.chunks)} chunks)"
            )
        checksum = self._read(chunk_index, slot, unpacker, deliver, verify, expected)
        self._synchronize(f"copying chunk {chunk_index} out")
        return checksum

    @property
    def export_session(self) -> str | None:
        """The id of the export this consumer attached to, if attached."""
        return self._export.session if self._export is not None else None

    def _read(
        self,
        chunk_index: int,
        slot: int,
        unpacker: ChunkUnpacker,
        deliver: Callable[[list[tuple[str, torch.Tensor]]], None],
        verify: bool,
        expected: int | None,
        plans: tuple[UnpackPlans, list[torch.Tensor | None]] | None = None,
    ) -> int | None:
        """Queue chunk ``chunk_index``'s copies out of ``slot`` on this process's stream
        (after the producer's packing event, on a GPU), then record this consumer's event.
        ``plans``: unpack through the batched kernel into these destinations."""
        chunk = self.manifest.chunks[chunk_index]
        buffer = self._slot(slot)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None and self._packed:
            stream.wait_event(self._packed[slot])
        if plans is None:
            handed = unpacker.unpack(chunk, buffer)
        else:
            handed = plans[0].unpack(chunk, slot, buffer, plans[1], unpacker, stream)
        if handed:
            deliver(handed)
        checksum = None
        if verify:
            # Over the bytes just unpacked, so the check covers what the worker now holds.
            checksum = byte_checksum(buffer, chunk.nbytes)
            if expected is not None and checksum != expected:
                raise ChecksumMismatch(
                    f"{self.name}: chunk {chunk_index} checksum {checksum:#x} != {self.server}'s "
                    f"{expected:#x}: bytes were corrupted in transit"
                )
        if stream is not None and self._freed:
            self._freed[slot].record(stream)
        return checksum

    def _synchronize(self, what: str) -> None:
        if self.device.type == "cuda":
            wait_for_stream(
                torch.cuda.current_stream(self.device),
                self.deadlines.follower(time.monotonic()),
                f"{self.name}: {what} timed out",
            )

    def receive(self, sink: Landing, call: SyncCall, begin: Callable[[], None]) -> tuple[list[int], tuple[str, ...]]:
        """Take every chunk as the producer publishes it; returns once every byte landed."""
        control, export = self._ctl()
        nbuf = self.manifest.depth(self.manifest.chunks)
        base = call.seq * len(self.manifest.chunks)
        deadline = self.deadlines.follower(time.monotonic())
        names = [self.server, *export.consumer_names]
        csum_at = _checksum_word(export.num_consumers, 0)
        me = _ack_word(self._index)
        if control[me] != base:
            raise WeightSyncError(
                f"{self.name}: IPC session out of step (acknowledged {control[me]}, expected {base}); run setup() again"
            )
        destinations = sink.destinations(self.manifest)
        unpacker = ChunkUnpacker(self.manifest.specs, destinations.__getitem__, sink.keeps_references)
        plans = None
        if self.copier is not None:
            if self._plans is None or self._plans.copier is not self.copier:
                self._plans = UnpackPlans(self.copier, self.manifest.specs)
            if self._plans.begin(destinations):
                plans = (self._plans, destinations)
        checksums: list[int] = []
        for chunk in self.manifest.chunks:
            g = base + chunk.index
            control.wait(
                lambda g=g: control[_PUBLISHED] > g,  # type: ignore[misc]
                deadline,
                self.name,
                lambda k=chunk.index: f"{self.server} to publish chunk {k}",  # type: ignore[misc]
                names,
                peer_pid=lambda: control[_PRODUCER_PID],
                late=lambda: [self.server],
            )
            if chunk.index == 0:
                begin()
            expected = _from_word(control[csum_at + g % nbuf]) if call.verify else None
            got = self._read(chunk.index, g % nbuf, unpacker, sink.consume, call.verify, expected, plans)
            if got is not None:
                checksums.append(got)
            control[me] = g + 1
        unpacker.finish()
        self._synchronize("copying the last chunks out")
        return checksums, ()

    def start(self, call: SyncCall) -> None:
        if self._control is not None:
            self._control.epoch = call.seq + 1

    def abort(self) -> None:
        if self._control is not None:
            self._control.abort(worker_code(self._index))

    def close(self, abort: bool = False) -> None:
        if abort:
            self.abort()
        self._slots = None
        self._control = None
        self._export = None
        self._packed, self._freed = [], []
        self._plans = None
        self.importer.release_all()
