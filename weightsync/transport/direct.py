"""One-copy colocated transfer: the trainer writes straight into the worker's tensors.

At setup the worker moves its synced tensors into one region it exports (CUDA IPC on a
GPU; ``/dev/shm`` on a CPU), laid out at aligned offsets, and rebinds each tensor to its
view of the region; the trainer maps the region once. A sync is then one ``copy_`` per
tensor from the trainer's parameter into the mapped destination (casting to the wire dtype
on the way), with no packing buffer and no second copy.

Call order, per sync (the coordinator brackets the write)::

    export = target.refresh_if_stale()     # worker: None, or a fresh export
    writer.write(export_or_previous, sources)
    # worker commits its version

The worker must not read its weights between ``refresh_if_stale`` and the commit (an
inference engine pauses generation, as it does for any in-place weight update).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from weightsync.packing import align_up, typed_view
from weightsync.spec import Manifest, WeightSyncError
from weightsync.transport.cuda_ipc import CudaRegion
from weightsync.transport.ipc import Region, RegionHandle, RegionImporter
from weightsync.transport.shm import ShmRegion
from weightsync.transport.streams import SlotStreams

Rebind = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True)
class DirectExport:
    """A worker's exported destination region and where each tensor lives in it."""

    session: str
    worker: str
    region: RegionHandle
    offsets: tuple[int, ...]


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

    def __init__(self, manifest: Manifest, device: torch.device, name: str) -> None:
        self.manifest = manifest
        self.device = device
        self.name = name
        self._region: Region | None = None
        self._export: DirectExport | None = None
        self._pointers: tuple[int, ...] = ()
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
        for index, (spec, tensor, offset) in enumerate(zip(self.manifest.specs, tensors, offsets)):
            view = typed_view(region.tensor, offset, spec)
            view.copy_(tensor)
            rebind(index, view)
            pointers.append(view.data_ptr())
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        old, self._region = self._region, region
        if old is not None:
            old.close()
        self._pointers = tuple(pointers)
        self._export = DirectExport(session, self.name, region.handle(), offsets)
        self.exports_made += 1
        return self._export

    def stale(self, tensors: Sequence[torch.Tensor]) -> list[str]:
        """Names of tensors whose storage moved since the export (never write into those)."""
        return [
            spec.name
            for spec, tensor, pointer in zip(self.manifest.specs, tensors, self._pointers)
            if tensor.data_ptr() != pointer or tuple(tensor.shape) != spec.shape
        ]

    def seal(self) -> None:
        if self._region is not None:
            self._region.unlink()

    @property
    def current(self) -> DirectExport | None:
        return self._export

    def close(self) -> None:
        if self._region is not None:
            self._region.close()
        self._region = None
        self._export = None


class DirectWriter:
    """The trainer's side: maps each worker's region once and writes into it."""

    def __init__(self, manifest: Manifest, device: torch.device, timeout_s: float, name: str = "trainer") -> None:
        self.manifest = manifest
        self.device = device
        self.timeout_s = timeout_s
        self.name = name
        self.importers: dict[str, RegionImporter] = {}
        self._exports: dict[str, DirectExport] = {}
        self._regions: dict[str, torch.Tensor] = {}
        self._streams = SlotStreams(device, 1)

    def map(self, export: DirectExport) -> None:
        """Map a worker's export; a new export from the same worker releases the old mapping."""
        previous = self._exports.get(export.worker)
        if previous is not None and previous.session == export.session:
            return
        importer = self.importers.setdefault(export.worker, RegionImporter(f"{self.name}->{export.worker}"))
        importer.release_all()
        self._regions[export.worker] = importer.map(export.region)
        self._exports[export.worker] = export

    def write(self, worker: str, sources: Sequence[torch.Tensor]) -> int:
        """Copy every source into ``worker``'s region; visible to the worker on return."""
        export = self._exports.get(worker)
        region = self._regions.get(worker)
        if export is None or region is None:
            raise WeightSyncError(f"{self.name}: no direct export mapped for {worker}; run setup()")
        caller = self._streams.caller_stream()
        with self._streams.use(0):
            self._streams.wait_for(0, caller)
            for spec, source, offset in zip(self.manifest.specs, sources, export.offsets):
                if spec.nbytes:
                    typed_view(region, offset, spec).copy_(source)
        if self.device.type == "cuda":
            self._streams.drain(time.monotonic() + self.timeout_s, f"{self.name}: writing into {worker} timed out")
        return self.manifest.total_bytes

    def forget(self, worker: str) -> None:
        importer = self.importers.pop(worker, None)
        if importer is not None:
            importer.release_all()
        self._exports.pop(worker, None)
        self._regions.pop(worker, None)

    def close(self) -> None:
        for worker in list(self._exports):
            self.forget(worker)
