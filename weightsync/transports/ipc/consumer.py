"""The ipc transport's consumer half (see :mod:`weightsync.transports.ipc.halves` for the
whole hand-over): maps the producer's export once and copies chunks out of its slots."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from weightsync.core.delta.header import header_manifest
from weightsync.core.delta.landing import DeltaReceiving, HeaderCatch
from weightsync.core.halves import Landing, ReceiveHalf
from weightsync.core.packing import ChunkUnpacker, byte_checksum
from weightsync.core.wire.errors import ChecksumMismatch, WeightSyncError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.session import Session
from weightsync.mechanisms.batched_copy import BatchedCopier
from weightsync.mechanisms.control import ControlBlock, worker_code
from weightsync.mechanisms.regions import RegionImporter
from weightsync.mechanisms.streams import wait_for_stream
from weightsync.transports.ipc.handoff import (
    PRODUCER_PID,
    PUBLISHED,
    WAITING,
    ack_word,
    checksum_word,
    from_word,
    pid_word,
)
from weightsync.transports.ipc.messages import IpcExport
from weightsync.transports.ipc.slot_copies import UnpackPlans


class IpcReceiver(ReceiveHalf):
    """A consumer: maps the producer's export once and copies chunks out of it."""

    kind = "ipc"
    carries_deltas = True
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
        control[pid_word(consumer_index)] = os.getpid()
        control.precise = self._slots.device.type == "cuda"
        self._control = control
        self._export = export
        self._index = consumer_index

    def mappings(self) -> tuple[int, int]:
        return self.importer.maps, self.importer.releases

    def progress(self) -> tuple[int, int]:
        """(chunks published, chunk the producer waits to write or 0): for instrumentation."""
        control, _ = self._ctl()
        return control[PUBLISHED], control[WAITING]

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
        manifest: Manifest | None = None,
    ) -> int | None:
        """Queue chunk ``chunk_index``'s copies (of ``manifest``, by default the session's)
        out of ``slot`` on this process's stream (after the producer's packing event, on a
        GPU), then record this consumer's event. ``plans``: unpack through the batched
        kernel into these destinations."""
        chunk = (self.manifest if manifest is None else manifest).chunks[chunk_index]
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
        """Take every chunk as the producer publishes it (in a delta session: the header
        first, then the plan it announces); returns once every byte landed."""
        control, _ = self._ctl()
        g = control[ack_word(self._index)]  # chunks are numbered from the session's start
        checksums: list[int] = []
        if isinstance(sink, DeltaReceiving):
            catch = HeaderCatch()
            g = self._take(header_manifest(self.manifest), catch, g, call.verify, checksums, None)
            assert catch.raw is not None
            manifest, landing = sink.open(catch.raw)
            begin()
            if manifest is not None:
                self._take(manifest, landing, g, call.verify, checksums, None)
            sink.finish()
        else:
            self._take(self.manifest, sink, g, call.verify, checksums, begin)
        return checksums, ()

    def _take(
        self,
        manifest: Manifest,
        sink: Landing,
        g: int,
        verify: bool,
        checksums: list[int],
        begin: Callable[[], None] | None,
    ) -> int:
        """Take ``manifest``'s chunks, numbered from ``g``, into ``sink``; the next number.
        ``begin`` (when given) runs before the first byte lands."""
        control, export = self._ctl()
        nbuf = self.manifest.depth(self.manifest.chunks)
        deadline = self.deadlines.follower(time.monotonic())
        names = [self.server, *export.consumer_names]
        csum_at = checksum_word(export.num_consumers, 0)
        me = ack_word(self._index)
        destinations = sink.destinations(manifest)
        unpacker = ChunkUnpacker(manifest.specs, destinations.__getitem__, sink.keeps_references)
        plans = None
        if self.copier is not None and manifest is self.manifest:
            if self._plans is None or self._plans.copier is not self.copier:
                self._plans = UnpackPlans(self.copier, self.manifest.specs)
            if self._plans.begin(destinations):
                plans = (self._plans, destinations)
        for chunk in manifest.chunks:
            control.wait(
                lambda g=g: control[PUBLISHED] > g,  # type: ignore[misc]
                deadline,
                self.name,
                lambda k=chunk.index: f"{self.server} to publish chunk {k}",  # type: ignore[misc]
                names,
                peer_pid=lambda: control[PRODUCER_PID],
                late=lambda: [self.server],
            )
            if chunk.index == 0 and begin is not None:
                begin()
            expected = from_word(control[csum_at + g % nbuf]) if verify else None
            got = self._read(chunk.index, g % nbuf, unpacker, sink.consume, verify, expected, plans, manifest)
            if got is not None:
                checksums.append(got)
            g += 1
            control[me] = g
        unpacker.finish()
        self._synchronize("copying the last chunks out")
        return g

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
