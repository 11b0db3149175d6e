"""Many device-to-device copies in one kernel launch (CUDA, through CuPy).

A direct sync copies every parameter (194 tensors for an 8B-shaped model) into the worker's
region. One ``copy_`` per tensor costs a launch each and, on the GPU, a ramp-up and a tail
per copy in which the memory system is not saturated: on the H200 test machine 194 copies
took 8.38 ms where one copy of the same bytes took 7.81 ms. One launch over a table of
(source, destination, length) entries streams all of it without those gaps.

The table is built once per set of source tensors (:class:`CopyPlan`) and kept on the
device; a sync whose sources are the same tensors (the same data pointers, shapes,
strides and dtypes) reuses it. Pairs the kernel cannot take (a cast to another dtype, a
non-contiguous source, a length or address not a multiple of 16 bytes) are copied with
``copy_`` instead, on the same stream.

Call order: ``plan = copier.plan(destinations, sources)`` (or reuse one whose ``key``
equals ``plan_key(sources)``), then ``copier.run(plan, destinations, sources, stream)``;
the copies are complete when ``stream`` is.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

log = logging.getLogger("weightsync")

_VECTOR = 16  # bytes per uint4 load/store
# Defaults: 512 threads per block, each block copying 16 KiB (1024 vectors, 2 per thread).
# Measured on the H100 for the 8B-shaped model's 194 tensors (16.6 GB, CUDA events, median
# of 8): 10.997 ms against 10.988 ms for one flat copy of the same bytes; 256 threads at
# 16 KiB took 11.170 ms, at 8 KiB 11.111 ms; 32 and 64 KiB per block were slower at either
# width. On the H200 256 threads at 16 KiB came within 0.5% of the flat copy. Run
# scripts/tune_batched_copy.py to measure the grid of settings on another GPU.
THREADS = 512
UNIT_VECTORS = 1024

_SOURCE = r"""
extern "C" __global__ void __launch_bounds__(WS_THREADS) weightsync_batched_copy(
    const unsigned long long* __restrict__ table, int count, unsigned long long unit_vectors)
{
    // table rows: source address, destination address, length in 16-byte vectors,
    // index of the first block that works on this row (ascending).
    const unsigned long long block = blockIdx.x;
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (table[4 * mid + 3] <= block) lo = mid; else hi = mid - 1;
    }
    const uint4* src = reinterpret_cast<const uint4*>(table[4 * lo]);
    uint4* dst = reinterpret_cast<uint4*>(table[4 * lo + 1]);
    const unsigned long long length = table[4 * lo + 2];
    const unsigned long long begin = (block - table[4 * lo + 3]) * unit_vectors;
    const unsigned long long end = begin + unit_vectors < length ? begin + unit_vectors : length;
    for (unsigned long long i = begin + threadIdx.x; i < end; i += blockDim.x) {
        dst[i] = src[i];
    }
}
"""


def _batchable(destination: torch.Tensor, source: torch.Tensor, nbytes: int) -> bool:
    return (
        nbytes > 0
        and source.dtype == destination.dtype
        and source.device == destination.device
        and source.is_contiguous()
        and destination.is_contiguous()
        and nbytes % _VECTOR == 0
        and source.data_ptr() % _VECTOR == 0
        and destination.data_ptr() % _VECTOR == 0
    )


def batched_rows(
    destinations: Sequence[torch.Tensor | None], sources: Sequence[torch.Tensor]
) -> tuple[list[tuple[int, int, int]], list[int]]:
    """The kernel's rows (source address, destination address, 16-byte vectors) for the
    pairs it can take, and the indices of the other pairs (None destinations are neither)."""
    rows: list[tuple[int, int, int]] = []
    leftovers: list[int] = []
    for index, (destination, source) in enumerate(zip(destinations, sources)):
        if destination is None:
            continue
        nbytes = destination.numel() * destination.element_size()
        if _batchable(destination, source, nbytes):
            rows.append((source.data_ptr(), destination.data_ptr(), nbytes // _VECTOR))
        else:
            leftovers.append(index)
    return rows, leftovers


PlanKey = list[tuple[int, torch.Size, tuple[int, ...], torch.dtype]]


def plan_key(sources: Sequence[torch.Tensor]) -> PlanKey:
    """What a plan depends on besides its destinations: each source's address, shape,
    strides and dtype. The sender recomputes it every sync (a source can be given new
    storage between syncs) and also checks shapes against the manifest with it, so one
    pass over the tensors serves both."""
    return [(s.data_ptr(), s.size(), s.stride(), s.dtype) for s in sources]


@dataclass
class CopyPlan:
    """The device table of the batched pairs, and the indices of the pairs left to ``copy_``."""

    key: PlanKey
    table: torch.Tensor | None
    table_view: Any  # the same memory as a CuPy array, made once
    rows: int
    blocks: int
    leftovers: list[int]
    unit_vectors: int  # 16-byte vectors per thread block, as the blocks were counted


class BatchedCopier:
    """Builds and runs copy plans on one CUDA device."""

    def __init__(self, device: torch.device, kernel: Any, threads: int, unit_vectors: int) -> None:
        self.device = device
        self._kernel = kernel
        self.threads = threads
        self.unit_vectors = unit_vectors
        self._streams: dict[int, Any] = {}  # torch stream pointer -> CuPy's view of it

    def _cupy_stream(self, stream: torch.cuda.Stream) -> Any:
        """CuPy's handle on one of torch's streams, made once per stream."""
        pointer = int(stream.cuda_stream)
        wrapped = self._streams.get(pointer)
        if wrapped is None:
            import cupy

            # CuPy 14 deprecates ExternalStream in favour of Stream.from_external, which
            # older CuPy lacks; ExternalStream works in both, and is made once per stream.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                wrapped = cupy.cuda.ExternalStream(pointer, self.device.index)
            self._streams[pointer] = wrapped
        return wrapped

    @classmethod
    def create(
        cls, device: torch.device, threads: int = THREADS, unit_vectors: int = UNIT_VECTORS
    ) -> BatchedCopier | None:
        """A copier for ``device``, or None (per-tensor copies) off CUDA or without CuPy.

        The kernel is compiled here, at setup, so no sync pays for it; a compiler that fails
        is reported in the log, and the caller copies tensor by tensor. ``threads`` per
        block and ``unit_vectors`` (16-byte vectors each block copies) are tuning knobs.
        """
        if not (threads % 32 == 0 and 32 <= threads <= 1024):
            raise ValueError(f"threads per block must be a multiple of 32 from 32 to 1024, got {threads}")
        if unit_vectors < 1:
            raise ValueError(f"unit_vectors (16-byte vectors per block) must be at least 1, got {unit_vectors}")
        if device.type != "cuda":
            return None
        try:
            import cupy
        except ImportError:
            log.info("weightsync: CuPy is not installed; colocated copies go tensor by tensor")
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            with cupy.cuda.Device(index):
                kernel = cupy.RawKernel(_SOURCE, "weightsync_batched_copy", options=(f"-DWS_THREADS={threads}",))
                kernel.compile()
        except Exception as exc:  # noqa: BLE001 - the per-tensor path still works; say why it is used
            log.warning("weightsync: batched copy kernel unavailable (%s); colocated copies go tensor by tensor", exc)
            return None
        return cls(torch.device("cuda", index), kernel, threads, unit_vectors)

    def plan(
        self,
        destinations: Sequence[torch.Tensor | None],
        sources: Sequence[torch.Tensor],
        key: PlanKey | None = None,
    ) -> CopyPlan:
        """The table for ``sources`` into ``destinations`` (None: nothing to copy there).

        The table holds addresses only: :meth:`run` must be given the same destinations and
        sources whose :func:`plan_key` equals ``plan.key`` (so those addresses are live).
        ``key``, when the caller already computed it, is ``plan_key(sources)``.
        """
        rows, leftovers = batched_rows(destinations, sources)
        table = table_view = None
        blocks = 0
        if rows:
            host = np.zeros((len(rows), 4), dtype=np.uint64)
            host[:, :3] = np.array(rows, dtype=np.uint64)
            unit = np.uint64(self.unit_vectors)
            per_row = (host[:, 2] + (unit - np.uint64(1))) // unit
            host[1:, 3] = np.cumsum(per_row)[:-1]
            blocks = int(per_row.sum())
            table = torch.from_numpy(host.view(np.int64).reshape(-1)).to(self.device)
            import cupy

            table_view = cupy.asarray(table)
        return CopyPlan(
            plan_key(sources) if key is None else key,
            table,
            table_view,
            len(rows),
            blocks,
            leftovers,
            self.unit_vectors,
        )

    def run(
        self,
        plan: CopyPlan,
        destinations: Sequence[torch.Tensor | None],
        sources: Sequence[torch.Tensor],
        stream: torch.cuda.Stream,
    ) -> None:
        """Queue every copy of ``plan`` on ``stream`` (see :meth:`plan` for what it needs)."""
        self.launch(plan, stream)
        if plan.leftovers:
            with torch.cuda.stream(stream):
                for index in plan.leftovers:
                    destinations[index].copy_(sources[index])  # type: ignore[union-attr]

    def launch(self, plan: CopyPlan, stream: torch.cuda.Stream | None) -> None:
        """Queue only the kernel's copies of ``plan`` on ``stream`` (its leftovers are the
        caller's to copy, on the same stream)."""
        if stream is None:
            raise ValueError("the batched copy kernel runs on a CUDA stream, got none")
        if plan.table_view is not None:
            import cupy

            with cupy.cuda.Device(self.device.index), self._cupy_stream(stream):
                self._kernel(
                    (plan.blocks,),
                    (self.threads,),
                    (plan.table_view, np.int32(plan.rows), np.uint64(plan.unit_vectors)),
                )
