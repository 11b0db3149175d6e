"""One walk of streamed sources shared by several halves: a carrier reads, riders take along.

A sharded rank makes its tensors as it reads them (each bucket gathered, then dropped), and
every pass over them costs one more gather of the whole model. A half that only needs each
tensor once, in order (``direct`` writes into colocated workers), can ride the pass another
half makes anyway (``ipc`` packing its slots, ``broadcast`` sending): :class:`RiddenTensors`
stands in for the sources the carrier reads and hands each tensor to the riders the first
time the walk reaches it. Call order::

    riders = [half.ride(sources, call, deadline), ...]     each announces and gets ready
    shared = RiddenTensors(sources.tensors, riders)
    carrier.send(Sources(shared, ...), call, deadline)     riders take tensors as it reads
    shared.complete()                                      riders take what the carrier skipped
    rider.finish() for each                                wait, hand over

The carrier must read in manifest order (as every walk does); an index it skips is handed
to the riders before the next one it reads, and :meth:`RiddenTensors.complete` hands over
the rest of the walk. Once the carrier goes back to an earlier index (a second walk of its
own), the riders have had every tensor and reads pass straight through.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import torch

from weightsync.core.halves import Rider


class RiddenTensors(Sequence[torch.Tensor]):
    """``tensors`` (streamed, read in order) whose first walk is also handed to ``riders``."""

    def __init__(self, tensors: Sequence[torch.Tensor], riders: Sequence[Rider]) -> None:
        self._tensors = tensors
        self._riders = list(riders)
        self._next = 0  # the first index no rider has taken yet
        self._done = not self._riders

    def __len__(self) -> int:
        return len(self._tensors)

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Tensor]: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if self._done:
            return self._tensors[index]
        if index < self._next - 1:
            # The carrier starts a walk of its own again: the riders take the rest of this one first.
            self.complete()
            return self._tensors[index]
        self._hand_over(index)
        return self._tensors[index]

    def _hand_over(self, upto: int) -> None:
        """Every index from the first not taken to ``upto`` (included), to every rider."""
        while self._next <= upto:
            tensor = self._tensors[self._next]
            for rider in self._riders:
                rider.take(self._next, tensor)
            self._next += 1

    def complete(self) -> None:
        """Hand the riders every tensor of the walk they have not taken (idempotent)."""
        if not self._done:
            self._hand_over(len(self) - 1)
            self._done = True
