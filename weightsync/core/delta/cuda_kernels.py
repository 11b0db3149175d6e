"""The GPU loops of a delta sync: compare-and-gather in one pass, and the scatter (CuPy).

torch's ops take several passes to find the changed elements of a tensor (a compare, a
``nonzero``, gathers from both sides, a scatter into the base). :func:`encode` reads each
64-bit word of the new bytes and of the base once: a word that differs is written into the
base at once, and its changed elements (index, new bits) go to the outputs, each thread
block reserving its run of slots with one atomic add. So the outputs come in blocks'
order, not in index order: a payload made here is always INDICES, whose positions may come
in any order (each index once); a block lists its tile's changes row by row (a row: one
word of each thread, adjacent words), so they come in index order within a row.
:func:`assemble` copies every INDICES payload of a sync out of those outputs in one
launch. :func:`scatter` writes a payload's
values into a tensor, and :func:`scatter_rows` those of many payloads in one launch,
counting indices outside it into a device counter (read once per sync, not per tensor).
The kernels' source: :mod:`weightsync.core.delta.cuda_source`.

For 2- and 4-byte elements (bf16, fp16, fp32, int16, int32), tensors of whole 64-bit words
at 8-byte aligned addresses with fewer than 2**31 elements; anything else goes through torch
ops (:mod:`weightsync.core.delta.device_diff`). Without CuPy (:func:`kernels` is None) too.
"""

from __future__ import annotations

import functools
import logging
import warnings
from typing import Any

import numpy as np
import torch

from weightsync.core.delta.cuda_source import PER, ROWS_PER_BLOCK, SOURCE, THREADS

log = logging.getLogger("weightsync")

_INT32 = 2**31 - 1


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
        self.scatter_rows_fn = module.get_function("weightsync_delta_scatter_rows")
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
        self,
        new: torch.Tensor,
        base: torch.Tensor,
        idx: torch.Tensor,
        val: torch.Tensor,
        counter: torch.Tensor,
        after: torch.Tensor,
        slot: int,
    ) -> None:
        """Launch the compare-and-gather of ``new`` against ``base`` (flat, same dtype, whole
        words): changed elements into ``idx``/``val`` (at most their length), their count
        added to ``counter`` (uint64 as int64, one element), ``base`` updated. ``after[slot]``
        (int64, zero before) takes the counter as this launch leaves it, or stays 0 when
        nothing changed: the kernel writes it, so a sync costs no copy per tensor."""
        assert 0 <= slot < after.numel() and after.dtype == torch.int64
        itemsize = new.element_size()
        nwords = new.numel() * itemsize // 8
        tiles = -(-nwords // (THREADS * PER))
        grid = (max(1, min(self.blocks, tiles)),)
        import cupy

        args = (
            cupy.uint64(new.data_ptr()), cupy.uint64(base.data_ptr()), cupy.int64(nwords), cupy.uint64(idx.data_ptr()),
            cupy.uint64(val.data_ptr()), cupy.int64(idx.numel()), cupy.uint64(counter.data_ptr()),
            cupy.uint64(after.data_ptr() + 8 * slot),
        )  # fmt: skip
        self._launch(self.encode_fn[itemsize], grid, args)

    def assemble(self, table: torch.Tensor, blocks: int) -> None:
        """Launch the copy of every row of ``table`` (uint64 words as int64 on this device,
        8 per row: see the kernel) from the encoder's outputs into its payload; row ``r``
        is worked on by the blocks from its word 6 on, :data:`~weightsync.core.delta.cuda_source.ROWS_PER_BLOCK` elements each."""
        self._rows(self.assemble_fn, table, blocks)

    def scatter_rows(self, table: torch.Tensor, blocks: int) -> None:
        """Launch the scatter of every row of ``table`` (as :meth:`assemble`'s; rows: see the
        kernel): each payload's values into its tensor, indices outside it counted into the
        row's counter."""
        self._rows(self.scatter_rows_fn, table, blocks)

    def _rows(self, kernel: Any, table: torch.Tensor, blocks: int) -> None:
        import cupy

        rows = table.numel() // 8
        if rows:
            self._launch(kernel, (blocks,), (cupy.uint64(table.data_ptr()), cupy.int32(rows)))

    def scatter(self, idx: torch.Tensor, val: torch.Tensor, dest: torch.Tensor, bad: int) -> None:
        """Launch ``dest[idx[j]] = val[j]`` (flat ``dest``), indices outside it counted into
        the uint64 at device address ``bad``."""
        import cupy

        count = idx.numel()
        if not count:
            return
        grid = (max(1, min(self.blocks, -(-count // THREADS))),)
        args = (
            cupy.uint64(idx.data_ptr()), cupy.uint64(val.data_ptr()), cupy.int64(count), cupy.uint64(dest.data_ptr()),
            cupy.int64(dest.numel()), cupy.uint64(bad),
        )  # fmt: skip
        self._launch(self.scatter_fn[dest.element_size()], grid, args)


def row_table(table: np.ndarray, device: torch.device) -> tuple[torch.Tensor, int]:
    """A row-table kernel's table (int64, 8 words a row, see the source) on ``device``, with
    each row's first block (word 6) numbered from the counts (word 2), and the blocks the
    launch needs: one per :data:`~weightsync.core.delta.cuda_source.ROWS_PER_BLOCK` elements
    of each row. Launched on the stream it was copied on, the table outlives its use."""
    blocks = -(-table[:, 2] // ROWS_PER_BLOCK)
    table[:, 6] = np.cumsum(blocks) - blocks
    return torch.from_numpy(table).to(device).view(-1), int(blocks.sum())


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
            module = cupy.RawModule(code=SOURCE, options=("-std=c++17",))
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
