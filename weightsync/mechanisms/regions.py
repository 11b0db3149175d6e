"""Exported memory regions, for both colocated transports: one factory, one importer.

A region is made once by the side that owns the memory (the trainer's IPC slots, a direct
worker's tensors) and mapped once by each peer: CUDA IPC on a GPU, a ``/dev/shm`` file on a
CPU. :class:`RegionImporter` is the only way a peer maps one, so "one export is mapped once
per consumer and released once" holds by construction and is counted.
"""

from __future__ import annotations

import uuid
from typing import Protocol

import torch

from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.messages import CudaIpcHandle, RegionHandle, ShmHandle
from weightsync.mechanisms.cuda_ipc import CudaRegion, map_cuda_ipc
from weightsync.mechanisms.shm import ShmRegion, map_shm


class Region(Protocol):
    """An exported allocation: its bytes, its handle, and its end."""

    tensor: torch.Tensor

    def handle(self) -> RegionHandle: ...

    def unlink(self) -> None: ...

    def close(self) -> None: ...


def make_region(nbytes: int, device: torch.device, tag: str) -> Region:
    """A region of ``nbytes`` on ``device``: CUDA IPC on a GPU, ``/dev/shm`` on a CPU."""
    if device.type == "cuda":
        return CudaRegion(nbytes, device, session=uuid.uuid4().hex[:16])
    return ShmRegion(nbytes, tag=tag)


def _map(handle: RegionHandle, who: str) -> torch.Tensor:
    if isinstance(handle, CudaIpcHandle):
        return map_cuda_ipc(handle, who)
    if isinstance(handle, ShmHandle):
        return map_shm(handle)
    raise WeightSyncError(f"{who}: not an export handle: {type(handle).__name__}")


class RegionImporter:
    """Maps each export once and releases it once.

    One importer is kept per peer for the whole session and reused across chunks and
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
            tensor = _map(handle, self.who)
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
