"""The direct transport's trainer half: each worker's region mapped once, written in one copy.

:meth:`DirectWriter.map` maps a worker's export (once per export); per sync
:meth:`DirectWriter.send` waits for each worker's announcement and copies every tensor
straight into its view (one batched kernel on a GPU, one ``copy_`` per tensor elsewhere),
then marks its part written. On streamed sources (a sharded rank's gathers) every worker
is written from one walk, which may be another half's (:class:`_StreamedWrite`, a rider).
The whole hand-off: :mod:`weightsync.transports.direct.halves`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, cast

import torch

from weightsync.core.halves import Rider, SendHalf, Sources
from weightsync.core.packing import read_checksums, typed_view, word_sum
from weightsync.core.wire.errors import PeerAborted, WeightSyncError
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.session import Session
from weightsync.mechanisms.batched_copy import BatchedCopier, CopyPlan, PlanKey, plan_key
from weightsync.mechanisms.control import ControlBlock
from weightsync.mechanisms.pace import Pace
from weightsync.mechanisms.regions import RegionImporter
from weightsync.mechanisms.streams import SlotStreams, wait_for_event
from weightsync.transports.direct.handoff import (
    ANNOUNCED,
    TARGET_PID,
    TornDown,
    first_checksum_word,
    writer_pid_word,
    written_word,
)
from weightsync.transports.direct.messages import DirectExport


@dataclass
class _Mapped:
    export: DirectExport
    destinations: list[torch.Tensor | None]
    control: ControlBlock
    plan: CopyPlan | None = None  # the batched copies for the sources seen last
    #: How long the copies into this worker took last time (when the next ones are due).
    pace: Pace = field(default_factory=Pace)


class DirectWriter(TornDown, SendHalf):
    """The trainer's side: maps each worker's region once and writes into it.

    ``writer`` of ``writers``: this party's place among the trainer parties that write into
    the same exports, each its own part (default: the only one, writing everything). A
    subclass says which part through :meth:`_parts` and :meth:`_sources`.
    """

    kind = "direct"
    #: True when the part written comes from the party's own tensors (``Sources.local``),
    #: so streamed sources are never walked.
    reads_local: ClassVar[bool] = False

    def __init__(self, session: Session, device: torch.device, writer: int = 0, writers: Sequence[str] = ()) -> None:
        self.session = session
        self.manifest = session.manifest
        self.device = device
        self.deadlines = session.deadlines
        self.name = session.party
        self.writers = tuple(writers) or (self.name,)
        if not 0 <= writer < len(self.writers) or self.writers[writer] != self.name:
            raise WeightSyncError(
                f"{self.name}: set up as writer {writer} of {list(self.writers)}, which is not this party"
            )
        self.writer = writer
        #: Called with each worker's name before this party writes into it, and with its
        #: name and each tensor's index before that tensor is copied tensor by tensor
        #: (progress hooks, fault injection in tests).
        self.on_write: Callable[[str], None] | None = None
        self.on_copy: Callable[[str, int], None] | None = None
        self.importers: dict[str, RegionImporter] = {}
        self._mapped: dict[str, _Mapped] = {}
        self._streams = SlotStreams(device, 1)
        self._copier = BatchedCopier.create(device)

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self._mapped)

    def map(self, export: DirectExport) -> None:
        """Map a worker's export; a new export from the same worker releases the old mapping."""
        previous = self._mapped.get(export.worker)
        if previous is not None and previous.export.session == export.session:
            return
        offsets, total = self.manifest.region_layout()
        if export.offsets != offsets or export.region.nbytes < total:
            raise WeightSyncError(
                f"{self.name}: {export.worker}'s direct export has {len(export.offsets)} offsets in "
                f"{export.region.nbytes} bytes, the manifest lays out {len(offsets)} in {total}: an export made "
                "for another manifest; run setup() again"
            )
        if export.writers != len(self.writers):
            raise WeightSyncError(
                f"{self.name}: {export.worker}'s direct export counts {export.writers} writer(s), this transport "
                f"has {len(self.writers)} ({', '.join(self.writers)}): run setup() again"
            )
        self._mapped.pop(export.worker, None)
        importer = self.importers.setdefault(export.worker, RegionImporter(f"{self.name}->{export.worker}"))
        importer.release_all()
        region = importer.map(export.region)
        control = ControlBlock.attach(importer.map(export.control), self.name, export.control.path)
        control[writer_pid_word(self.writer)] = os.getpid()
        control.precise = self.device.type == "cuda"
        # Views made once per mapping: a sync is then only the copies.
        whole = [
            typed_view(region, offset, spec) if spec.nbytes else None
            for spec, offset in zip(self.manifest.specs, export.offsets)
        ]
        self._mapped[export.worker] = _Mapped(export, self._parts(whole), control)

    def _parts(self, destinations: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Of a worker's tensors (None: no bytes), the views this party writes (None: none)."""
        return destinations

    def _sources(self, sources: Sources) -> tuple[Sequence[torch.Tensor], PlanKey]:
        """What this party copies into the views of :meth:`_parts`, and their plan key."""
        tensors = sources.tensors
        # The sender's key is plan_key(tensors) computed once for every half.
        return tensors, cast(PlanKey, sources.key) if sources.key is not None else plan_key(tensors)

    def send(self, sources: Sources, call: SyncCall, deadline: float) -> tuple[list[int], tuple[str, ...]]:
        """Write this sync's direct workers in turn (streamed sources: all of them in one pass);
        returns (checksums, workers found stale)."""
        if sources.streamed and not self.reads_local:
            return self._send_streamed(sources, call, deadline)
        checksums: list[int] = []
        if call.verify and sources.checksums is not None:
            checksums = sources.checksums  # computed once by the sender for every half
        elif call.verify:
            with torch.no_grad():
                # One cast at a time: streamed sources must not all be alive at once.
                checksums = read_checksums(
                    [word_sum(s.to(spec.torch_dtype)) for s, spec in zip(sources.tensors, self.manifest.specs)]
                )
        tensors, key = self._sources(sources)
        stale = tuple(w for w in call.to(self.kind) if not self.write(w, tensors, key, call.seq, deadline, checksums))
        # A worker compares its checksums with its writers' answers put together: the first
        # writer's are the whole model's, the others add none.
        return self._answer(checksums), stale

    def start(self, call: SyncCall) -> None:
        for mapped in self._mapped.values():
            mapped.control.epoch = call.seq + 1
        if self._torn_down:
            # Torn down before this sync's epoch was set: that abort was an earlier epoch's,
            # which this sync's workers ignore. Written again, it is theirs.
            self.abort()
            raise self._torn_down_error(call.seq, f"started: nothing was written into {', '.join(call.to(self.kind))}")

    def walks(self, targets: Sequence[str], verify: bool) -> int:
        """One pass over streamed sources, whatever the number of workers (see :meth:`_send_streamed`)."""
        return 1 if targets and not self.reads_local else 0

    def _send_streamed(self, sources: Sources, call: SyncCall, deadline: float) -> tuple[list[int], tuple[str, ...]]:
        """Streamed sources (a sharded rank's gathers) are read once: every worker announces
        first, then each tensor, as it is gathered, is copied into every worker (and, with
        ``verify`` when the sender has not summed them already, checksummed), so a rank
        serving N workers gathers the model once."""
        rider = self._streamed_write(sources, call, deadline)
        self._streams.wait_for(0, self._streams.caller_stream())
        with self._streams.use(0):
            for index, source in enumerate(sources.tensors):
                rider.take(index, source)
        return rider.finish()

    @property
    def rides(self) -> bool:
        return not self.reads_local

    def ride(self, sources: Sources, call: SyncCall, deadline: float) -> Rider | None:
        """On streamed sources another half walks: this sync's workers written from that walk."""
        if not sources.streamed or self.reads_local:
            return None
        return self._streamed_write(sources, call, deadline)

    def _streamed_write(self, sources: Sources, call: SyncCall, deadline: float) -> _StreamedWrite:
        ready: list[_Mapped] = []
        stale: list[str] = []
        for worker in call.to(self.kind):
            mapped = self._announced(worker, call.seq, deadline)
            if mapped is None:
                stale.append(worker)
            else:
                ready.append(mapped)
        return _StreamedWrite(self, ready, tuple(stale), call, deadline, sources.checksums if call.verify else None)

    def _announced(self, worker: str, seq: int, deadline: float) -> _Mapped | None:
        """``worker``'s mapping once it announced sync ``seq``; None when it announced that its
        tensors moved since its export (nothing may be written)."""
        mapped = self._mapped.get(worker)
        if mapped is None:
            raise WeightSyncError(f"{self.name}: no direct export mapped for {worker}; run setup()")
        control = mapped.control
        try:
            control.wait(
                lambda: abs(control[ANNOUNCED]) == seq + 1,
                deadline,
                self.name,
                lambda: f"{worker} to announce sync {seq} (is it busy in another call?)",
                [*self.writers, worker],
                peer_pid=lambda: control[TARGET_PID],
                late=lambda: [worker],
            )
        except PeerAborted as exc:
            if self._torn_down:
                raise self._torn_down_error(seq, f"waited for {worker} to announce it: nothing was written") from exc
            raise
        code = control.aborted_by
        if code:
            if self._torn_down:
                raise self._torn_down_error(seq, f"was about to write {worker}: nothing was written into it")
            # The worker (or another writer) gave up on this sync already: its tensors may be
            # serving again, so nothing more lands in them.
            names = [*self.writers, worker]
            who = names[code - 1] if 0 < code <= len(names) else worker
            raise PeerAborted(f"{self.name}: {who} abandoned sync {seq} before this side wrote", blames=[who])
        return None if control[ANNOUNCED] < 0 else mapped

    def _publish(self, control: ControlBlock, seq: int, checksums: Sequence[int]) -> None:
        """Mark this party's part written, after the checksums of the tensors it answers for
        (:meth:`_vouches`)."""
        first = first_checksum_word(len(self.writers))
        for index, checksum in enumerate(checksums):
            if self._vouches(index):
                control[first + index] = _signed(checksum)
        control[written_word(self.writer)] = seq + 1

    def _vouches(self, index: int) -> bool:
        """Whether this party gives tensor ``index``'s checksum (the one party writing it)."""
        return self.writer == 0

    def _answer(self, checksums: list[int]) -> list[int]:
        """The checksums :meth:`send` returns: the ones a worker's commit compares with."""
        return checksums if self.writer == 0 else []

    def write(
        self,
        worker: str,
        tensors: Sequence[torch.Tensor],
        key: PlanKey,
        seq: int,
        deadline: float,
        checksums: Sequence[int] = (),
    ) -> bool:
        """Copy ``tensors`` (this party's sources, :meth:`_sources`) into ``worker``'s region
        for sync ``seq``, once the worker announced it is ready; visible to the worker on
        return. False (nothing written) when the worker announced that its tensors moved
        since its export."""
        if self.on_write is not None:
            self.on_write(worker)
        mapped = self._mapped.get(worker)
        if mapped is None:
            raise WeightSyncError(f"{self.name}: no direct export mapped for {worker}; run setup()")
        # Everything that does not depend on the worker runs before its announcement is
        # checked: the plan, and ordering the copy stream after the caller's work.
        copier, plan = self._copier, mapped.plan
        if copier is not None and (plan is None or (plan.key is not key and plan.key != key)):
            plan = mapped.plan = copier.plan(mapped.destinations, tensors, key)
        self._streams.wait_for(0, self._streams.caller_stream())
        if self._announced(worker, seq, deadline) is None:
            return False
        with torch.no_grad():  # sources may be parameters that require grad
            if copier is not None and plan is not None:
                self._still_wanted(worker, mapped, 0, seq)  # one launch copies every tensor
                copier.run(plan, mapped.destinations, tensors, self._streams.stream(0))
            else:
                with self._streams.use(0):
                    for index, (destination, source) in enumerate(zip(mapped.destinations, tensors)):
                        if destination is not None:
                            self._still_wanted(worker, mapped, index, seq)
                            destination.copy_(source)
        launched = time.monotonic()
        on_timeout = f"{self.name}: writing into {worker} timed out"
        self._streams.drain(deadline, on_timeout, own=True, spin=mapped.pace.window(launched))
        mapped.pace.record(launched)
        self._publish(mapped.control, seq, checksums)
        return True

    def abandon(self, worker: str, seq: int) -> None:
        """Give up on ``worker`` in sync ``seq`` before writing anything into it (push mode:
        it could not be woken): its abort words say so, so a receive of that sync that
        starts late fails at once, before its first byte, and leaves the weights alone."""
        mapped = self._mapped.get(worker)
        if mapped is not None:
            mapped.control.epoch = seq + 1
            mapped.control.abort(self.writer + 1)

    def _still_wanted(self, worker: str, mapped: _Mapped, index: int, seq: int) -> None:
        """Before each tensor copied on its own: stop, writing nothing more, once anyone gave
        up on this sync (the worker's wait ran out: a writer frozen mid-copy and thawed
        after that must not go on writing into weights the worker may serve again)."""
        if self.on_copy is not None:
            self.on_copy(worker, index)
        code = mapped.control.aborted_by
        if code:
            names = [*self.writers, worker]
            who = names[code - 1] if 0 < code <= len(names) else worker
            raise PeerAborted(
                f"{self.name}: {who} gave up on sync {seq} while this side was writing {worker} (tensor {index} of "
                f"{len(mapped.destinations)}); nothing more was written",
                blames=[who],
            )

    def abort(self) -> None:
        for mapped in self._mapped.values():
            mapped.control.abort(self.writer + 1)

    def forget(self, worker: str) -> None:
        importer = self.importers.pop(worker, None)
        self._mapped.pop(worker, None)
        if importer is not None:
            importer.release_all()

    def close(self, abort: bool = False) -> None:
        if abort:
            self.abort()
        for worker in list(self._mapped):
            self.forget(worker)


class _StreamedWrite:
    """The workers of one sync written tensor by tensor as a walk of streamed sources
    reaches them (:class:`~weightsync.core.halves.Rider`): each copy is queued on
    the stream current at :meth:`take`, after the walk's own work on that tensor."""

    def __init__(
        self,
        writer: DirectWriter,
        ready: list[_Mapped],
        stale: tuple[str, ...],
        call: SyncCall,
        deadline: float,
        summed: list[int] | None,
    ) -> None:
        self.writer, self.ready, self.stale = writer, ready, stale
        self.call, self.deadline, self.summed = call, deadline, summed
        self._sums: list[torch.Tensor] = []
        self._events: dict[int, torch.cuda.Event] = {}  # per stream used: after its last copy

    def take(self, index: int, tensor: torch.Tensor) -> None:
        spec = self.writer.manifest.specs[index]
        with torch.no_grad():
            if self.call.verify and self.summed is None:
                self._sums.append(word_sum(tensor.to(spec.torch_dtype)))
            for mapped in self.ready:
                destination = mapped.destinations[index]
                if destination is not None:
                    self.writer._still_wanted(mapped.export.worker, mapped, index, self.call.seq)
                    destination.copy_(tensor)
        if tensor.is_cuda:
            stream = torch.cuda.current_stream(tensor.device)
            event = self._events.get(stream.cuda_stream)
            if event is None:
                event = self._events[stream.cuda_stream] = torch.cuda.Event()
            event.record(stream)

    def finish(self) -> tuple[list[int], tuple[str, ...]]:
        writer = self.writer
        for event in self._events.values():
            wait_for_event(
                event, self.deadline, f"{writer.name}: writing into {len(self.ready)} direct worker(s) timed out"
            )
        checksums = (self.summed if self.summed is not None else read_checksums(self._sums)) if self.call.verify else []
        for mapped in self.ready:
            writer._publish(mapped.control, self.call.seq, checksums)
        return writer._answer(checksums), self.stale


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value
