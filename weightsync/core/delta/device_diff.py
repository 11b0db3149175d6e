"""The trainer's compare on a GPU (and with torch ops on a CPU without numba).

:class:`KernelDiff` runs :mod:`weightsync.core.delta.cuda_kernels`' one-pass compare on a
tensor the kernels take; every tensor of a sync is launched before any count is read
(:class:`DeviceArena`: one copy to the host per sync), then one more launch makes every
payload (:meth:`DeviceArena.finish`). Per sync::

    arena = DeviceArena(specs, device)
    diffs = [KernelDiff(spec, new, base, arena, slot), ...]   # launched, base updated
    outcomes = arena.finish(diffs, give_up)                   # [(kind, count, payload)]

:func:`diff_torch` compares one
tensor with its base with torch ops, as 64-bit words first (four bf16 elements a word; at
3% of the elements changed about 11% of the words differ), takes apart only the words that
differ, and writes them into the base. Elements of 8 bytes or more are compared one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from weightsync.core.delta import cuda_kernels
from weightsync.core.delta.encoding import PAYLOAD_ALIGN, Kind, best_kind, bits_of, index_dtype, layout
from weightsync.core.wire.manifest import TensorSpec

#: The GPU kernels' outputs of one sync hold the changes of at most this share of its
#: elements (an index and the new bits each: at bf16 6 bytes, so about a fifth of the
#: model's bytes); a tensor whose changes pass the room left goes dense.
ARENA_SHARE = 1 / 16


class DeviceArena:
    """One sync's outputs of the GPU kernels: every tensor's changes back to back (the
    kernels run one after the other on one stream, drawing on one counter), and the counter
    as each tensor left it (written by the kernels, read with one copy to the host, once)."""

    def __init__(self, specs: list[TensorSpec], device: torch.device) -> None:
        elements = sum(s.numel for s in specs)
        self.cap = max(64, int(elements * ARENA_SHARE))
        self.idx = torch.empty(self.cap, dtype=torch.int32, device=device)
        # The new bits of each element size in their own buffer: slot j of a 4-byte tensor
        # and slot j of a 2-byte one lie at different bytes of one buffer, so a 2-byte
        # tensor's slots after a 4-byte tensor's would overwrite its values.
        sizes = {s.torch_dtype.itemsize for s in specs} & {2, 4}
        self.raw = {size: torch.empty(self.cap * size, dtype=torch.uint8, device=device) for size in sizes}
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.after = torch.zeros(len(specs), dtype=torch.int64, device=device)

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        return self.raw[dtype.itemsize].view(dtype)[: self.cap]

    def finish(self, diffs: Sequence[KernelDiff], give_up: float) -> list[tuple[Kind, int, torch.Tensor | None]]:
        """(kind, count, payload) of each of ``diffs`` (every kernel tensor of the sync, all
        launched): INDICES (the kernels' order is not the indices'), DENSE (past
        ``give_up`` of its elements, no smaller as INDICES, or past the arena) or
        UNCHANGED. One copy to the host waits for the kernels; the decisions are made on
        whole arrays and every INDICES payload in one more launch, so the host's work after
        the wait does not grow by a Python step per tensor."""
        if not diffs:
            return []
        # Slots the kernels found nothing in stay 0: each start is the largest end before it.
        ends_all = np.maximum.accumulate(self.after.cpu().numpy())
        slots = np.fromiter((d.slot for d in diffs), dtype=np.int64, count=len(diffs))
        ends = ends_all[slots]
        starts = np.where(slots > 0, ends_all[np.maximum(slots - 1, 0)], 0)
        counts = ends - starts
        numel = np.fromiter((d.spec.numel for d in diffs), dtype=np.int64, count=len(diffs))
        size = np.fromiter((d.dtype.itemsize for d in diffs), dtype=np.int64, count=len(diffs))
        # The INDICES layout (int32 positions: the kernels take no tensor of 2**31 elements).
        offsets = -(-counts * 4 // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
        nbytes = offsets + counts * size
        dense = (ends > self.cap) | (counts > numel * give_up) | (nbytes >= numel * size)
        picked = np.flatnonzero((counts > 0) & ~dense)
        payloads = self._assemble(picked, starts, counts, size, offsets, nbytes)
        out: list[tuple[Kind, int, torch.Tensor | None]] = []
        for i, (diff, count, gone) in enumerate(zip(diffs, counts.tolist(), dense.tolist())):
            if count == 0:
                out.append((Kind.UNCHANGED, 0, None))
            elif gone:
                out.append((Kind.DENSE, diff.spec.numel, None))
            else:
                out.append((Kind.INDICES, count, payloads[i]))
        return out

    def _assemble(
        self,
        picked: np.ndarray,
        starts: np.ndarray,
        counts: np.ndarray,
        size: np.ndarray,
        offsets: np.ndarray,
        nbytes: np.ndarray,
    ) -> dict[int, torch.Tensor]:
        """The INDICES payloads of the ``picked`` diffs, views of one buffer filled by one
        kernel launch (made one by one, they cost three small host-bound ops a tensor)."""
        if picked.size == 0:
            return {}
        found = cuda_kernels.kernels(self.idx.device)
        assert found is not None
        aligned = -(-nbytes[picked] // PAYLOAD_ALIGN) * PAYLOAD_ALIGN
        at = np.concatenate(([0], np.cumsum(aligned)[:-1]))
        buffer = torch.empty(int(aligned.sum()), dtype=torch.uint8, device=self.idx.device)
        raw = np.array(
            [self.raw[s].data_ptr() if s in self.raw else 0 for s in (2, 4)], dtype=np.int64
        )  # by size: 2 -> [0], 4 -> [1]
        # Rows: indices source, values source, count, payload, values offset, value bytes,
        # first block (row_table's), unused (see the kernel).
        table = np.zeros((picked.size, 8), dtype=np.int64)
        table[:, 0] = self.idx.data_ptr() + 4 * starts[picked]
        table[:, 1] = raw[size[picked] // 4] + size[picked] * starts[picked]
        table[:, 2] = counts[picked]
        table[:, 3] = buffer.data_ptr() + at
        table[:, 4] = offsets[picked]
        table[:, 5] = size[picked]
        found.assemble(*cuda_kernels.row_table(table, self.idx.device))
        return {
            int(i): buffer[int(a) : int(a) + int(n)]
            for i, a, n in zip(picked.tolist(), at.tolist(), nbytes[picked].tolist())
        }


class KernelDiff:
    """One tensor's compare by the GPU kernel, launched when made; its outcome comes from
    :meth:`DeviceArena.finish` once every tensor of the sync was launched. The base takes
    the new bytes either way."""

    def __init__(self, spec: TensorSpec, new: torch.Tensor, base: torch.Tensor, arena: DeviceArena, slot: int) -> None:
        found = cuda_kernels.kernels(base.device)
        assert found is not None
        self.spec, self.slot = spec, slot
        self.dtype = bits_of(base).dtype
        found.encode(
            new.reshape(-1), base.reshape(-1), arena.idx, arena.values(self.dtype), arena.counter, arena.after, slot
        )

    @staticmethod
    def takes(new: torch.Tensor, base: torch.Tensor) -> bool:
        return (
            base.is_cuda
            and new.dtype == base.dtype
            and cuda_kernels.fits(new)
            and cuda_kernels.fits(base)
            and cuda_kernels.kernels(base.device) is not None
        )


def diff_torch(
    spec: TensorSpec, source: torch.Tensor, base: torch.Tensor, give_up: float, sample: int
) -> tuple[Kind, int, torch.Tensor | None]:
    """(kind, count, payload) of flat ``source`` against flat ``base`` (updated)."""
    new = source.to(device=base.device, dtype=spec.torch_dtype)
    lanes = 8 // spec.torch_dtype.itemsize if spec.torch_dtype.itemsize < 8 else 1
    whole = spec.numel // lanes * lanes if lanes > 1 and base.data_ptr() % 8 == 0 and new.data_ptr() % 8 == 0 else 0
    if whole == 0:
        return _elements(spec, new, base, give_up, sample)
    new_words, base_words = new[:whole].view(torch.int64), base[:whole].view(torch.int64)
    differs = (new_words != base_words).nonzero().view(-1)
    if differs.numel() > spec.numel * give_up:  # more words differ than elements may
        base.copy_(new)
        return Kind.DENSE, spec.numel, None
    lanes_new = bits_of(new)[:whole].view(-1, lanes)[differs]
    moved = lanes_new != bits_of(base)[:whole].view(-1, lanes)[differs]
    if int(moved.sum()) > spec.numel * give_up:
        base.copy_(new)
        return Kind.DENSE, spec.numel, None
    base_words[differs] = new_words[differs]
    idx = ((differs * lanes).unsqueeze(1) + torch.arange(lanes, device=base.device))[moved]
    values = lanes_new[moved]
    if whole < spec.numel:  # the elements past the last whole word
        tail_new, tail_old = bits_of(new)[whole:], bits_of(base)[whole:]
        extra = (tail_new != tail_old).nonzero().view(-1)
        idx = torch.cat([idx, extra + whole])
        values = torch.cat([values, tail_new[extra]])
        tail_old.copy_(tail_new)
    return _encoded(spec, idx, values, base, new)


def _elements(
    spec: TensorSpec, new: torch.Tensor, base: torch.Tensor, give_up: float, sample: int
) -> tuple[Kind, int, torch.Tensor | None]:
    """Element by element (8- and 16-byte elements, unaligned tensors)."""
    new_bits, base_bits = bits_of(new), bits_of(base)
    changed = new_bits != base_bits
    if changed.dim() == 2:
        changed = changed.any(dim=1)
    head = min(sample, spec.numel)
    if int(changed[:head].sum()) > head * give_up:
        base.copy_(new)
        return Kind.DENSE, spec.numel, None
    idx = changed.nonzero().view(-1)
    values = new_bits[idx]
    base_bits[idx] = values
    return _encoded(spec, idx, values, base, new)


def _encoded(
    spec: TensorSpec, idx: torch.Tensor, values: torch.Tensor, base: torch.Tensor, new: torch.Tensor
) -> tuple[Kind, int, torch.Tensor | None]:
    count = idx.numel()
    kind = best_kind(spec, count)
    if kind is Kind.UNCHANGED:
        return kind, 0, None
    if kind is Kind.DENSE:
        base.copy_(new)
        return kind, spec.numel, None
    return kind, count, build_payload(spec, kind, idx, values)


def build_payload(spec: TensorSpec, kind: Kind, idx: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One tensor's payload: positions (``idx`` as indices, or a bitmask of them) at 0, the
    bit patterns ``values`` at the layout's values offset."""
    lay = layout(spec, kind, idx.numel())
    payload = torch.empty(lay.nbytes, dtype=torch.uint8, device=values.device)
    positions = payload[: lay.positions_nbytes]
    if kind is Kind.INDICES:
        positions.view(index_dtype(spec.numel)).copy_(idx)
    else:
        positions.zero_()
        bits = torch.ones_like(idx, dtype=torch.uint8) << (idx & 7).to(torch.uint8)
        positions.index_put_((idx >> 3,), bits, accumulate=True)
    payload[lay.values_offset :].view(values.dtype).view(values.shape).copy_(values)
    return payload
