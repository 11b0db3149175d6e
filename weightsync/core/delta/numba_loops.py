"""The CPU loops of a delta sync, compiled by numba (imported only through
:func:`weightsync.core.delta.cpu_kernels.kernels`, which falls back to torch ops where numba
does not import). See that module for why they exist.

Every loop is serial and releases the GIL: :class:`~weightsync.core.delta.cpu_kernels.Tasks`
runs ranges of the tensors on a few Python threads (numba's own parallel loops share the
cores badly with torch's OpenMP threads, which spin after each torch op). Arrays come as
unsigned integers of the element's size (the bit patterns); indices are int32 or int64.

The encoders read a range in blocks that stay in the first-level cache: the new bit
patterns of the block (for an fp32 source, cast to bf16 here), then the block compared with
the base as 64-bit words, a list of the words that differ made without a branch, and only
those words taken apart into their elements (index, new bits) and written into the base.
"""

# mypy: ignore-errors
from __future__ import annotations

import functools

import numba
import numpy as np

jit = functools.partial(numba.njit, nogil=True, cache=True, boundscheck=False, error_model="numpy")

#: Elements per block of the encoders (a multiple of 8, so blocks are whole words).
BLOCK = 4096


@jit
def cast_f32_bf16(src, dst):
    """``dst[i]`` = ``src[i]`` (fp32 bits) rounded to bf16 bits as torch's vectorized CPU cast
    rounds (to nearest, ties to even); every NaN becomes 0xFFFF, as there."""
    for i in range(src.shape[0]):
        u = src[i]
        r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        nan = np.uint32((u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000))
        dst[i] = np.uint16(r | (np.uint32(0) - nan))


@jit
def _changed_words(new, base, xs, wl):
    """``xs[w]`` = new ^ base per word; the positions of the nonzero ones into ``wl``; their count."""
    for w in range(new.shape[0]):
        xs[w] = new[w] ^ base[w]
    kk = 0
    for w in range(new.shape[0]):
        wl[kk] = w
        kk += xs[w] != 0
    return kk


@jit
def _expand(new, base, xs, wl, kk, lanes, first, idx, val, k):
    """The changed elements of the ``kk`` words listed in ``wl`` into ``idx``/``val`` from
    ``k`` (element ``first + w * lanes + lane``); those words written into ``base``."""
    bits = 64 // lanes
    mask = np.uint64(0xFFFFFFFFFFFFFFFF) >> np.uint64(64 - bits)
    for j in range(kk):
        w = wl[j]
        a = new[w]
        x = xs[w]
        base[w] = a
        p = first + w * lanes
        for lane in range(lanes):
            shift = np.uint64(lane * bits)
            idx[k] = p + lane
            val[k] = (a >> shift) & mask
            k += ((x >> shift) & mask) != 0
    return k


@jit
def _tail(new, base, start, first, idx, val, k):
    """Elements ``start:`` compared one by one (what is left past the last whole word)."""
    for i in range(start, new.shape[0]):
        if new[i] != base[i]:
            if k >= idx.shape[0]:
                return -1
            base[i] = new[i]
            idx[k] = first + i
            val[k] = new[i]
            k += 1
    return k


@jit
def encode_f32_bf16(src, base, first, idx, val, scratch, xs, wl):
    """``src`` (fp32 bits) cast to bf16 as :func:`cast_f32_bf16` and compared with ``base``
    (bf16 bits, updated): the changed elements' indices (``first`` + position) and new bits
    into ``idx``/``val``; returns their count. At more than ``idx``'s length it stops,
    casts the rest of ``src`` into ``base`` (which then holds all of it) and returns -1."""
    n = src.shape[0]
    cap = idx.shape[0]
    words = scratch.view(np.uint64)
    block = scratch.shape[0]
    k = 0
    lo = 0
    while lo + 4 <= n:
        m = min(block, (n - lo) // 4 * 4)
        cast_f32_bf16(src[lo : lo + m], scratch[:m])
        nw = m // 4
        held = base[lo : lo + m].view(np.uint64)
        kk = _changed_words(words[:nw], held, xs, wl)
        if k + 4 * kk > cap:
            cast_f32_bf16(src[lo:], base[lo:])
            return -1
        k = _expand(words[:nw], held, xs, wl, kk, 4, first + lo, idx, val, k)
        lo += m
    if lo < n:
        cast_f32_bf16(src[lo:], scratch[: n - lo])
        k = _tail(scratch[: n - lo], base[lo:], 0, first + lo, idx, val, k)
        if k < 0:
            cast_f32_bf16(src[lo:], base[lo:])
    return k


@jit
def encode_bits(new, base, first, idx, val, xs, wl):
    """Like :func:`encode_f32_bf16` for a source already of the wire dtype: ``new`` and
    ``base`` are the elements' bit patterns (uint8/16/32/64), compared 64-bit word by word.
    At more than ``idx``'s length: the rest of ``new`` copied into ``base``, returns -1."""
    n = new.shape[0]
    lanes = 8 // new.itemsize
    cap = idx.shape[0]
    block = xs.shape[0]
    whole = n // lanes
    fresh = new[: whole * lanes].view(np.uint64)
    held = base[: whole * lanes].view(np.uint64)
    k = 0
    for w0 in range(0, whole, block):
        nw = min(block, whole - w0)
        kk = _changed_words(fresh[w0 : w0 + nw], held[w0 : w0 + nw], xs, wl)
        if k + lanes * kk > cap:
            base[w0 * lanes :] = new[w0 * lanes :]
            return -1
        k = _expand(fresh[w0 : w0 + nw], held[w0 : w0 + nw], xs, wl, kk, lanes, first + w0 * lanes, idx, val, k)
    k = _tail(new, base, whole * lanes, first, idx, val, k)
    if k < 0:
        base[whole * lanes :] = new[whole * lanes :]
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


#: Trailing-zero count of a 64-bit power of two by a de Bruijn multiply.
_DEBRUIJN = np.uint64(0x03F79D71B4CB0A89)
_CTZ = np.zeros(64, np.int64)
for _bit in range(64):
    _CTZ[(((1 << _bit) * int(_DEBRUIJN)) & (2**64 - 1)) >> 58] = _bit


@jit
def scatter_masked(dest, mask, val):
    """``val``, in order, into the elements of ``dest`` whose bit is set in ``mask`` (bit
    ``i % 8`` of byte ``i // 8``: bit ``i % 64`` of little-endian word ``i // 64``). Returns
    how many bits were set (the caller refuses a mask whose count is not the values'
    count, or with bits past ``dest``: those are counted, never written)."""
    numel = dest.shape[0]
    nval = val.shape[0]
    whole = mask.shape[0] // 8
    words = mask[: whole * 8].view(np.uint64)
    k = 0
    for w in range(whole):
        m = words[w]
        while m != 0:
            low = m & (np.uint64(0) - m)
            i = w * 64 + _CTZ[(low * _DEBRUIJN) >> np.uint64(58)]
            if i < numel and k < nval:
                dest[i] = val[k]
            k += 1
            m ^= low
    for j in range(whole * 8, mask.shape[0]):
        m8 = np.int64(mask[j])
        for bit in range(8):
            if (m8 >> bit) & 1:
                i = j * 8 + bit
                if i < numel and k < nval:
                    dest[i] = val[k]
                k += 1
    return k


@jit
def set_bits(mask, idx):
    """Bit ``idx[j] % 8`` of byte ``idx[j] // 8`` set for every j."""
    for j in range(idx.shape[0]):
        i = idx[j]
        mask[i >> 3] |= np.uint8(1 << (i & 7))
