"""The GPU loops of a delta sync: compare-and-gather in one pass, and the scatter (CuPy).

torch's ops take several passes to find the changed elements of a tensor (a compare, a
``nonzero``, gathers from both sides, a scatter into the base). :func:`encode` reads each
64-bit word of the new bytes and of the base once: a word that differs is written into the
base at once, and its changed elements (index, new bits) go to the outputs, each thread
block reserving its run of slots with one atomic add. So the outputs come in blocks'
order, not in index order: a payload made here is always INDICES, whose positions may come
in any order (each index once). :func:`assemble` copies every INDICES payload of a sync
out of those outputs in one launch. :func:`scatter` writes a payload's values into a tensor,
counting indices outside it into a device counter (read once per sync, not per tensor).

For 2- and 4-byte elements (bf16, fp16, fp32, int16, int32), tensors of whole 64-bit words
at 8-byte aligned addresses with fewer than 2**31 elements; anything else goes through torch
ops (:mod:`weightsync.core.delta.device_diff`). Without CuPy (:func:`kernels` is None) too.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import torch

log = logging.getLogger("weightsync")

THREADS = 256
#: Words each thread of the encoder holds per tile (a block's tile: THREADS x PER words).
PER = 8
_INT32 = 2**31 - 1
#: Changed elements each block of the payload assembly copies.
ASSEMBLE_PER_BLOCK = THREADS * 16

_SOURCE = r"""
#define WS_T 256
#define WS_PER 8

template <typename V, int LANES>
__device__ __forceinline__ void ws_encode(
    const unsigned long long* __restrict__ nw, unsigned long long* __restrict__ bw, long long nwords,
    int* __restrict__ idx, V* __restrict__ val, long long cap, unsigned long long* __restrict__ counter)
{
    const int BITS = 64 / LANES;
    const unsigned long long MASK = (LANES == 4) ? 0xFFFFull : 0xFFFFFFFFull;
    __shared__ int warp_base[WS_T / 32];
    __shared__ unsigned long long block_base;
    const long long tile = (long long)WS_T * WS_PER;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (long long t0 = (long long)blockIdx.x * tile; t0 < nwords; t0 += (long long)gridDim.x * tile) {
        unsigned long long a[WS_PER], x[WS_PER];
        // Every load of the tile is issued before the first store: the tile's words are
        // in flight at once, whatever the compiler proves about the stores' addresses.
#pragma unroll
        for (int i = 0; i < WS_PER; ++i) {
            const long long w = t0 + (long long)i * WS_T + threadIdx.x;
            a[i] = 0; x[i] = 0;
            if (w < nwords) { a[i] = nw[w]; x[i] = bw[w]; }
        }
        int n = 0;
#pragma unroll
        for (int i = 0; i < WS_PER; ++i) {
            x[i] ^= a[i];
            if (x[i]) {
                bw[t0 + (long long)i * WS_T + threadIdx.x] = a[i];
#pragma unroll
                for (int l = 0; l < LANES; ++l) n += ((x[i] >> (l * BITS)) & MASK) != 0;
            }
        }
        int incl = n;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        if (lane == 31) warp_base[warp] = incl;
        __syncthreads();
        if (warp == 0) {
            const int s = lane < WS_T / 32 ? warp_base[lane] : 0;
            int si = s;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, si, o);
                if (lane >= o) si += y;
            }
            if (lane < WS_T / 32) warp_base[lane] = si - s;
            if (lane == 31) block_base = si ? atomicAdd(counter, (unsigned long long)si) : 0ull;
        }
        __syncthreads();
        unsigned long long slot = block_base + (unsigned long long)(warp_base[warp] + incl - n);
        if (n) {
#pragma unroll
            for (int i = 0; i < WS_PER; ++i) {
                if (!x[i]) continue;
                const long long w = t0 + (long long)i * WS_T + threadIdx.x;
#pragma unroll
                for (int l = 0; l < LANES; ++l) {
                    if ((x[i] >> (l * BITS)) & MASK) {
                        if ((long long)slot < cap) {
                            idx[slot] = (int)(w * LANES + l);
                            val[slot] = (V)(a[i] >> (l * BITS));
                        }
                        ++slot;
                    }
                }
            }
        }
        __syncthreads();
    }
}

