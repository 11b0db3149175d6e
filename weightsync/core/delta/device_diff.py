"""The trainer's compare on a GPU (and with torch ops on a CPU without numba).

:class:`KernelDiff` runs :mod:`weightsync.core.delta.cuda_kernels`' one-pass compare on a
tensor the kernels take; every tensor of a sync is launched before any count is read
(:class:`DeviceArena`: one copy to the host per sync), then one more launch makes every
payload (:meth:`DeviceArena.assemble`). Per sync::

    arena = DeviceArena(specs, device)
    diffs = [KernelDiff(spec, new, base, arena, slot), ...]   # launched, base updated
    kinds = [d.decide(give_up) for d in diffs]                # (kind, count): one host copy
    payloads = arena.assemble([d for d, (k, _) in zip(diffs, kinds) if k is Kind.INDICES])

:func:`diff_torch` compares one
tensor with its base with torch ops, as 64-bit words first (four bf16 elements a word; at
3% of the elements changed about 11% of the words differ), takes apart only the words that
differ, and writes them into the base. Elements of 8 bytes or more are compared one by one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from weightsync.core.delta import cuda_kernels
from weightsync.core.delta.encoding import PAYLOAD_ALIGN, Kind, best_kind, bits_of, index_dtype, layout
from weightsync.core.wire.manifest import TensorSpec
from weightsync.core.wire.plan import align_up

#: The GPU kernels' outputs of one sync hold the changes of at most this share of its
#: elements (an index and the new bits each: at bf16 6 bytes, so about a fifth of the
#: model's bytes); a tensor whose changes pass the room left goes dense.
ARENA_SHARE = 1 / 16


class DeviceArena:
    """One sync's outputs of the GPU kernels: every tensor's changes back to back (the
    kernels run one after the other on one stream, drawing on one counter), and the counter
    as it stood after each tensor (read with one copy to the host, once)."""

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
        self._host: list[int] | None = None

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        return self.raw[dtype.itemsize].view(dtype)[: self.cap]

    def assemble(self, picked: Sequence[KernelDiff]) -> list[torch.Tensor]:
        """The INDICES payloads of ``picked`` (each decided INDICES), views of one buffer
        filled by one kernel launch: made one by one, they cost three small host-bound ops
        a tensor (582 for an 8B-shaped model's 194)."""
        if not picked:
            return []
        found = cuda_kernels.kernels(self.idx.device)
        assert found is not None
        per_block = cuda_kernels.ASSEMBLE_PER_BLOCK
        # Rows: indices source, values source, count, payload, values offset, value bytes,
        # first block; the sources and the payload as offsets until the buffer exists.
        table = np.zeros((len(picked), 8), dtype=np.uint64)
        layouts, offsets, blocks, total = [], [], 0, 0
        for row, diff in enumerate(picked):
            start, end = self.span(diff.slot)
            lay = layout(diff.spec, Kind.INDICES, end - start)
            size = diff.dtype.itemsize
            table[row, :7] = (4 * start, size * start, end - start, total, lay.values_offset, size, blocks)
            layouts.append(lay)
            offsets.append(total)
            blocks += -(-(end - start) // per_block)
            total += align_up(lay.nbytes, PAYLOAD_ALIGN)
        buffer = torch.empty(total, dtype=torch.uint8, device=self.idx.device)
        table[:, 0] += np.uint64(self.idx.data_ptr())
        table[:, 1] += np.array([self.raw[d.dtype.itemsize].data_ptr() for d in picked], dtype=np.uint64)
        table[:, 3] += np.uint64(buffer.data_ptr())
        on_device = torch.from_numpy(table.view(np.int64)).to(self.idx.device)
        found.assemble(on_device.view(-1), blocks)  # same stream: the table outlives its use
        return [buffer[at : at + lay.nbytes] for at, lay in zip(offsets, layouts)]

    def span(self, slot: int) -> tuple[int, int]:
        """Where tensor ``slot``'s changes lie (its end past ``cap``: they did not fit)."""
        if self._host is None:
            # Slots the kernels did not run for stay 0: each start is the counter as the
            # last kernel before it left it (it only grows).
            self._host = list(itertools.accumulate(self.after.tolist(), max, initial=0))
        return self._host[slot], self._host[slot + 1]


class KernelDiff:
    """One tensor's compare by the GPU kernel: launched when made, joined by :meth:`result`
    (once every tensor of the sync was launched). The base takes the new bytes either way."""

    def __init__(self, spec: TensorSpec, new: torch.Tensor, base: torch.Tensor, arena: DeviceArena, slot: int) -> None:
        found = cuda_kernels.kernels(base.device)
        assert found is not None
        self.spec, self.arena, self.slot = spec, arena, slot
        self.dtype = bits_of(base).dtype
        found.encode(new.reshape(-1), base.reshape(-1), arena.idx, arena.values(self.dtype), arena.counter)
        arena.after[slot : slot + 1].copy_(arena.counter)

    @staticmethod
    def takes(new: torch.Tensor, base: torch.Tensor) -> bool:
        return (
            base.is_cuda
            and new.dtype == base.dtype
            and cuda_kernels.fits(new)
            and cuda_kernels.fits(base)
            and cuda_kernels.kernels(base.device) is not None
        )

    def decide(self, give_up: float) -> tuple[Kind, int]:
        """(kind, count): INDICES (the kernel's order is not the indices'), DENSE or UNCHANGED;
        an INDICES payload is made by :meth:`DeviceArena.assemble`, with every other one."""
        start, end = self.arena.span(self.slot)
        count, spec = end - start, self.spec
        if count == 0:
            return Kind.UNCHANGED, 0
        if (
            end > self.arena.cap
            or count > spec.numel * give_up
            or layout(spec, Kind.INDICES, count).nbytes >= spec.nbytes
        ):
            return Kind.DENSE, spec.numel
        return Kind.INDICES, count


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
