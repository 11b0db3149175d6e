"""The CUDA C++ source of a delta sync's GPU kernels, and the launch shapes it is built for.

Compiled by :mod:`weightsync.core.delta.cuda_kernels` (which says what each kernel is for
and launches them). Every kernel runs ``THREADS`` threads a block. The row-table kernels
(:func:`weightsync_delta_assemble`, :func:`weightsync_delta_scatter_rows`) read a table of
8 words a row, the row's first block in word 6 (ascending), and give each block
``ROWS_PER_BLOCK`` elements of one row: one launch serves every tensor of a sync.
"""

from __future__ import annotations

THREADS = 256
#: Words each thread of the encoder holds per tile (a block's tile: THREADS x PER words).
PER = 8
#: Changed elements each thread of a row-table kernel (the payload assembly, the batched
#: scatter) takes.
ROWS_PER_THREAD = 16
#: Changed elements each block of a row-table kernel takes.
ROWS_PER_BLOCK = THREADS * ROWS_PER_THREAD

SOURCE = (
    f"#define WS_T {THREADS}\n#define WS_PER {PER}\n#define WS_AP {ROWS_PER_THREAD}\n"
    + r"""

// A thread's count of changed elements in word i of its tile, for all i at once: field
// i & 3 (16 bits) of c[i >> 2]. A block's sum of one field is at most WS_T * 4 < 2**16, so
// scans of the packed words never carry from one field into the next.
#define WS_FIELD(c, i) (((c)[(i) >> 2] >> (16 * ((i) & 3))) & 0xFFFFull)

template <typename V, int LANES>
__device__ __forceinline__ void ws_encode(
    const unsigned long long* __restrict__ nw, unsigned long long* __restrict__ bw, long long nwords,
    int* __restrict__ idx, V* __restrict__ val, long long cap, unsigned long long* __restrict__ counter,
    unsigned long long* __restrict__ after)
{
    const int BITS = 64 / LANES;
    const unsigned long long MASK = (LANES == 4) ? 0xFFFFull : 0xFFFFFFFFull;
    const int PACKS = (WS_PER + 3) / 4;
    __shared__ unsigned long long warp_sum[PACKS][WS_T / 32];
    __shared__ unsigned long long row_base[WS_PER];
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
        unsigned long long c[PACKS];
#pragma unroll
        for (int p = 0; p < PACKS; ++p) c[p] = 0;
#pragma unroll
        for (int i = 0; i < WS_PER; ++i) {
            x[i] ^= a[i];
            if (x[i]) {
                bw[t0 + (long long)i * WS_T + threadIdx.x] = a[i];
                unsigned long long n = 0;
#pragma unroll
                for (int l = 0; l < LANES; ++l) n += ((x[i] >> (l * BITS)) & MASK) != 0;
                c[i >> 2] += n << (16 * (i & 3));
            }
        }
        // Slots go row by row (row i: word i of every thread's tile, WS_T adjacent words),
        // so the outputs list each row's changes in index order: a warp then writes them,
        // and a worker later scatters them, to neighbouring addresses.
        unsigned long long incl[PACKS];
#pragma unroll
        for (int p = 0; p < PACKS; ++p) {
            incl[p] = c[p];
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned long long y = __shfl_up_sync(0xffffffffu, incl[p], o);
                if (lane >= o) incl[p] += y;
            }
            if (lane == 31) warp_sum[p][warp] = incl[p];
        }
        __syncthreads();
        if (warp == 0) {
            unsigned long long tot[PACKS];
#pragma unroll
            for (int p = 0; p < PACKS; ++p) {
                const unsigned long long s = lane < WS_T / 32 ? warp_sum[p][lane] : 0ull;
                unsigned long long si = s;
#pragma unroll
                for (int o = 1; o < 32; o <<= 1) {
                    const unsigned long long y = __shfl_up_sync(0xffffffffu, si, o);
                    if (lane >= o) si += y;
                }
                if (lane < WS_T / 32) warp_sum[p][lane] = si - s;
                tot[p] = si;  // in lane 31: the block's totals, by field
            }
            if (lane == 31) {
                unsigned long long total = 0;
#pragma unroll
                for (int i = 0; i < WS_PER; ++i) {
                    row_base[i] = total;
                    total += WS_FIELD(tot, i);
                }
                const unsigned long long base = total ? atomicAdd(counter, total) : 0ull;
#pragma unroll
                for (int i = 0; i < WS_PER; ++i) row_base[i] += base;
                // The kernels of a sync run one after another, so the largest end any
                // block of this one reserved is the counter as this tensor left it.
                if (total) atomicMax(after, base + total);
            }
        }
        __syncthreads();
        unsigned long long before[PACKS];  // the block's changes before this thread's, by field
#pragma unroll
        for (int p = 0; p < PACKS; ++p) before[p] = warp_sum[p][warp] + incl[p] - c[p];
#pragma unroll
        for (int i = 0; i < WS_PER; ++i) {
            if (!x[i]) continue;
            unsigned long long slot = row_base[i] + WS_FIELD(before, i);
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

// One row's run of [begin, end): every load issued before the first store, so a block's
// elements are in flight at once (the sources start anywhere: no wider loads).
template <typename V>
__device__ __forceinline__ void ws_gather(
    const int* __restrict__ si, const V* __restrict__ sv, int* __restrict__ di, V* __restrict__ dv,
    long long begin, long long end)
{
    int a[WS_AP];
    V b[WS_AP];
#pragma unroll
    for (int k = 0; k < WS_AP; ++k) {
        const long long j = begin + (long long)k * WS_T + threadIdx.x;
        a[k] = 0; b[k] = 0;
        if (j < end) { a[k] = si[j]; b[k] = sv[j]; }
    }
#pragma unroll
    for (int k = 0; k < WS_AP; ++k) {
        const long long j = begin + (long long)k * WS_T + threadIdx.x;
        if (j < end) { di[j] = a[k]; dv[j] = b[k]; }
    }
}

// The row of a row-table kernel's block: the last row whose first block (word 6) is not
// past it.
__device__ __forceinline__ const unsigned long long* ws_row(const unsigned long long* __restrict__ table, int rows)
{
    const unsigned long long block = blockIdx.x;
    int lo = 0, hi = rows - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (table[8 * mid + 6] <= block) lo = mid; else hi = mid - 1;
    }
    return table + 8 * lo;
}

// One sync's INDICES payloads from the encoder's outputs, one launch for all of them.
// Rows: indices source, values source, count, payload address, values offset in the
// payload, value bytes (2 or 4), first block, unused.
extern "C" __global__ void __launch_bounds__(WS_T) weightsync_delta_assemble(
    const unsigned long long* __restrict__ table, int rows)
{
    const unsigned long long* row = ws_row(table, rows);
    const int* src_idx = reinterpret_cast<const int*>(row[0]);
    const long long count = (long long)row[2];
    unsigned char* payload = reinterpret_cast<unsigned char*>(row[3]);
    int* dst_idx = reinterpret_cast<int*>(payload);
    const long long begin = (long long)(blockIdx.x - row[6]) * WS_T * WS_AP;
    const long long end = begin + WS_T * WS_AP < count ? begin + WS_T * WS_AP : count;
    if (row[5] == 2) {
        ws_gather<unsigned short>(src_idx, reinterpret_cast<const unsigned short*>(row[1]), dst_idx,
                                  reinterpret_cast<unsigned short*>(payload + row[4]), begin, end);
    } else {
        ws_gather<unsigned int>(src_idx, reinterpret_cast<const unsigned int*>(row[1]), dst_idx,
                                reinterpret_cast<unsigned int*>(payload + row[4]), begin, end);
    }
}

// A run [begin, end) of one payload written into its tensor, loads first; indices outside
// the tensor are counted into *bad (one atomic add a thread), never written.
template <typename V>
__device__ __forceinline__ void ws_scatter_run(
    const int* __restrict__ idx, const V* __restrict__ val, V* __restrict__ dest, long long numel,
    unsigned long long* __restrict__ bad, long long begin, long long end)
{
    int a[WS_AP];
    V b[WS_AP];
#pragma unroll
    for (int k = 0; k < WS_AP; ++k) {
        const long long j = begin + (long long)k * WS_T + threadIdx.x;
        a[k] = -1; b[k] = 0;
        if (j < end) { a[k] = idx[j]; b[k] = val[j]; }
    }
    unsigned long long outside = 0;
#pragma unroll
    for (int k = 0; k < WS_AP; ++k) {
        const long long j = begin + (long long)k * WS_T + threadIdx.x;
        if (j >= end) continue;
        if (a[k] >= 0 && a[k] < numel) dest[a[k]] = b[k]; else ++outside;
    }
    if (outside) atomicAdd(bad, outside);
}

// Every INDICES payload of a batch written into its tensor, one launch for all of them.
// Rows: indices, values, count, destination, the destination's elements, value bytes (2 or
// 4), first block, the row's counter of indices outside.
extern "C" __global__ void __launch_bounds__(WS_T) weightsync_delta_scatter_rows(
    const unsigned long long* __restrict__ table, int rows)
{
    const unsigned long long* row = ws_row(table, rows);
    const long long count = (long long)row[2];
    const long long begin = (long long)(blockIdx.x - row[6]) * WS_T * WS_AP;
    const long long end = begin + WS_T * WS_AP < count ? begin + WS_T * WS_AP : count;
    const int* idx = reinterpret_cast<const int*>(row[0]);
    unsigned long long* bad = reinterpret_cast<unsigned long long*>(row[7]);
    if (row[5] == 2) {
        ws_scatter_run<unsigned short>(idx, reinterpret_cast<const unsigned short*>(row[1]),
                                       reinterpret_cast<unsigned short*>(row[3]), (long long)row[4], bad, begin, end);
    } else {
        ws_scatter_run<unsigned int>(idx, reinterpret_cast<const unsigned int*>(row[1]),
                                     reinterpret_cast<unsigned int*>(row[3]), (long long)row[4], bad, begin, end);
    }
}

extern "C" __global__ void __launch_bounds__(WS_T) weightsync_delta_encode16(
    const unsigned long long* nw, unsigned long long* bw, long long nwords, int* idx, unsigned short* val,
    long long cap, unsigned long long* counter, unsigned long long* after)
{ ws_encode<unsigned short, 4>(nw, bw, nwords, idx, val, cap, counter, after); }

extern "C" __global__ void __launch_bounds__(WS_T) weightsync_delta_encode32(
    const unsigned long long* nw, unsigned long long* bw, long long nwords, int* idx, unsigned int* val,
    long long cap, unsigned long long* counter, unsigned long long* after)
{ ws_encode<unsigned int, 2>(nw, bw, nwords, idx, val, cap, counter, after); }

extern "C" __global__ void weightsync_delta_scatter16(
    const int* idx, const unsigned short* val, long long count, unsigned short* dest, long long numel,
    unsigned long long* bad)
{ ws_scatter<unsigned short>(idx, val, count, dest, numel, bad); }

extern "C" __global__ void weightsync_delta_scatter32(
    const int* idx, const unsigned int* val, long long count, unsigned int* dest, long long numel,
    unsigned long long* bad)
{ ws_scatter<unsigned int>(idx, val, count, dest, numel, bad); }
"""
)
