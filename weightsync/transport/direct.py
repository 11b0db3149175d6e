"""One-copy colocated transfer: the trainer writes straight into the worker's tensors.

At setup the worker moves its synced tensors into one region it exports (CUDA IPC on a
GPU; ``/dev/shm`` on a CPU), laid out at aligned offsets, and rebinds each tensor to its
view of the region; the trainer maps the region once. A sync is then one copy of each
tensor from the trainer's parameter into its mapped destination, with no packing buffer
and no second copy: on a GPU one kernel launch over a table of all of them
(``batched_copy``), elsewhere (and for casts to the wire dtype) one ``copy_`` per tensor.

Each export carries a small control block, so a sync is one call per side, started
together, with no Ray round trip between them::

    worker                                   trainer
    target.announce(seq, tensors)            writer.write(worker, sources, seq)
      stale storage? -> "stale", return        plans the copies, waits for the announcement
      else "ready"                             "stale": writes nothing, returns False
    target.await_written(seq)                  "ready": copies, synchronizes, "written"
    commit the version

A worker whose tensors moved since its export (a new tensor object or data pointer) is
never written: the caller re-exports it and runs the sync again for that worker. The
worker must not read its weights between ``announce`` and its commit (an inference engine
pauses generation, as it does for any in-place weight update).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from weightsync.packing import align_up, typed_view
from weightsync.spec import Manifest, WeightSyncError
from weightsync.transport.batched_copy import BatchedCopier, CopyPlan, PlanKey, plan_key
from weightsync.transport.control import (
    FIRST_FREE_WORD,
    create_control,
    raise_abort,
    view_control,
    wait_until,
)
from weightsync.transport.cuda_ipc import CudaRegion
from weightsync.transport.ipc import Region, RegionHandle, RegionImporter
from weightsync.transport.shm import ShmHandle, ShmRegion
from weightsync.transport.streams import SlotStreams

Rebind = Callable[[int, torch.Tensor], None]

# Control words after magic and abort (abort codes: 1 = writer, 2 = target): the target's
# announcement (seq + 1 when ready, -(seq + 1) when stale), the writer's completion
# (seq + 1), then each side's pid.
_ANNOUNCED, _WRITTEN, _TARGET_PID, _WRITER_PID = range(FIRST_FREE_WORD, FIRST_FREE_WORD + 4)
_WORDS = FIRST_FREE_WORD + 4


@dataclass(frozen=True)
class DirectExport:
    """A worker's exported destination region, where each tensor lives in it, and the
    control block the two sides meet on."""

    session: str
    worker: str
    region: RegionHandle
    offsets: tuple[int, ...]
    control: ShmHandle


def layout(manifest: Manifest) -> tuple[tuple[int, ...], int]:
    """Aligned offsets of every spec in one region, and the region's size."""
    offsets = []
    cursor = 0
    for spec in manifest.specs:
        cursor = align_up(cursor, manifest.alignment)
        offsets.append(cursor)
        cursor += spec.nbytes
    return tuple(offsets), cursor


