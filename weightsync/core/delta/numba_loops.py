"""The CPU loops of a delta sync, compiled by numba (imported only through
:func:`weightsync.core.delta.cpu_kernels.kernels`, which falls back to torch ops where numba
does not import). See that module for why they exist and what each does.

Every loop is serial and releases the GIL: the callers split large tensors into ranges
and run them on a few Python threads (numba's own parallel loops share the two cores
badly with torch's OpenMP threads, which spin after each torch op).
"""

# mypy: ignore-errors
from __future__ import annotations

import functools

import numba
import numpy as np

jit = functools.partial(numba.njit, nogil=True, cache=True, boundscheck=False)


@jit
def diff_words(new, base, lanes, lane_bits, first, idx, val):
    """Compare int64 words ``new`` with ``base``: the changed elements' indices (``first`` +
    element position) and bit patterns into ``idx``/``val``; ``base`` takes ``new``'s
    changed words. Returns the count, or -1 when ``idx`` is too short (``base`` is then
    partly updated: the caller copies the range anew)."""
    end = idx.shape[0]
    mask = np.int64(-1) if lane_bits == 64 else (np.int64(1) << lane_bits) - 1
    k = 0
    for w in range(new.shape[0]):
        a = new[w]
        x = a ^ base[w]
        if x != 0:
            base[w] = a
            if k + lanes > end:
                return -1
            for lane in range(lanes):
                shift = lane * lane_bits
                idx[k] = first + w * lanes + lane
                val[k] = (a >> shift) & mask
                k += ((x >> shift) & mask) != 0
    return k


@jit
def diff_f32_bf16(src, base, first, idx, val):
    """``src`` (fp32 bits as int32) rounded to bf16 as torch rounds it, compared with ``base``
    (bf16 bits as int16), which is left as it is (the caller writes the values into it);
    like :func:`diff_words`, and -2 on a NaN (torch's cast then decides its bit pattern)."""
    end = idx.shape[0]
    k = 0
    for i in range(src.shape[0]):
        u = np.int64(src[i]) & 0xFFFFFFFF
        if (u & 0x7FFFFFFF) > 0x7F800000:
            return -2
        b = np.int16(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF)
        if b != base[i]:
            if k >= end:
                return -1
            idx[k] = first + i
            val[k] = b
            k += 1
    return k


@jit
def scatter(dest, idx, val, offset):
    """``dest[idx[j] - offset] = val[j]`` for every j; returns how many indices fell outside
    ``dest`` (and were skipped)."""
    size = dest.shape[0]
    bad = 0
    for j in range(idx.shape[0]):
        i = np.int64(idx[j]) - offset
        if 0 <= i < size:
            dest[i] = val[j]
        else:
            bad += 1
    return bad


@jit
def popcount(mask):
    """The number of set bits in the uint8 array ``mask``."""
    c = 0
    for j in range(mask.shape[0]):
        x = np.int64(mask[j]) & 0xFF
        x = x - ((x >> 1) & 0x55)
        x = (x & 0x33) + ((x >> 2) & 0x33)
        c += (x + (x >> 4)) & 0x0F
    return c


@jit
def scatter_masked(dest, mask, val, start):
    """``val[start:]``, in order, into the elements of ``dest`` whose bit is set in ``mask``
    (bit ``i % 8`` of byte ``i // 8``, ``dest`` starting at byte 0 of ``mask``). Returns how
    many bits were set (the caller refuses a mask whose count is not the values' count, or
    with bits past ``dest``: those are counted, never written)."""
    numel = dest.shape[0]
    nval = val.shape[0]
    k = start
    for j in range(mask.shape[0]):
        m = np.int64(mask[j]) & 0xFF
        while m != 0:
            bit = 0
            while (m >> bit) & 1 == 0:
                bit += 1
            i = j * 8 + bit
            if i < numel and k < nval:
                dest[i] = val[k]
            k += 1
            m &= m - 1
    return k - start


@jit
def set_bits(mask, idx):
    for j in range(idx.shape[0]):
        i = idx[j]
        mask[i >> 3] |= np.uint8(1 << (i & 7))
