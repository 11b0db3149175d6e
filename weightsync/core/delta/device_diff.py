"""The trainer's compare with torch ops: on a GPU, and on a CPU without numba.

:func:`diff_torch` compares one tensor with its base as 64-bit words first (four bf16
elements a word; at 3% of the elements changed about 11% of the words differ), takes apart
only the words that differ, and writes them into the base; no pass over the whole tensor
beyond the cast and the compare. Elements of 8 bytes or more are compared one by one.
"""

from __future__ import annotations

import torch

from weightsync.core.delta.encoding import Kind, best_kind, bits_of, index_dtype, layout
from weightsync.core.wire.manifest import TensorSpec


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
