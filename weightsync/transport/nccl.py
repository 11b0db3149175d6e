"""An NCCL :class:`~weightsync.transport.broadcast.Communicator` through CuPy.

Works with cupy-cuda12x and cupy-cuda13x; CuPy finds libnccl from the ``nvidia-nccl-cu12``
/ ``-cu13`` pip package. Rank 0 makes the unique id (:func:`make_unique_id`) and the
coordinator passes it to every rank; all ranks then construct the communicator together.
Collectives run on the CUDA stream passed in (the engine's per-slot stream), so ordering
with packing and unpacking is by stream, and completion is awaited by polling the streams
with a deadline; on timeout or error the communicator is aborted, which releases every
rank still inside a collective.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from weightsync.transport.streams import wait_for_stream
from weightsync.wire.errors import WeightSyncError


def _nccl() -> Any:
    try:
        from cupy.cuda import nccl
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise WeightSyncError(
            f"the NCCL transport needs CuPy with NCCL: pip install 'weightsync[cuda12]' (or [cuda13]) ({exc})"
        ) from exc
    if not getattr(nccl, "available", True):
        raise WeightSyncError("CuPy is installed but cannot load NCCL; install nvidia-nccl-cu12 or -cu13")
    return nccl


def nccl_version() -> str | None:
    try:
        v = int(_nccl().get_version())
    except Exception:  # noqa: BLE001 - a probe for `doctor`; the reason is reported there
        return None
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"


def make_unique_id() -> bytes:
    """Rank 0's NCCL unique id, as the bytes every rank's communicator is created from."""
    return bytes(b & 0xFF for b in _nccl().get_unique_id())


class _StreamOrdered:
    """NCCL work is ordered on its stream; the engine drains streams with a deadline."""

    def wait(self, deadline: float) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError("NCCL transfer past its deadline")


class NcclCommunicator:
    """One rank of an NCCL group on ``device`` (blocks until every rank has joined)."""

    def __init__(self, unique_id: bytes, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
        import cupy

        nccl = _nccl()
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._timeout_s = timeout_s
        self._uint8 = nccl.NCCL_UINT8
        self._int32 = nccl.NCCL_INT32
        self._sum = nccl.NCCL_SUM
        with cupy.cuda.Device(device.index or 0):
            self._comm: Any = nccl.NcclCommunicator(world_size, unique_id, rank)

    def broadcast(self, tensor: torch.Tensor, src: int, stream_pointer: int) -> _StreamOrdered:
        if self._comm is None:
            raise WeightSyncError(f"rank {self.rank}: the NCCL communicator was closed or aborted")
        if stream_pointer == 0:
            stream_pointer = int(torch.cuda.current_stream(self.device).cuda_stream)
        ptr = tensor.data_ptr()
        self._comm.broadcast(ptr, ptr, tensor.numel(), self._uint8, src, stream_pointer)
        return _StreamOrdered()

    def agree(self, refuse: bool, deadline: float) -> list[int]:
        if self._comm is None:
            raise WeightSyncError(f"rank {self.rank}: the NCCL communicator was closed or aborted")
        flags = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        if refuse:
            flags[self.rank] = 1
        stream = torch.cuda.current_stream(self.device)
        self._comm.allReduce(
            flags.data_ptr(), flags.data_ptr(), self.world_size, self._int32, self._sum, int(stream.cuda_stream)
        )
        wait_for_stream(stream, deadline, f"rank {self.rank}: the NCCL agreement did not complete in time")
        return [rank for rank, flag in enumerate(flags.cpu().tolist()) if flag]

    def abort(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()
