"""The CPU loops of a delta sync, compiled by numba when it is installed.

Finding the changed elements of a gigabyte is a compaction (which elements, in order),
and torch's CPU ops do it in several passes over the data, each at a fraction of memory
speed (``ne``, then ``nonzero``, then a gather; ``nonzero`` alone reads 0.8 ns an
element). These loops do it in one pass: 64-bit words are compared first (four bf16
elements at once), and only a word that differs is taken apart into its elements; the
base is updated in the same pass, and the trainer's fp32 -> bf16 cast is done in it too
(the same round-to-nearest-even torch computes; a NaN, which torch's own cast does not
turn into one bit pattern everywhere, sends the block back to torch's cast). A large
block is split in ranges run on a few threads at once (:func:`in_parts`), each writing its
own range of the outputs.

Without numba (:func:`kernels` returns None) the same results come from torch ops
(:mod:`weightsync.core.delta.diff`), slower. Compiling takes a second or two per dtype,
once per process (cached on disk where the package's folder is writable).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

_T = TypeVar("_T")
#: Elements below which a loop runs on the calling thread alone (a hand-off costs more).
PARALLEL_MIN = 1 << 17

log = logging.getLogger("weightsync")


@functools.cache
def kernels() -> Any:
    """The compiled loops (:mod:`weightsync.core.delta.numba_loops`), or None where numba
    does not import (torch ops then serve)."""
    try:
        from weightsync.core.delta import numba_loops
    except ImportError:
        log.info("weightsync: numba is not installed; delta syncs on CPU use torch ops (slower)")
        return None
    return numba_loops


def threads() -> int:
    """How many threads a large loop is split over: torch's (what the caller allows it)."""
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


@functools.cache
def _pool(count: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=count, thread_name_prefix="weightsync-delta")


def split(size: int) -> list[tuple[int, int]]:
    """The ranges :func:`in_parts` splits ``size`` elements into."""
    parts = threads() if size >= PARALLEL_MIN else 1
    return [(size * t // parts, size * (t + 1) // parts) for t in range(parts)]


def in_parts(size: int, run: Callable[[int, int], _T]) -> list[_T]:
    """``run(lo, hi)`` over ``size`` elements split in :func:`threads` ranges, at once on a
    small pool (the loops release the GIL); one range on this thread when ``size`` is small."""
    bounds = split(size)
    parts = len(bounds)
    if parts == 1:
        return [run(0, size)]
    futures = [_pool(parts).submit(run, lo, hi) for lo, hi in bounds[1:]]
    first = run(*bounds[0])
    return [first, *(f.result() for f in futures)]