class DirectTarget:
    """The worker's side: owns the exported region its tensors now live in."""

    def __init__(self, manifest: Manifest, device: torch.device, name: str, timeout_s: float = 60.0) -> None:
        self.manifest = manifest
        self.device = device
        self.name = name
        self.timeout_s = timeout_s
        self._region: Region | None = None
        self._control: ShmRegion | None = None
        self._control_np: np.ndarray | None = None
        self._export: DirectExport | None = None
        self._layout: list[tuple[int, torch.Size]] = []  # (data pointer, shape) per tensor as exported
        self.exports_made = 0

    def export(self, tensors: Sequence[torch.Tensor], rebind: Rebind) -> DirectExport:
        """Move ``tensors`` (aligned with the manifest) into a fresh exported region.

        Each tensor's current values are copied in and ``rebind(i, view)`` points the
        worker's tensor at its view, so the worker keeps serving the same weights.
        """
        offsets, total = layout(self.manifest)
        session = uuid.uuid4().hex[:16]
        region: Region
        if self.device.type == "cuda":
            region = CudaRegion(total, self.device, session)
        else:
            region = ShmRegion(total, tag="direct")
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
        self._control, self._control_np = create_control(_WORDS, tag="dctl")
        self._control_np[_TARGET_PID] = os.getpid()
        self._layout = [(pointer, torch.Size(spec.shape)) for pointer, spec in zip(pointers, self.manifest.specs)]
        self._export = DirectExport(session, self.name, region.handle(), offsets, self._control.handle())
        self.exports_made += 1
        return self._export

    def stale(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        """Names of tensors whose storage moved since the export (never write into those)."""
        if len(tensors) != len(self._layout):
            return [spec.name for spec in self.manifest.specs]
        current = [(t.data_ptr(), t.size()) for t in tensors]
        if current == self._layout:
            return []
        return [spec.name for spec, now, then in zip(self.manifest.specs, current, self._layout) if now != then]

    def announce(self, seq: int, tensors: Sequence[torch.Tensor]) -> list[str]:
        """Tell the writer whether sync ``seq`` may write; returns the stale tensors' names
        (empty: ready). The caller must not read its weights until :meth:`await_written`."""
        control = self._ctl()
        try:
            moved = self.stale(tensors)
        except BaseException:
            raise_abort(control, 2)
            raise
        control[_ANNOUNCED] = -(seq + 1) if moved else seq + 1
        return moved

    def await_written(self, seq: int) -> None:
        """Wait, up to the deadline, for the writer to finish sync ``seq``."""
        control = self._ctl()
        try:
            wait_until(
                lambda: int(control[_WRITTEN]) == seq + 1,
                time.monotonic() + self.timeout_s * 1.25 + 1.0,
                control,
                self.name,
                lambda: "the trainer to finish writing",
                ["trainer", self.name],
                peer_pid=lambda: int(control[_WRITER_PID]),
            )
        except BaseException:
            raise_abort(control, 2)
            raise

    def abort(self) -> None:
        """Tell a waiting writer this side failed (it stops at once and names this worker)."""
        if self._control_np is not None:
            raise_abort(self._control_np, 2)

    def _ctl(self) -> np.ndarray:
        if self._control_np is None:
            raise WeightSyncError(f"{self.name}: no direct export; run setup()")
        return self._control_np

    def seal(self) -> None:
        """Once the writer mapped the export: unlink shared-memory names (nothing can leak)."""
        for region in (self._region, self._control):
            if region is not None:
                region.unlink()

    @property
    def current(self) -> DirectExport | None:
        return self._export

    def close(self) -> None:
        for region in (self._region, self._control):
            if region is not None:
                region.close()
        self._region = self._control = None
        self._control_np = None
        self._export = None


@dataclass
class _Mapped:
    export: DirectExport
    destinations: list[torch.Tensor | None]
    control: np.ndarray
    plan: CopyPlan | None = None  # the batched copies for the sources seen last


class DirectWriter:
    """The trainer's side: maps each worker's region once and writes into it."""

    def __init__(self, manifest: Manifest, device: torch.device, timeout_s: float, name: str = "trainer") -> None:
        self.manifest = manifest
        self.device = device
        self.timeout_s = timeout_s
        self.name = name
        self.importers: dict[str, RegionImporter] = {}
        self._mapped: dict[str, _Mapped] = {}
        self._streams = SlotStreams(device, 1)
        self._copier = BatchedCopier.create(device)

    def map(self, export: DirectExport) -> None:
        """Map a worker's export; a new export from the same worker releases the old mapping."""
        previous = self._mapped.get(export.worker)
        if previous is not None and previous.export.session == export.session:
            return
        self._mapped.pop(export.worker, None)
        importer = self.importers.setdefault(export.worker, RegionImporter(f"{self.name}->{export.worker}"))
        importer.release_all()
        region = importer.map(export.region)
        control = view_control(importer.map(export.control), self.name, export.control.path)
        control[_WRITER_PID] = os.getpid()
        # Views made once per mapping: a sync is then only the copies.
        destinations = [
            typed_view(region, offset, spec) if spec.nbytes else None
            for spec, offset in zip(self.manifest.specs, export.offsets)
        ]
        self._mapped[export.worker] = _Mapped(export, destinations, control)

    def write(self, worker: str, sources: Sequence[torch.Tensor], seq: int, key: PlanKey | None = None) -> bool:
        """Copy every source into ``worker``'s region for sync ``seq``, once the worker
        announced it is ready; visible to the worker on return. False (nothing written)
        when the worker announced that its tensors moved since its export.

        ``key`` is ``plan_key(sources)`` when the caller has it (the sender computes it
        while checking its tensors); the copy plan is rebuilt whenever it differs.
        """
        mapped = self._mapped.get(worker)
        if mapped is None:
            raise WeightSyncError(f"{self.name}: no direct export mapped for {worker}; run setup()")
        control = mapped.control
        deadline = time.monotonic() + self.timeout_s
        try:
            # Everything that does not depend on the worker runs before its announcement is
            # checked: the plan, and ordering the copy stream after the caller's work.
            copier = self._copier
            plan = mapped.plan
            if copier is not None:
                if key is None:
                    key = plan_key(sources)
                if plan is None or (plan.key is not key and plan.key != key):
                    plan = mapped.plan = copier.plan(mapped.destinations, sources, key)
            self._streams.wait_for(0, self._streams.caller_stream())
            wait_until(
                lambda: abs(int(control[_ANNOUNCED])) == seq + 1,
                deadline,
                control,
                self.name,
                lambda: f"{worker} to announce sync {seq} (is it busy in another call?)",
                [self.name, worker],
                peer_pid=lambda: int(control[_TARGET_PID]),
            )
            if int(control[_ANNOUNCED]) < 0:
                return False
            with torch.no_grad():  # sources may be parameters that require grad
                if copier is not None and plan is not None:
                    copier.run(plan, mapped.destinations, sources, self._streams.stream(0))
                else:
                    with self._streams.use(0):
                        for destination, source in zip(mapped.destinations, sources):
                            if destination is not None:
                                destination.copy_(source)
            self._streams.drain(deadline, f"{self.name}: writing into {worker} timed out")
            control[_WRITTEN] = seq + 1
        except BaseException:
            raise_abort(control, 1)
            raise
        return True

    def forget(self, worker: str) -> None:
        importer = self.importers.pop(worker, None)
        self._mapped.pop(worker, None)
        if importer is not None:
            importer.release_all()

    def close(self) -> None:
        for worker in list(self._mapped):
            self.forget(worker)
