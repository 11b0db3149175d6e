"""The trainer's compare on a CPU with numba: one tensor as ranges, each a task.

:class:`RangeDiff` prepares one tensor (its bit patterns as numpy arrays, its ranges),
:meth:`RangeDiff.task` is the work of one range (run on any thread of a
:class:`~weightsync.core.delta.cpu_kernels.Tasks`), and :meth:`RangeDiff.result` joins the
ranges once every task ran::

    job = RangeDiff.of(spec, source, base, span, give_up, budget)   # None: not for numba
    for r in range(job.ranges): tasks.add(functools.partial(job.task, r, scratch))
    tasks.finish(); job.result()                                     # a TensorDiff

A range whose changed elements pass ``give_up`` of it stops early (the loop fills the rest
of its base) and makes the whole tensor dense; once the sync's :class:`Budget` gave up,
ranges only fill their base (the cast a dense sync makes anyway).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from weightsync.core.delta.cpu_kernels import kernels
from weightsync.core.delta.encoding import Kind, best_kind, index_bytes, index_dtype, layout
from weightsync.core.wire.manifest import TensorSpec

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGNED = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: A range that stopped early (too many changes) or only filled its base.
_DENSE = -1


class Budget:
    """The whole sync's give-up: once the payloads pass ``fraction`` of the dense bytes
    read so far (after at least a sixteenth of ``total``), every later range only fills
    its base and the sync goes dense for everyone."""

    def __init__(self, total: int, fraction: float) -> None:
        self.total, self.fraction = total, fraction
        self.read = self.sent = 0
        self.gave_up = False
        self._lock = threading.Lock()

    def add(self, read: int, sent: int) -> None:
        with self._lock:
            self.read += read
            self.sent += sent
            if self.read * 16 >= self.total and self.sent > self.fraction * self.read:
                self.gave_up = True


@dataclass
class Scratch:
    """One thread's reused blocks for the loops."""

    cast: np.ndarray = field(default_factory=lambda: np.empty(kernels().BLOCK, np.uint16))
    words: np.ndarray = field(default_factory=lambda: np.empty(kernels().BLOCK, np.uint64))
    listed: np.ndarray = field(default_factory=lambda: np.empty(kernels().BLOCK, np.int32))


def bits_np(tensor: torch.Tensor) -> np.ndarray:
    """A flat numpy view of a contiguous CPU tensor's bit patterns, unsigned."""
    flat = tensor.reshape(-1)
    size = flat.element_size()
    return flat.view(torch.uint8).view(_SIGNED[size]).numpy().view(_UNSIGNED[size])


def _usable(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous on the CPU, 8-byte aligned (the loops read 64-bit words)."""
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous() or t.data_ptr() % 8:
        t = t.contiguous() if t.data_ptr() % 8 == 0 else t.clone()
    return t


class RangeDiff:
    """One tensor's compare, in ranges of at most ``span`` elements (see the module doc)."""

    def __init__(
        self,
        spec: TensorSpec,
        new: np.ndarray,
        base: np.ndarray,
        fused: bool,
        span: int,
        give_up: float,
        budget: Budget,
    ) -> None:
        self.spec, self.new, self.base, self.fused = spec, new, base, fused
        self.give_up, self.budget = give_up, budget
        numel = spec.numel
        span = max(8, span // 8 * 8)
        self.bounds = [(lo, min(numel, lo + span)) for lo in range(0, numel, span)]
        self.parts: list[tuple[int, np.ndarray | None, np.ndarray | None]] = [(0, None, None)] * len(self.bounds)
        self._per = index_bytes(numel) + spec.torch_dtype.itemsize

    @classmethod
    def of(
        cls, spec: TensorSpec, source: torch.Tensor, base: torch.Tensor, span: int, give_up: float, budget: Budget
    ) -> RangeDiff | None:
        """The compare of ``source`` against ``base`` (contiguous, wire dtype, on the CPU),
        or None where the loops do not serve (no numba, a base off the CPU, 16-byte elements)."""
        wire = spec.torch_dtype
        if kernels() is None or base.device.type != "cpu" or wire.itemsize not in _UNSIGNED:
            return None
        # The loop casts fp32 as torch's vectorized cast does (NaN: 0xFFFF), which is what
        # torch does over a contiguous source; a strided one goes through torch's own cast.
        fused = source.dtype == torch.float32 and wire == torch.bfloat16 and source.is_contiguous()
        if not fused and source.dtype != wire:
            source = source.to(device=base.device, dtype=wire)  # any other cast: torch's, then compared
        return cls(spec, bits_np(_usable(source)), bits_np(base), fused, span, give_up, budget)

    @property
    def ranges(self) -> int:
        return len(self.bounds)

    def task(self, r: int, scratch: Scratch) -> None:
        """Compare range ``r`` (any thread; each range writes only its own outputs)."""
        lo, hi = self.bounds[r]
        loops = kernels()
        new, base = self.new[lo:hi], self.base[lo:hi]
        n = hi - lo
        if self.budget.gave_up:
            self._fill(loops, new, base)
            self.parts[r] = (_DENSE, None, None)
            self.budget.add(n * self.spec.torch_dtype.itemsize, n * self.spec.torch_dtype.itemsize)
            return
        cap = max(8, int(n * self.give_up))
        idx = np.empty(cap, np.int32 if index_dtype(self.spec.numel) == torch.int32 else np.int64)
        val = np.empty(cap, base.dtype)
        if self.fused:
            count = loops.encode_f32_bf16(new, base, lo, idx, val, scratch.cast, scratch.words, scratch.listed)
        else:
            count = loops.encode_bits(new, base, lo, idx, val, scratch.words, scratch.listed)
        itemsize = self.spec.torch_dtype.itemsize
        if count < 0:
            self.parts[r] = (_DENSE, None, None)
            self.budget.add(n * itemsize, n * itemsize)
            return
        self.parts[r] = (count, idx[:count], val[:count])
        self.budget.add(n * itemsize, min(count * self._per, n // 8 + count * itemsize))

    def _fill(self, loops: Any, new: np.ndarray, base: np.ndarray) -> None:
        if self.fused:
            loops.cast_f32_bf16(new, base)
        else:
            np.copyto(base, new)

    def result(self) -> tuple[Kind, int, torch.Tensor | None]:
        """(kind, count, payload) once every range ran; the base then holds the new bytes."""
        spec = self.spec
        if any(count == _DENSE for count, _, _ in self.parts):
            return Kind.DENSE, spec.numel, None
        count = sum(c for c, _, _ in self.parts)
        kind = best_kind(spec, count)
        if kind in (Kind.UNCHANGED, Kind.DENSE):  # the base already took the changed words
            return kind, (spec.numel if kind is Kind.DENSE else 0), None
        return kind, count, self._payload(kind, count)

    def _payload(self, kind: Kind, count: int) -> torch.Tensor:
        lay = layout(self.spec, kind, count)
        payload = torch.empty(lay.nbytes, dtype=torch.uint8)
        raw = payload.numpy()
        positions = raw[: lay.positions_nbytes]
        values = raw[lay.values_offset :].view(self.base.dtype)
        idx = [i for c, i, _ in self.parts if c and i is not None]
        if kind is Kind.INDICES:
            np.concatenate(idx, out=positions.view(idx[0].dtype))
        else:
            positions[:] = 0
            for i in idx:
                kernels().set_bits(positions, i)
        np.concatenate([v for c, _, v in self.parts if c and v is not None], out=values)
        return payload
