"""Owner writes: every rank of a sharded trainer writes the rows it holds into a colocated worker.

The halves of the ``owner-writes`` transport (plug-in:
:mod:`weightsync.transports.owner_writes.plugin`). The worker exports its tensors as for
``direct`` (:class:`~weightsync.transports.direct.halves.DirectTarget`), counting R writers;
every rank maps the export once and, per sync, writes only its own part. Nobody gathers::

    rank r (OwnerWriter)           waits for the worker's announcement; copies its Shard(0)
                                   rows into the worker's rows of each split tensor, and the
                                   whole tensors it owns (index % R, as owner sends split
                                   them); marks its part written (with verify,
                                   after the checksums of what it wrote)
    worker (OwnerWriteTarget)      announces; waits until all R parts are written; checks
                                   each tensor against its writer's checksum (verify);
                                   commits (with verify, once what it holds matches the
                                   reference rank's checksums: a diverging replica is named)

A row range is one contiguous run of bytes on both sides, so each part is one copy from the
rank's shard, with no buffer. A rank that dies or freezes is named by the worker's wait
(its pid is watched, its part is what is late).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weightsync.core.dtensors import local_part
from weightsync.core.halves import Sources
from weightsync.core.owned_plan import OwnedLayout, row_span
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.session import Session
from weightsync.mechanisms.batched_copy import PlanKey, plan_key
from weightsync.transports.direct.halves import DirectTarget, DirectWriter

KIND = "owner-writes"


class OwnerWriteTarget(DirectTarget):
    """The worker's side: a direct export that every rank writes a part of."""

    kind = KIND


class OwnerWriter(DirectWriter):
    """Rank ``writer`` of the trainer's ``writers`` (its ranks, in rank order): writes its part."""

    kind = KIND
    reads_local = True

    def __init__(
        self, session: Session, device: torch.device, layout: OwnedLayout, writer: int, writers: Sequence[str]
    ) -> None:
        if layout.ranks != len(writers):
            raise WeightSyncError(
                f"{session.party}: the model is split over {layout.ranks} rank(s) but {len(writers)} write "
                "(every rank of one mesh writes its part): run setup() again"
            )
        self.layout = layout
        super().__init__(session, device, writer, writers)

    def _parts(self, destinations: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        ranks, me = self.layout.ranks, self.writer
        parts: list[torch.Tensor | None] = []
        for index, (spec, destination) in enumerate(zip(self.manifest.specs, destinations)):
            if destination is None:
                parts.append(None)
            elif self._split(index):
                start, stop = row_span(spec.shape[0], ranks, me)
                parts.append(destination[start:stop] if stop > start else None)
            else:
                parts.append(destination if index % ranks == me else None)
        return parts

    def _split(self, index: int) -> bool:
        """Whether tensor ``index`` is split by rows (else one rank, index % R, holds it whole)."""
        return self.layout.rows[index] and bool(self.manifest.specs[index].shape)

    def _vouches(self, index: int) -> bool:
        # A split tensor's checksum (of the gathered whole) is the same on every rank; a
        # whole tensor's is its owner's, of the replica it wrote.
        if self._split(index):
            return self.writer == 0
        return index % self.layout.ranks == self.writer

    def _answer(self, checksums: list[int]) -> list[int]:
        # The worker checked each tensor against its writer already; its commit compares
        # what it holds with the reference rank's checksums, naming a diverging replica.
        return []

    def _sources(self, sources: Sources) -> tuple[Sequence[torch.Tensor], PlanKey]:
        # A rank's shard is exactly its rows (owned_plan.layout_of checked the split); a
        # Replicate or plain tensor is whole.
        held = [local_part(t).detach() for t in sources.local]
        # The key only matters to the batched copier (CUDA); elsewhere it is never read.
        return held, plan_key(held) if self._copier is not None else []
