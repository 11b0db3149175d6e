"""The direct transport's worker half: the exported region its tensors live in.

At setup :meth:`DirectTarget.export` moves the worker's tensors into one region (CUDA IPC
on a GPU, ``/dev/shm`` on a CPU) and rebinds each to its view; per sync
:meth:`DirectTarget.receive` announces "ready" (or "stale", when a tensor's storage moved
since the export), waits for every writer's completion and, with ``verify``, checks what
they wrote. The whole hand-off: :mod:`weightsync.transports.direct.halves`.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Callable, Sequence
from operator import attrgetter

import torch

from weightsync.core.halves import Landing, ReceiveHalf
from weightsync.core.packing import tensor_checksums, typed_view
from weightsync.core.wire.errors import ChecksumMismatch, ManifestError, PeerAborted, WeightSyncError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.session import Session
from weightsync.mechanisms.control import ControlBlock, worker_code
from weightsync.mechanisms.pace import Pace
from weightsync.mechanisms.regions import Region, make_region
from weightsync.mechanisms.shm import pid_alive
from weightsync.transports.direct.handoff import (
    ANNOUNCED,
    TARGET_PID,
    TornDown,
    first_checksum_word,
    writer_pid_word,
    written_word,
)
from weightsync.transports.direct.messages import DirectExport

Rebind = Callable[[int, torch.Tensor], None]
_data_ptr, _size, _dtype = torch.Tensor.data_ptr, torch.Tensor.size, attrgetter("dtype")


def _mismatches(manifest: Manifest, tensors: Sequence[torch.Tensor], who: str) -> None:
    if len(tensors) != len(manifest.specs):
        raise ManifestError(f"{who}: holds {len(tensors)} tensors, the manifest has {len(manifest.specs)}")
    problems = [p for spec, t in zip(manifest.specs, tensors) if (p := spec.mismatch(t)) is not None]
    if problems:
        raise ManifestError(
            f"{who}: tensors changed since setup and cannot be written without a cast or a broadcast "
            f"(nothing was written): {'; '.join(problems)}; restore them or run setup() again"
        )


class DirectTarget(TornDown, ReceiveHalf):
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
        # Each tensor as exported, one list per field (see :meth:`stale`).
        self._pointers: list[int] = []
        self._sizes: list[torch.Size] = []
        self._dtypes: list[torch.dtype] = []
        self.exports_made = 0
        #: How long the writers took from the announcement to "written" last time.
        self._pace = Pace()

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
            first_checksum_word(len(self.writers)) + len(self.manifest.specs), tag="dctl", parties=len(self._names)
        )
        self._control[TARGET_PID] = os.getpid()
        self._control.precise = self.device.type == "cuda"
        self._pointers = pointers
        self._sizes = [torch.Size(spec.shape) for spec in self.manifest.specs]
        self._dtypes = [spec.torch_dtype for spec in self.manifest.specs]
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
        # Three C loops (``map``) decide the usual answer: a sync's critical path runs through it.
        if (
            list(map(_data_ptr, tensors)) == self._pointers
            and list(map(_size, tensors)) == self._sizes
            and list(map(_dtype, tensors)) == self._dtypes
        ):
            return []
        current = [(t.data_ptr(), t.size(), t.dtype) for t in tensors]
        _mismatches(self.manifest, tensors, self.name)
        exported = zip(self._pointers, self._sizes, self._dtypes)
        return [spec.name for spec, now, then in zip(self.manifest.specs, current, exported) if now != then]

    def receive(self, sink: Landing, call: SyncCall, begin: Callable[[], None]) -> tuple[list[int], tuple[str, ...]]:
        """Announce, wait for the trainer's write, check it (with ``verify``)."""
        control = self._ctl()
        tensors = sink.direct_tensors(self.manifest)
        if tensors is None:
            raise WeightSyncError(f"{self.name}: its sink transforms tensors on load and cannot take direct writes")
        moved = self.stale(tensors)
        if moved:
            control[ANNOUNCED] = -(call.seq + 1)
            return [], tuple(moved)
        code = control.aborted_by
        if code:
            if self._torn_down:
                raise self._torn_down_error(call.seq, "was about to begin: nothing was written")
            # A writer gave up before this side got here (a late worker): nothing written.
            who = self._names[code - 1] if 0 < code <= len(self._names) else self.server
            raise PeerAborted(f"{self.name}: {who} already abandoned sync {call.seq}", blames=[who])
        begin()
        control[ANNOUNCED] = call.seq + 1
        self._await_writers(control, call.seq)
        if not call.verify:
            return [], ()
        mine = self._checked(control, tensors)
        # Several writers: each tensor was checked against the writer that wrote it; the
        # commit compares what this worker holds with the reference rank's, naming a rank
        # whose replica differs.
        return (mine if len(self.writers) == 1 else []), ()

    def _await_writers(self, control: ControlBlock, seq: int) -> None:
        """Until every writer marked sync ``seq`` written; names the late (or dead) ones."""
        done = seq + 1

        def pending() -> list[int]:
            return [i for i in range(len(self.writers)) if control[written_word(i)] != done]

        def late() -> list[str]:
            # The writers still missing; of those, only the dead ones once one has died.
            missing = pending()
            dead = [i for i in missing if (pid := control[writer_pid_word(i)]) and not pid_alive(pid)]
            return [self.writers[i] for i in dead or missing]

        turns = itertools.count()

        def watched() -> int:
            # Each look watches the next writer still missing: any of them may be the one that died.
            missing = pending()
            return control[writer_pid_word(missing[next(turns) % len(missing)])] if missing else 0

        start = time.monotonic()
        try:
            control.wait(
                lambda: not pending(),
                self.deadlines.follower(start),
                self.name,
                lambda: f"{', '.join(late()) or self.server} to finish writing",
                self._names,
                peer_pid=watched,
                late=late,
                spin=self._pace.window(start),
            )
            self._pace.record(start)
        except PeerAborted as exc:
            if self._torn_down:
                waited = f"waited for {', '.join(late()) or self.server} to finish writing"
                raise self._torn_down_error(seq, f"{waited} (its weights may be partly written)") from exc
            raise

    def _checked(self, control: ControlBlock, tensors: Sequence[torch.Tensor]) -> list[int]:
        """The checksums of what this worker holds, each equal to its writer's (else raises)."""
        mine = tensor_checksums(tensors)
        first = first_checksum_word(len(self.writers))
        for index, (spec, got) in enumerate(zip(self.manifest.specs, mine)):
            if got != control[first + index] & 0xFFFFFFFFFFFFFFFF:
                raise ChecksumMismatch(
                    f"{self.name}: tensor {spec.name} holds bytes whose checksum {got:#x} differs from what "
                    f"{' or '.join(self.writers)} wrote: the write went wrong"
                )
        return mine

    def start(self, call: SyncCall) -> None:
        if self._control is not None:
            self._control.epoch = call.seq + 1
        if self._torn_down:
            self.abort()  # the teardown's words carried the previous epoch (see TornDown)
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