template <typename V>
__device__ __forceinline__ void ws_scatter(
    const int* __restrict__ idx, const V* __restrict__ val, long long count, V* __restrict__ dest,
    long long numel, unsigned long long* __restrict__ bad)
{
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < count;
         j += (long long)gridDim.x * blockDim.x) {
        const long long i = idx[j];
        if (i >= 0 && i < numel) dest[i] = val[j]; else atomicAdd(bad, 1ull);
    }
}

// One sync's INDICES payloads from the encoder's outputs, one launch for all of them.
// table rows (8 words): indices source, values source, count, payload address, values
// offset in the payload, value bytes (2 or 4), first block of the row (ascending), unused.
extern "C" __global__ void __launch_bounds__(WS_T) weightsync_delta_assemble(
    const unsigned long long* __restrict__ table, int rows, long long per_block)
{
    const unsigned long long block = blockIdx.x;
    int lo = 0, hi = rows - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (table[8 * mid + 6] <= block) lo = mid; else hi = mid - 1;
    }
    const unsigned long long* row = table + 8 * lo;
    const int* src_idx = reinterpret_cast<const int*>(row[0]);
    const long long count = (long long)row[2];
    unsigned char* payload = reinterpret_cast<unsigned char*>(row[3]);
    int* dst_idx = reinterpret_cast<int*>(payload);
    const long long begin = (long long)(block - row[6]) * per_block;
    const long long end = begin + per_block < count ? begin + per_block : count;
    if (row[5] == 2) {
        const unsigned short* src = reinterpret_cast<const unsigned short*>(row[1]);
        unsigned short* dst = reinterpret_cast<unsigned short*>(payload + row[4]);
        for (long long j = begin + threadIdx.x; j < end; j += WS_T) { dst_idx[j] = src_idx[j]; dst[j] = src[j]; }
    } else {
        const unsigned int* src = reinterpret_cast<const unsigned int*>(row[1]);
        unsigned int* dst = reinterpret_cast<unsigned int*>(payload + row[4]);
        for (long long j = begin + threadIdx.x; j < end; j += WS_T) { dst_idx[j] = src_idx[j]; dst[j] = src[j]; }
    }
}

extern "C" __global__ void __launch_bounds__(WS_T) weightsync_delta_encode16(
    const unsigned long long* nw, unsigned long long* bw, long long nwords, int* idx, unsigned short* val,
    long long cap, unsigned long long* counter)
{ ws_encode<unsigned short, 4>(nw, bw, nwords, idx, val, cap, counter); }

extern "C" __global__ void __launch_bounds__(WS_T) weightsync_delta_encode32(
    const unsigned long long* nw, unsigned long long* bw, long long nwords, int* idx, unsigned int* val,
    long long cap, unsigned long long* counter)
{ ws_encode<unsigned int, 2>(nw, bw, nwords, idx, val, cap, counter); }

extern "C" __global__ void weightsync_delta_scatter16(
    const int* idx, const unsigned short* val, long long count, unsigned short* dest, long long numel,
    unsigned long long* bad)
{ ws_scatter<unsigned short>(idx, val, count, dest, numel, bad); }

