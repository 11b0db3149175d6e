"""The trainer's side of one tensor in a delta sync: compare its wire bytes with the base,
update the base, and build the payload.

:meth:`Differ.diff` reads the trainer's tensor once: cast to the wire dtype, compared with
the base (the wire bytes last sent), the changed elements gathered and the base brought up
to date, all in one pass over the data on a CPU (with numba, block by block so each block
stays in cache), with torch ops elsewhere. It gives up early and cheaply on a tensor that
is dense-ish: the first block serves as a sample, and a tensor whose changed elements
pass ``give_up`` of its elements is sent dense (the rest of it is then copied into the
base, which is the dense payload). Call order, per tensor of a sync::

    diff = differ.diff(spec, source, base)   # base: contiguous, of the wire dtype; updated
    diff.kind, diff.count, diff.payload      # payload: uint8 (INDICES, BITMASK), else None
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from weightsync.core.delta.cpu_kernels import in_parts, kernels
from weightsync.core.delta.encoding import Kind, best_kind, bits_of, index_dtype, layout
from weightsync.core.wire.manifest import TensorSpec

#: Elements per block on a CPU: 1 Mi bf16 elements is 2 MiB of wire and 4 MiB of fp32
#: source, which stay in cache between the cast and the compare.
BLOCK = 1 << 20
#: A tensor whose changed elements pass this fraction goes dense, even where a bitmask
#: would still be smaller: encoding and applying it then cost more than the bytes saved.
GIVE_UP = 0.25


@dataclass(frozen=True, slots=True)
class TensorDiff:
    kind: Kind
    count: int
    payload: torch.Tensor | None = None


class Differ:
    """Encodes tensors against their base, reusing its scratch from tensor to tensor."""

    def __init__(self, give_up: float = GIVE_UP, block: int = BLOCK) -> None:
        self.give_up = give_up
        self.block = block
        #: Reused CPU scratch: one block's outputs (by dtype), one block cast to the wire dtype.
        self._outputs: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._casts: dict[torch.dtype, torch.Tensor] = {}

    def diff(self, spec: TensorSpec, source: torch.Tensor, base: torch.Tensor) -> TensorDiff:
        """The encoding of ``source`` (the trainer's tensor, any dtype and strides, cast to
        ``spec``'s wire dtype on the way) against ``base``, which takes its new bytes."""
        with torch.no_grad():
            source = source.detach()
            if source.device != base.device:
                source = source.to(base.device)
            if spec.numel == 0:
                return TensorDiff(Kind.UNCHANGED, 0)
            numba = kernels() if base.device.type == "cpu" and spec.torch_dtype.itemsize < 16 else None
            if numba is not None:
                return self._diff_blocks(spec, source.reshape(-1), base.reshape(-1), numba)
            return self._diff_torch(spec, source.reshape(-1), base.reshape(-1))

    # torch ops (any device) -------------------------------------------------------------
    def _diff_torch(self, spec: TensorSpec, source: torch.Tensor, base: torch.Tensor) -> TensorDiff:
        new = source.to(spec.torch_dtype)
        new_bits, base_bits = bits_of(new), bits_of(base)
        changed = new_bits != base_bits
        if changed.dim() == 2:
            changed = changed.any(dim=1)
        sample = min(self.block, spec.numel)
        if int(changed[:sample].sum()) > sample * self.give_up:
            base.copy_(new)
            return TensorDiff(Kind.DENSE, spec.numel)
        count = int(changed.sum())
        if count > spec.numel * self.give_up:
            base.copy_(new)
            return TensorDiff(Kind.DENSE, spec.numel)
        kind = best_kind(spec, count)
        if kind is Kind.DENSE:
            base.copy_(new)
            return TensorDiff(Kind.DENSE, spec.numel)
        if kind is Kind.UNCHANGED:
            return TensorDiff(kind, 0)
        idx = changed.nonzero().view(-1)
        values = new_bits[idx]
        base_bits.index_copy_(0, idx, values)
        return TensorDiff(kind, count, build_payload(spec, kind, idx, values))

    # numba loops, block by block (CPU) ---------------------------------------------------
    def _diff_blocks(self, spec: TensorSpec, source: torch.Tensor, base: torch.Tensor, loops: Any) -> TensorDiff:
        wire = spec.torch_dtype
        fused = source.dtype == torch.float32 and wire == torch.bfloat16
        if not source.is_contiguous():
            source = source.contiguous()
        numel, block = spec.numel, self.block
        cap = int(numel * self.give_up)
        idx_parts: list[torch.Tensor] = []
        val_parts: list[torch.Tensor] = []
        count = 0
        for lo in range(0, numel, block):
            hi = min(numel, lo + block)
            got = self._block(loops, source[lo:hi], base[lo:hi], wire, fused, lo)
            if got is None or count + got[0].numel() > cap:
                base[lo:].copy_(source[lo:])
                return TensorDiff(Kind.DENSE, numel)
            if got[0].numel():
                idx_parts.append(got[0])
                val_parts.append(got[1])
                count += got[0].numel()
        kind = best_kind(spec, count)
        if kind is Kind.UNCHANGED:
            return TensorDiff(kind, 0)
        idx = torch.from_numpy(np.concatenate([t.numpy() for t in idx_parts]))
        values = torch.from_numpy(np.concatenate([t.numpy() for t in val_parts]))
        if kind is Kind.DENSE:  # smaller than dense by no encoding: the base already took it
            return TensorDiff(kind, numel)
        return TensorDiff(kind, count, build_payload(spec, kind, idx, values))

    def _block(
        self, loops: Any, source: torch.Tensor, base: torch.Tensor, wire: torch.dtype, fused: bool, first: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One block's changed (indices, bit patterns), the base updated; None: give up."""
        base_bits = bits_of(base)
        n = source.numel()
        cap = max(8, int(n * self.give_up))
        idx = self._buffer("indices", torch.int64, cap)
        values = self._buffer("values", base_bits.dtype, cap)
        if fused:
            src = source.view(torch.int32)

            def run(lo: int, hi: int) -> int:
                at, end = cap * lo // n, cap * hi // n
                return int(
                    loops.diff_f32_bf16(
                        src[lo:hi].numpy(),
                        base_bits[lo:hi].numpy(),
                        first + lo,
                        idx[at:end].numpy(),
                        values[at:end].numpy(),
                    )
                )
        else:
            new_bits = bits_of(source if source.dtype == wire else self._cast(source, wire))

            def run(lo: int, hi: int) -> int:
                at, end = cap * lo // n, cap * hi // n
                return _diff_range(loops, new_bits, base_bits, lo, hi, first, idx[at:end], values[at:end])

        counts = in_parts(n, run)
        if fused and -2 in counts:  # a NaN: torch's cast decides the block's bit patterns
            return self._block(loops, source.to(wire), base, wire, False, first)
        if any(c < 0 for c in counts):
            return None
        found = _gather(idx, values, [cap * lo // n for lo, _ in _ranges(n, len(counts))], counts)
        if fused:  # the fused loop leaves the base alone (a NaN may send the block to torch)
            dest, where, what = base_bits.numpy(), found[0].numpy(), found[1].numpy()
            in_parts(where.shape[0], lambda lo, hi: loops.scatter(dest, where[lo:hi], what[lo:hi], first))
        return found

    def _buffer(self, role: str, dtype: torch.dtype, n: int) -> torch.Tensor:
        """A reused CPU scratch of ``n`` elements (what one block's outputs need at most)."""
        held = self._outputs.get((role, dtype))
        if held is None or held.numel() < n:
            held = torch.empty(n, dtype=dtype)
            self._outputs[(role, dtype)] = held
        return held[:n]

    def _cast(self, source: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
        scratch = self._casts.get(wire)
        if scratch is None or scratch.numel() < source.numel():
            scratch = torch.empty(max(source.numel(), self.block), dtype=wire)
            self._casts[wire] = scratch
        out = scratch[: source.numel()]
        out.copy_(source)
        return out


def _ranges(size: int, parts: int) -> list[tuple[int, int]]:
    return [(size * t // parts, size * (t + 1) // parts) for t in range(parts)]


def _gather(
    idx: torch.Tensor, values: torch.Tensor, starts: list[int], counts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The outputs of each range, written from ``starts[t]``, as two tensors of their own
    (copied with numpy: a plain copy on this thread, where a torch op would wake its
    OpenMP threads, which on a loaded machine cost more than the copy)."""
    i, v = idx.numpy(), values.numpy()
    return (
        torch.from_numpy(np.concatenate([i[a : a + c] for a, c in zip(starts, counts)])),
        torch.from_numpy(np.concatenate([v[a : a + c] for a, c in zip(starts, counts)])),
    )


def _diff_range(
    loops: Any,
    new_bits: torch.Tensor,
    base_bits: torch.Tensor,
    lo: int,
    hi: int,
    first: int,
    idx: torch.Tensor,
    values: torch.Tensor,
) -> int:
    """Elements ``lo:hi`` compared: 64-bit words first, by numba; the few elements past the
    last whole word by torch. The count written into ``idx``/``values``, or -1 (too many)."""
    lanes = 8 // new_bits.element_size()
    whole = lo + (hi - lo) // lanes * lanes
    count = 0
    if whole > lo:
        count = int(
            loops.diff_words(
                new_bits[lo:whole].view(torch.int64).numpy(),
                base_bits[lo:whole].view(torch.int64).numpy(),
                lanes,
                8 * new_bits.element_size(),
                first + lo,
                idx.numpy(),
                values.numpy(),
            )
        )
    if whole < hi and count >= 0:
        changed = (new_bits[whole:hi] != base_bits[whole:hi]).nonzero().view(-1)
        if count + changed.numel() > idx.numel():
            return -1
        idx[count : count + changed.numel()] = changed + first + whole
        values[count : count + changed.numel()] = new_bits[whole:hi][changed]
        base_bits[whole:hi] = new_bits[whole:hi]
        count += changed.numel()
    return count


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
        loops = kernels() if positions.device.type == "cpu" else None
        if loops is not None:
            loops.set_bits(positions.numpy(), idx.numpy())
        else:
            bits = torch.ones_like(idx, dtype=torch.uint8) << (idx & 7).to(torch.uint8)
            positions.index_put_((idx >> 3,), bits, accumulate=True)
    payload[lay.values_offset :].view(values.dtype).view(values.shape).copy_(values)
    return payload
