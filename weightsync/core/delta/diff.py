"""The trainer's side of a delta sync's tensors: compare their wire bytes with the base,
update the base, and build the payloads.

:meth:`Differ.diff_all` reads each trainer tensor once, in manifest order (a sharded
trainer's gathers come in that order): cast to the wire dtype, compared with the base (the
wire bytes last sent), the changed elements gathered and the base brought up to date. On
a CPU with numba that is one pass over each range of a tensor, ranges run on a few
threads (:mod:`weightsync.core.delta.cpu_diff`); elsewhere torch ops
(:mod:`weightsync.core.delta.device_diff` on a GPU). A tensor whose changed elements pass
``give_up`` of its elements is sent dense; with a :class:`Budget`, the whole sync gives up
once its payloads pass a share of the bytes read (every later tensor then only fills its
base: the cast a dense sync makes anyway). Call order, per sync::

    diffs = differ.diff_all(specs, sources, bases, budget)   # bases: contiguous, wire dtype
    diffs[i].kind, diffs[i].count, diffs[i].payload            # payload: uint8 (INDICES, BITMASK)
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.core.delta.cpu_diff import Budget, RangeDiff, Scratch
from weightsync.core.delta.cpu_kernels import Tasks, kernels, threads
from weightsync.core.delta.device_diff import DeviceArena, KernelDiff, diff_torch
from weightsync.core.delta.encoding import Kind
from weightsync.core.wire.manifest import TensorSpec

#: Elements per task on a CPU: large enough that a hand-off between threads costs little
#: next to its work, small enough that two threads share a tensor.
SPAN = 1 << 22
#: A tensor whose changed elements pass this fraction goes dense, even where a bitmask
#: would still be smaller: encoding and applying it then cost more than the bytes saved.
GIVE_UP = 0.25


@dataclass(frozen=True, slots=True)
class TensorDiff:
    kind: Kind
    count: int
    payload: torch.Tensor | None = None


class Differ:
    """Encodes tensors against their base (see the module doc); ``block``: the elements of
    one task on a CPU (and the sample of the torch path's early give-up)."""

    def __init__(self, give_up: float = GIVE_UP, block: int = SPAN) -> None:
        self.give_up = give_up
        self.block = block
        self._scratch = threading.local()
        self._arena: DeviceArena | None = None
        self._specs: list[TensorSpec] = []
        self._tasks: Tasks | None = None

    def diff(self, spec: TensorSpec, source: torch.Tensor, base: torch.Tensor) -> TensorDiff:
        """One tensor: the encoding of ``source`` (any dtype and strides, cast to ``spec``'s
        wire dtype on the way) against ``base``, which takes its new bytes."""
        return self.diff_all([spec], [source], [base])[0]

    def diff_all(
        self,
        specs: Sequence[TensorSpec],
        sources: Sequence[torch.Tensor],
        bases: Sequence[torch.Tensor],
        budget: Budget | None = None,
        stop: bool = False,
    ) -> list[TensorDiff]:
        """Every tensor, ``sources`` read once each in order; with ``budget``, the sync's
        give-up, after which every later tensor is DENSE with its base filled, or, with
        ``stop``, not read at all (the list then ends with the last tensor read)."""
        budget = budget if budget is not None else Budget(sum(s.nbytes for s in specs), float("inf"))
        out: list[TensorDiff | RangeDiff | KernelDiff] = []
        self._arena = None
        self._specs = list(specs)
        self._tasks = None
        try:
            with torch.no_grad():
                for index, spec in enumerate(specs):
                    if stop and budget.gave_up:
                        break
                    out.append(self._one(index, spec, sources[index], bases[index], budget))
                    if self._tasks is not None:
                        self._tasks.help(keep=2 * self._tasks.count)  # a short queue: few tensors held at once
        finally:
            if self._tasks is not None:
                self._tasks.finish()
        kernel = self._kernel_results([d for d in out if isinstance(d, KernelDiff)], budget)
        return [kernel[d.slot] if isinstance(d, KernelDiff) else self._joined(d) for d in out]

    def _queue(self) -> Tasks:
        """This sync's CPU tasks, their helper threads started on first use: a sync whose
        tensors all go to the GPU kernels or torch ops starts none."""
        if self._tasks is None:
            self._tasks = Tasks(threads() if kernels() is not None else 1)
        return self._tasks

    def _one(
        self, index: int, spec: TensorSpec, source: torch.Tensor, base: torch.Tensor, budget: Budget
    ) -> TensorDiff | RangeDiff | KernelDiff:
        source = source.detach()
        if spec.numel == 0:
            return TensorDiff(Kind.UNCHANGED, 0)
        if budget.gave_up:
            base.copy_(source.reshape(base.shape))
            return TensorDiff(Kind.DENSE, spec.numel)
        if base.is_cuda:
            new = source.to(device=base.device, dtype=spec.torch_dtype)
            if KernelDiff.takes(new, base):
                if self._arena is None:
                    self._arena = DeviceArena(self._specs, base.device)
                return KernelDiff(spec, new, base, self._arena, index)
        job = RangeDiff.of(spec, source, base, self.block, self.give_up, budget)
        if job is None:
            kind, count, payload = diff_torch(spec, source.reshape(-1), base.reshape(-1), self.give_up, self.block)
            sent = spec.nbytes if kind is Kind.DENSE else (payload.numel() if payload is not None else 0)
            budget.add(spec.nbytes, sent)
            return TensorDiff(kind, count, payload)
        tasks = self._queue()
        for r in range(job.ranges):
            tasks.add(functools.partial(self._run, job, r))
        return job

    def _run(self, job: RangeDiff, r: int) -> None:
        scratch = getattr(self._scratch, "blocks", None)
        if scratch is None:
            scratch = self._scratch.blocks = Scratch()
        job.task(r, scratch)

    def _joined(self, item: TensorDiff | RangeDiff) -> TensorDiff:
        return item if isinstance(item, TensorDiff) else TensorDiff(*item.result())

    def _kernel_results(self, items: list[KernelDiff], budget: Budget) -> dict[int, TensorDiff]:
        """The GPU kernels' tensors by slot, their payloads made in one launch; each counted
        into ``budget`` once known (the kernels give no early give-up)."""
        if not items:
            return {}
        assert self._arena is not None
        results = {}
        for item, (kind, count, payload) in zip(items, self._arena.finish(items, self.give_up)):
            sent = item.spec.nbytes if kind is Kind.DENSE else payload.numel() if payload is not None else 0
            budget.add(item.spec.nbytes, sent)
            results[item.slot] = TensorDiff(kind, count, payload)
        return results
