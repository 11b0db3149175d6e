"""One-copy colocated transfer: the trainer writes straight into the worker's tensors.

At setup the worker moves its synced tensors into one region it exports (CUDA IPC on a
GPU; ``/dev/shm`` on a CPU), laid out at aligned offsets, and rebinds each tensor to its
view of the region; the trainer maps the region once. A sync is then one copy of each
tensor from the trainer's parameter into its mapped destination, with no packing buffer
and no second copy: on a GPU one kernel launch over a table of all of them
(``batched_copy``), elsewhere (and for casts to the wire dtype) one ``copy_`` per tensor.

Each export carries a small control block, so a sync is one call per side, started
together, with no Ray round trip between them::

    worker (DirectTarget.receive)            trainer (DirectWriter.send, per worker)
      a tensor's dtype or shape left the       plans the copies, waits for the announcement
        manifest? -> fail, naming it           "stale": writes nothing, names the worker
      storage moved? -> announce "stale"       "ready": copies, synchronizes, (checksums
      else announce "ready"                       with verify), "written"
      wait for "written" (check checksums)
    the receiver commits the version

A worker whose tensors moved since its export (a new tensor object or data pointer) is
never written: the coordinator re-exports it and runs the sync again for that worker. A
tensor whose dtype or shape changed is never written at all: the sync fails naming it.
The worker must not read its weights between its announcement and its commit (an
inference engine pauses generation, as it does for any in-place weight update).
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, cast

import torch

from weightsync.core.halves import Landing, ReceiveHalf, Rider, SendHalf, Sources
from weightsync.core.packing import read_checksums, tensor_checksums, typed_view, word_sum
from weightsync.core.wire.errors import ChecksumMismatch, ManifestError, PeerAborted, SessionTornDown, WeightSyncError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.session import Session
from weightsync.mechanisms.batched_copy import BatchedCopier, CopyPlan, PlanKey, plan_key
from weightsync.mechanisms.control import ControlBlock, worker_code
from weightsync.mechanisms.regions import Region, RegionImporter, make_region
from weightsync.mechanisms.shm import pid_alive
from weightsync.mechanisms.streams import SlotStreams, wait_for_event
from weightsync.transports.direct.messages import DirectExport

Rebind = Callable[[int, torch.Tensor], None]

# Control words: the target's announcement (seq + 1 when ready, -(seq + 1) when stale) and
# pid, then per writer its completion (seq + 1) and pid, then one checksum per tensor
# (verify). Abort codes: writer w is w + 1 (one writer: TRAINER), the target the next one.
_ANNOUNCED, _TARGET_PID = 0, 1


def _written(writer: int) -> int:
    return 2 + 2 * writer


def _writer_pid(writer: int) -> int:
    return 3 + 2 * writer


def _first_checksum(writers: int) -> int:
    return 2 + 2 * writers


def _mismatches(manifest: Manifest, tensors: Sequence[torch.Tensor], who: str) -> None:
    if len(tensors) != len(manifest.specs):
        raise ManifestError(f"{who}: holds {len(tensors)} tensors, the manifest has {len(manifest.specs)}")
    problems = [p for spec, t in zip(manifest.specs, tensors) if (p := spec.mismatch(t)) is not None]
    if problems:
        raise ManifestError(
            f"{who}: tensors changed since setup and cannot be written without a cast or a broadcast "
            f"(nothing was written): {'; '.join(problems)}; restore them or run setup() again"
        )


class _TornDown:
    """A direct half's record of a teardown (:meth:`SendHalf.tear_down`), shared by both sides.

    The flag is set before the abort words are written: a sync whose ``start()`` has not
    seen it set its epoch first, so those words carry that epoch and end its waits (and its
    peer's); a ``start()`` that sees it writes them again and fails the sync at once.
    """

    name: str
    _torn_down = ""  # who tore the session down; "" while it is open
    _whose = "the session"
    abort: Callable[[], None]

    def tear_down(self, by: str) -> None:
        self._torn_down = by
        self.abort()

    def _torn_down_error(self, seq: int, when: str) -> SessionTornDown:
        return SessionTornDown(
            f"{self.name}: {self._whose} was torn down ({self._torn_down}) when sync {seq} {when}; "
            "run WeightSync.setup() from the driver before the next sync"
        )


class DirectTarget(_TornDown, ReceiveHalf):
    """The worker's side: owns the exported region its tensors now live in.

    ``writers``: the trainer parties that write into it, each its own part, in the order
    their completions are counted (default: the party serving this worker, alone); the
    worker's receive returns once every one of them wrote.
    """

    _whose = "this worker's session"

    kind = "direct"
    knows_sender_finished = True

    def __init__(self, session: Session, device: torch.device, writers: Sequence[str] = ()) -> None:
        self.session = session
        self.manifest = session.manifest
        self.device = device
        self.name = session.party
        self.server = session.server
        self.writers = tuple(writers) or (session.server,)
        #: Who an abort code names: the writers in order, then this worker.
        self._names = [*self.writers, self.name]
        self._code = worker_code(len(self.writers) - 1)
        self.deadlines = session.deadlines
        self._region: Region | None = None
        self._control: ControlBlock | None = None
        self._export: DirectExport | None = None
        self._layout: list[tuple[int, torch.Size, torch.dtype]] = []  # per tensor as exported
        self.exports_made = 0

    def export(self, tensors: Sequence[torch.Tensor], rebind: Rebind) -> DirectExport:
        """Move ``tensors`` (aligned with the manifest) into a fresh exported region.

        Each tensor's current values are copied in and ``rebind(i, view)`` points the
        worker's tensor at its view, so the worker keeps serving the same weights.
        """
        _mismatches(self.manifest, tensors, self.name)
        offsets, total = self.manifest.region_layout()
        region = make_region(total, self.device, tag="direct")
        pointers = []
        with torch.no_grad():
            for index, (spec, tensor, offset) in enumerate(zip(self.manifest.specs, tensors, offsets)):
                view = typed_view(region.tensor, offset, spec)
                view.copy_(tensor)
                rebind(index, view)
                pointers.append(view.data_ptr())
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.close()
        self._region = region
        self._control = ControlBlock.create(
            _first_checksum(len(self.writers)) + len(self.manifest.specs), tag="dctl", parties=len(self._names)
        )
        self._control[_TARGET_PID] = os.getpid()
        self._control.precise = self.device.type == "cuda"
        self._layout = [
            (pointer, torch.Size(spec.shape), spec.torch_dtype) for pointer, spec in zip(pointers, self.manifest.specs)
        ]
        self._export = DirectExport(
            session=uuid.uuid4().hex[:16],
            worker=self.name,
            region=region.handle(),
            offsets=offsets,
            control=self._control.handle(),
            writers=len(self.writers),
        )
        self.exports_made += 1
        return self._export

    def stale(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        """Names of tensors whose storage moved since the export (never write into those).

        Refuses, naming them, tensors whose dtype or shape left the manifest: those are not
        stale but wrong, and no re-export may paper over them with a cast.
        """
        current = [(t.data_ptr(), t.size(), t.dtype) for t in tensors]
        if current == self._layout:
            return []
        _mismatches(self.manifest, tensors, self.name)
        return [spec.name for spec, now, then in zip(self.manifest.specs, current, self._layout) if now != then]

    def receive(self, sink: Landing, call: SyncCall, begin: Callable[[], None]) -> tuple[list[int], tuple[str, ...]]:
        """Announce, wait for the trainer's write, check it (with ``verify``)."""
        control = self._ctl()
        tensors = sink.direct_tensors(self.manifest)
        if tensors is None:
            raise WeightSyncError(f"{self.name}: its sink transforms tensors on load and cannot take direct writes")
        moved = self.stale(tensors)
        if moved:
            control[_ANNOUNCED] = -(call.seq + 1)
            return [], tuple(moved)
        code = control.aborted_by
        if code:
            if self._torn_down:
                raise self._torn_down_error(call.seq, "was about to begin: nothing was written")
            # A writer gave up before this side got here (a late worker): nothing written.
            who = self._names[code - 1] if 0 < code <= len(self._names) else self.server
            raise PeerAborted(f"{self.name}: {who} already abandoned sync {call.seq}", blames=[who])
        begin()
        control[_ANNOUNCED] = call.seq + 1
        done = call.seq + 1

        def pending() -> list[int]:
            return [i for i in range(len(self.writers)) if control[_written(i)] != done]

        def late() -> list[str]:
            # The writers still missing; of those, only the dead ones once one has died.
            missing = pending()
            dead = [i for i in missing if (pid := control[_writer_pid(i)]) and not pid_alive(pid)]
            return [self.writers[i] for i in dead or missing]

        turns = itertools.count()

        def watched() -> int:
            # Each look watches the next writer still missing: any of them may be the one that died.
            missing = pending()
            return control[_writer_pid(missing[next(turns) % len(missing)])] if missing else 0

        try:
            control.wait(
                lambda: not pending(),
                self.deadlines.follower(time.monotonic()),
                self.name,
                lambda: f"{', '.join(late()) or self.server} to finish writing",
                self._names,
                peer_pid=watched,
                late=late,
            )
        except PeerAborted as exc:
            if self._torn_down:
                waited = f"waited for {', '.join(late()) or self.server} to finish writing"
                raise self._torn_down_error(call.seq, f"{waited} (its weights may be partly written)") from exc
            raise
        if not call.verify:
            return [], ()
        mine = tensor_checksums(tensors)
        first = _first_checksum(len(self.writers))
        for index, (spec, got) in enumerate(zip(self.manifest.specs, mine)):
            if got != control[first + index] & 0xFFFFFFFFFFFFFFFF:
                raise ChecksumMismatch(
                    f"{self.name}: tensor {spec.name} holds bytes whose checksum {got:#x} differs from what "
                    f"{' or '.join(self.writers)} wrote: the write went wrong"
                )
        # Several writers: each tensor was checked against the writer that wrote it; the
        # commit compares what this worker holds with the reference rank's, naming a rank
        # whose replica differs.
        return (mine if len(self.writers) == 1 else []), ()

    def start(self, call: SyncCall) -> None:
        if self._control is not None:
            self._control.epoch = call.seq + 1
        if self._torn_down:
            self.abort()  # the teardown's words carried the previous epoch (see _TornDown)
            raise self._torn_down_error(call.seq, "started")

    def _ctl(self) -> ControlBlock:
        if self._control is None:
            raise WeightSyncError(f"{self.name}: no direct export; run setup()")
        return self._control

    def seal(self) -> None:
        """Once the writer mapped the export: unlink shared-memory names (nothing can leak)."""
        if self._region is not None:
            self._region.unlink()
        if self._control is not None:
            self._control.unlink()

    @property
    def current(self) -> DirectExport | None:
        return self._export

    def abort(self) -> None:
        if self._control is not None:
            self._control.abort(self._code)

    def close(self, abort: bool = False) -> None:
        if abort:
            self.abort()
        if self._region is not None:
            self._region.close()
        if self._control is not None:
            self._control.close()
        self._region = self._control = None
        self._export = None


@dataclass
class _Mapped:
    export: DirectExport
    destinations: list[torch.Tensor | None]
    control: ControlBlock
    plan: CopyPlan | None = None  # the batched copies for the sources seen last


class DirectWriter(_TornDown, SendHalf):
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
        control[_writer_pid(self.writer)] = os.getpid()
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
                lambda: abs(control[_ANNOUNCED]) == seq + 1,
                deadline,
                self.name,
                lambda: f"{worker} to announce sync {seq} (is it busy in another call?)",
                [*self.writers, worker],
                peer_pid=lambda: control[_TARGET_PID],
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
        return None if control[_ANNOUNCED] < 0 else mapped

    def _publish(self, control: ControlBlock, seq: int, checksums: Sequence[int]) -> None:
        """Mark this party's part written, after the checksums of the tensors it answers for
        (:meth:`_vouches`)."""
        first = _first_checksum(len(self.writers))
        for index, checksum in enumerate(checksums):
            if self._vouches(index):
                control[first + index] = _signed(checksum)
        control[_written(self.writer)] = seq + 1

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
                copier.run(plan, mapped.destinations, tensors, self._streams.stream(0))
            else:
                with self._streams.use(0):
                    for index, (destination, source) in enumerate(zip(mapped.destinations, tensors)):
                        if destination is not None:
                            self._still_wanted(worker, mapped, index, seq)
                            destination.copy_(source)
        self._streams.drain(deadline, f"{self.name}: writing into {worker} timed out", own=True)
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
