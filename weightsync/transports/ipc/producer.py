"""The ipc transport's trainer half: the producer, which exports its slots once and packs
chunks into them (the hand-off: :mod:`weightsync.transports.ipc.halves`)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence

import torch

from weightsync.core.delta.sending import delta_steps
from weightsync.core.halves import SendHalf, Sources
from weightsync.core.packing import byte_checksum, pack_chunk
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.session import Session
from weightsync.mechanisms.batched_copy import BatchedCopier
from weightsync.mechanisms.control import TRAINER, ControlBlock
from weightsync.mechanisms.regions import Region, make_region
from weightsync.mechanisms.streams import SlotStreams
from weightsync.transports.ipc.handoff import (
    PRODUCER_PID,
    PUBLISHED,
    WAITING,
    ack_word,
    as_word,
    checksum_word,
    pid_word,
)
from weightsync.transports.ipc.messages import IpcExport
from weightsync.transports.ipc.slot_copies import PackPlans


class IpcSender(SendHalf):
    """The producer: exports ``num_buffers`` slots once and packs chunks into them."""

    kind = "ipc"
    carries_deltas = True

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
            checksum_word(len(consumer_names), nbuf), tag="ctl", parties=1 + len(consumer_names)
        )
        self._control[PRODUCER_PID] = os.getpid()
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
        manifest: Manifest | None = None,
    ) -> int | None:
        """Queue chunk ``chunk_index`` (of ``manifest``, by default the session's) into
        ``slot`` on the slot's stream.

        The stream first waits for the caller's stream (parameters it is still writing) and,
        on a GPU, for the ``after`` consumers' last unpack of this slot. Returns the checksum
        when ``verify`` (which waits for the copies on the host). ``plans``: pack through
        the batched kernel (sources whose key the plans began this sync with).
        """
        manifest = self.manifest if manifest is None else manifest
        if not 0 <= chunk_index < len(manifest.chunks):
            raise WeightSyncError(f"{self.name}: chunk {chunk_index} out of range (plan has {len(manifest.chunks)})")
        buffer = self.slot_buffer(slot)
        chunk = manifest.chunks[chunk_index]
        caller = self.streams.caller_stream()
        with self.streams.use(slot), torch.no_grad():
            self.streams.wait_for(slot, caller)
            stream = torch.cuda.current_stream(self.device) if self.streams.is_cuda else None
            if stream is not None:
                for consumer in after:
                    stream.wait_event(self._freed[consumer][slot])
            if plans is None:
                pack_chunk(chunk, manifest.specs, sources, buffer)
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
        """Pack every chunk, handing slots over on the control block (in a delta session:
        the header as the first chunk, then the plan it announces).

        Returns after every consumer took every chunk and this side's copies finished.
        """
        control, export = self._ctl()
        consumers = range(export.num_consumers)
        nbuf = self.manifest.depth(self.manifest.chunks)
        # Chunks are numbered from the session's start: every consumer took the last one.
        g = control[PUBLISHED]
        if any(control[ack_word(c)] != g for c in consumers):
            raise WeightSyncError(
                f"{self.name}: IPC session out of step (published {g}, acknowledged "
                f"{[control[ack_word(c)] for c in consumers]}); run setup() again"
            )
        steps: list[tuple[Manifest, Sequence[torch.Tensor]]] = [(self.manifest, sources.tensors)]
        if self.manifest.agreed.delta:
            steps = delta_steps(sources, self.manifest, call.to(self.kind), self.device)
        checksums: list[int] = []
        for manifest, tensors in steps:
            dense = manifest is self.manifest and tensors is sources.tensors
            plans = self._pack_plans(sources) if dense else None
            for chunk in manifest.chunks:
                slot = g % nbuf
                self._await_acks(g - nbuf + 1, deadline, g + 1, f"release slot {slot} before chunk {chunk.index}")
                after = consumers if g >= nbuf else ()
                checksum = self._enqueue_pack(chunk.index, slot, tensors, call.verify, after, plans, manifest)
                if checksum is not None:
                    checksums.append(checksum)
                    control[checksum_word(export.num_consumers, slot)] = as_word(checksum)
                g += 1
                control[PUBLISHED] = g
        self._await_acks(g, deadline, 0, "finish the last chunk")
        self.streams.drain(deadline, f"{self.name}: packing timed out", own=True)
        self.sent_nbytes = sum(m.total_bytes for m, _ in steps)
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
            return [n for c, n in enumerate(export.consumer_names) if control[ack_word(c)] < need]

        def done() -> bool:
            return all(control[ack_word(c)] >= need for c in range(export.num_consumers))

        if need <= 0 or done():
            return

        def lagging_pid() -> int:
            names = late()
            return control[pid_word(export.consumer_names.index(names[0]))] if names else 0

        control[WAITING] = waiting
        control.wait(
            done,
            deadline,
            self.name,
            lambda: f"{', '.join(late()) or 'workers'} to {what}",
            [self.name, *export.consumer_names],
            peer_pid=lagging_pid,
            late=late,
        )
        control[WAITING] = 0

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