extern "C" __global__ void weightsync_delta_scatter32(
    const int* idx, const unsigned int* val, long long count, unsigned int* dest, long long numel,
    unsigned long long* bad)
{ ws_scatter<unsigned int>(idx, val, count, dest, numel, bad); }
"""


class Kernels:
    """The compiled kernels of one device, and CuPy's views of torch's streams."""

    def __init__(self, module: Any, device: torch.device) -> None:
        self.device = device
        self.encode_fn = {
            2: module.get_function("weightsync_delta_encode16"),
            4: module.get_function("weightsync_delta_encode32"),
        }
        self.scatter_fn = {
            2: module.get_function("weightsync_delta_scatter16"),
            4: module.get_function("weightsync_delta_scatter32"),
        }
        self.assemble_fn = module.get_function("weightsync_delta_assemble")
        props = torch.cuda.get_device_properties(device)
        self.blocks = props.multi_processor_count * 8
        self._streams: dict[int, Any] = {}  # torch stream pointer -> CuPy's view of it

    def _launch(self, kernel: Any, grid: tuple[int], args: tuple[Any, ...]) -> None:
        """``kernel`` on torch's current stream of this device (CuPy's view of it made once)."""
        import cupy

        pointer = int(torch.cuda.current_stream(self.device).cuda_stream)
        stream = self._streams.get(pointer)
        if stream is None:
            with warnings.catch_warnings():  # ExternalStream: in every CuPy this project takes
                warnings.simplefilter("ignore", DeprecationWarning)
                stream = self._streams[pointer] = cupy.cuda.ExternalStream(pointer, self.device.index)
        with cupy.cuda.Device(self.device.index), stream:
            kernel(grid, (THREADS,), args)

    def encode(
        self, new: torch.Tensor, base: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, counter: torch.Tensor
    ) -> None:
        """Launch the compare-and-gather of ``new`` against ``base`` (flat, same dtype, whole
        words): changed elements into ``idx``/``val`` (at most their length), their count
        added to ``counter`` (uint64 as int64, one element), ``base`` updated."""
        itemsize = new.element_size()
        nwords = new.numel() * itemsize // 8
        tiles = -(-nwords // (THREADS * PER))
        grid = (max(1, min(self.blocks, tiles)),)
        import cupy

        args = (
            cupy.uint64(new.data_ptr()), cupy.uint64(base.data_ptr()), cupy.int64(nwords), cupy.uint64(idx.data_ptr()),
            cupy.uint64(val.data_ptr()), cupy.int64(idx.numel()), cupy.uint64(counter.data_ptr()),
        )  # fmt: skip
        self._launch(self.encode_fn[itemsize], grid, args)

    def assemble(self, table: torch.Tensor, blocks: int) -> None:
        """Launch the copy of every row of ``table`` (uint64 words as int64 on this device,
        8 per row: see the kernel) from the encoder's outputs into its payload; row ``r``
        is worked on by the blocks from its word 6 on, :data:`ASSEMBLE_PER_BLOCK` elements each."""
        import cupy

        rows = table.numel() // 8
        if rows:
            args = (cupy.uint64(table.data_ptr()), cupy.int32(rows), cupy.int64(ASSEMBLE_PER_BLOCK))
            self._launch(self.assemble_fn, (blocks,), args)

    def scatter(self, idx: torch.Tensor, val: torch.Tensor, dest: torch.Tensor, bad: torch.Tensor) -> None:
        """Launch ``dest[idx[j]] = val[j]`` (flat ``dest``), indices outside it counted into ``bad``."""
        import cupy

        count = idx.numel()
        if not count:
            return
        grid = (max(1, min(self.blocks, -(-count // THREADS))),)
        args = (
            cupy.uint64(idx.data_ptr()), cupy.uint64(val.data_ptr()), cupy.int64(count), cupy.uint64(dest.data_ptr()),
            cupy.int64(dest.numel()), cupy.uint64(bad.data_ptr()),
        )  # fmt: skip
        self._launch(self.scatter_fn[dest.element_size()], grid, args)


@functools.cache
def kernels(device: torch.device) -> Kernels | None:
    """The kernels for ``device`` (compiled once per process), or None: not CUDA, no CuPy,
    or a compiler that failed (logged; torch ops then serve)."""
    if device.type != "cuda":
        return None
    try:
        import cupy
    except ImportError:
        log.info("weightsync: CuPy is not installed; delta syncs on the GPU use torch ops")
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        with cupy.cuda.Device(index):
            module = cupy.RawModule(code=_SOURCE, options=("-std=c++17",))
            found = Kernels(module, torch.device("cuda", index))
    except Exception as exc:  # noqa: BLE001 - torch ops still work; say why they are used
        log.warning("weightsync: delta kernels unavailable (%s); delta syncs on the GPU use torch ops", exc)
        return None
    return found


def fits(tensor: torch.Tensor) -> bool:
    """Whether the kernels take ``tensor`` (see the module doc)."""
    size = tensor.element_size()
    return (
        size in (2, 4)
        and tensor.is_contiguous()
        and tensor.data_ptr() % 8 == 0
        and (tensor.numel() * size) % 8 == 0
        and tensor.numel() <= _INT32
    )
