"""The GPU scatters of a worker's delta sync: one kernel launch per payload, or one for
many (:func:`batched_scatters`), and the check of their indices once per sync.

:func:`scatter_on_device` is :func:`~weightsync.core.delta.apply.apply_delta`'s GPU path
for an INDICES payload. Each scatter counts the indices it found outside its tensor into a
counter of its own (nothing is written there); :func:`check_scatters` reads them all with
one copy and names the tensors. Per sync of a worker::

    forget_scatters()                  # what a failed sync left unchecked
    with batched_scatters():           # per chunk of payloads, where nothing reads them early
        apply_delta(...) ...           # queued; launched a batch at a time
    check_scatters()                   # once every payload landed
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import torch

from weightsync.core.delta import cuda_kernels
from weightsync.core.delta.encoding import bits_of, index_dtype
from weightsync.core.wire.errors import ManifestError
from weightsync.core.wire.manifest import TensorSpec


class _Counters:
    """Zeroed int64 counters on each device, one handed to each GPU scatter of a sync (the
    indices it found outside its tensor), read and zeroed together by :func:`check_scatters`:
    a scatter then costs no allocation and no launch beyond its own, and a sync one read."""

    BLOCK = 1024

    def __init__(self) -> None:
        self.blocks: dict[torch.device, list[torch.Tensor]] = {}
        self.used: dict[torch.device, int] = {}
        #: Per scatter since the last check: tensor name, its elements, device, counter.
        self.pending: list[tuple[str, int, torch.device, int]] = []

    def take(self, name: str, numel: int, device: torch.device) -> int:
        """The device address of a zeroed counter for a scatter into tensor ``name``."""
        blocks = self.blocks.setdefault(device, [])
        n = self.used.get(device, 0)
        if n == len(blocks) * self.BLOCK:
            blocks.append(torch.zeros(self.BLOCK, dtype=torch.int64, device=device))
        self.used[device] = n + 1
        self.pending.append((name, numel, device, n))
        return blocks[n // self.BLOCK].data_ptr() + 8 * (n % self.BLOCK)

    def drain(self) -> list[tuple[str, int, int]]:
        """(name, elements, indices outside) of every scatter since the last drain; the
        counters are zeroed for the next sync."""
        read = {}
        for device, used in self.used.items():
            blocks = self.blocks[device][: -(-used // self.BLOCK)]
            read[device] = torch.cat(blocks).tolist()
        held = [(name, numel, read[device][n]) for name, numel, device, n in self.pending]
        self.forget()
        return held

    def forget(self) -> None:
        for device, used in self.used.items():
            for block in self.blocks[device][: -(-used // self.BLOCK)]:
                block.zero_()
        self.used.clear()
        self.pending.clear()


_counters = _Counters()


#: A batch launches what it holds once this many changed elements are queued, so the GPU
#: starts while the host queues the rest (a quarter of a millisecond of an H100's scatter).
FLUSH_ELEMENTS = 1 << 23


class ScatterBatch:
    """GPU scatters of INDICES payloads held back and launched together, one launch a device
    per :data:`FLUSH_ELEMENTS` changed elements and one at the end (see
    :func:`batched_scatters`): a sync of an 8B-shaped model patches about 200 tensors, and a
    launch costs the worker's host more than its kernel costs the GPU."""

    def __init__(self) -> None:
        #: Per device: table rows (see the kernel); every tensor they point into is kept
        #: alive until the launch (a destination freed before it would be written after).
        self.rows: dict[torch.device, list[tuple[int, ...]]] = {}
        self.held: list[torch.Tensor] = []
        self.queued = 0

    def add(self, name: str, numel: int, idx: torch.Tensor, values: torch.Tensor, dest: torch.Tensor) -> None:
        bad = _counters.take(name, numel, dest.device)
        row = (idx.data_ptr(), values.data_ptr(), idx.numel(), dest.data_ptr(), numel, dest.element_size(), bad)
        self.rows.setdefault(dest.device, []).append(row)
        self.held += (idx, values, dest)
        self.queued += idx.numel()
        if self.queued >= FLUSH_ELEMENTS:
            self.launch()

    def launch(self) -> None:
        for device, rows in self.rows.items():
            found = cuda_kernels.kernels(device)
            assert found is not None
            table = np.zeros((len(rows), 8), dtype=np.int64)
            table[:, [0, 1, 2, 3, 4, 5, 7]] = np.array(rows, dtype=np.int64)
            found.scatter_rows(*cuda_kernels.row_table(table, device))
        self.rows.clear()
        self.held.clear()
        self.queued = 0


_batch = threading.local()


@contextlib.contextmanager
def unbatched() -> Iterator[None]:
    """Scatters in this block launch at once, inside a :func:`batched_scatters` block too."""
    outer = getattr(_batch, "current", None)
    _batch.current = None
    try:
        yield
    finally:
        _batch.current = outer


@contextlib.contextmanager
def batched_scatters() -> Iterator[None]:
    """GPU scatters of :func:`apply_delta` calls in this block (this thread's) are launched
    together, not one by one: whenever :data:`FLUSH_ELEMENTS` changed elements are queued,
    and when the block ends. A tensor may take its new values only then, so a caller that
    reads a patched tensor inside the block must not use it. What is still queued when the
    block raises is not launched (the worker is dirty: its next sync is dense)::

        with batched_scatters():
            for ...: apply_delta(dest, spec, kind, count, payload)
        check_scatters()
    """
    outer = getattr(_batch, "current", None)
    batch = _batch.current = ScatterBatch()
    try:
        yield
    finally:
        _batch.current = outer
    batch.launch()


def scatter_on_device(dest: torch.Tensor, spec: TensorSpec, positions: torch.Tensor, values: torch.Tensor) -> bool:
    """The GPU kernel's scatter, when it takes ``dest`` (held back inside
    :func:`batched_scatters`); its check waits for :func:`check_scatters`."""
    found = cuda_kernels.kernels(dest.device)
    if found is None or not cuda_kernels.fits(dest) or index_dtype(spec.numel) != torch.int32:
        return False
    idx, target = positions.view(torch.int32), bits_of(dest.detach())
    batch: ScatterBatch | None = getattr(_batch, "current", None)
    if batch is not None:
        batch.add(spec.name, spec.numel, idx, values, target)
    elif idx.numel():
        found.scatter(idx, values, target, _counters.take(spec.name, spec.numel, dest.device))
    return True


def forget_scatters() -> None:
    """Drop what an earlier sync that failed midway left unchecked (its worker is dirty)."""
    _counters.forget()


def check_scatters() -> None:
    """Refuse, naming the tensors, payloads whose indices fell outside them (GPU scatters
    since the last call; nothing was written there). Called once a sync's payloads landed."""
    if not _counters.pending:
        return
    held = _counters.drain()
    bad = [f"{name!r} ({n} outside its {numel} elements)" for name, numel, n in held if n]
    if bad:
        raise ManifestError(f"delta payloads with indices outside their tensors: {', '.join(bad)}")
