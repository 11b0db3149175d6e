"""Owner sends: each trainer rank broadcasts only the bytes it owns, in a group of its own.

The halves of the ``owners`` transport (plug-in: :mod:`weightsync.transports.owners.plugin`;
plan: :mod:`weightsync.core.owned_plan`; the whole story: docs/owner-sends.md). Rank ``r``
is rank 0 of group ``r``, whose other ranks are the workers. Per sync, at once::

    OwnedSender.send     (rank r)   agree in group r; per bucket: pack its segment (its own
                                    rows, cast to the wire dtype) into one of the rotating
                                    buffers and broadcast it, then its large pieces in place
    OwnedReceiver.receive (worker)  agree in groups 0..R-1 in order; per bucket: post the
                                    R groups' receives (buffers ahead), wait, put every
                                    piece into the destination's rows

In a delta session each group carries instead a broadcast of the rank's own rows as a
Manifest of their own, with the delta header, and the worker takes the groups in turn
(:mod:`weightsync.transports.owners.deltas`). The worker half is in
:mod:`weightsync.transports.owners.receiver`.

A sender reads its rank's own tensors (``Sources.local``), never a gathered walk. Failures,
per group, as broadcast handles its one group: before the agreement a failing party refuses
(nothing moved), after it the group is aborted; a failing worker refuses or aborts in every
group. A worker blames the rank of the group that failed, a rank its group's workers; a
worker commits only once every rank's answer is known (the commit is chained on all).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch

from weightsync.core.dtensors import local_part
from weightsync.core.halves import SendHalf, Sources
from weightsync.core.owned_plan import Bucket, OwnedLayout, Piece, Segment, plan, row_span
from weightsync.core.packing import as_bytes, byte_checksum, contiguous_checksum
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.session import Session
from weightsync.transports.broadcast.halves import Communicator, PackedGroup, Work
from weightsync.transports.owners.common import KIND, rebrand
from weightsync.transports.owners.deltas import OwnedGroupSender, owned_pieces, owned_session, send_owned
from weightsync.transports.owners.receiver import OwnedReceiver

__all__ = ["KIND", "OwnedReceiver", "OwnedSender"]


class OwnedSender(SendHalf):
    """Rank ``rank`` of R: sends its segment of every bucket in its own group."""

    kind = KIND
    carries_deltas = True
    own_deltas = True

    def __init__(
        self, comm: Communicator, session: Session, members: Sequence[str], layout: OwnedLayout, rank: int
    ) -> None:
        if not 0 <= rank < layout.ranks:
            raise WeightSyncError(f"{session.party}: owner rank {rank} out of range for {layout.ranks} rank(s)")
        self.manifest = session.manifest
        self.layout = layout
        self.rank = rank
        self.buckets: list[Bucket] = plan(self.manifest, layout)
        #: In a delta session the group broadcasts this rank's own Manifest (owners/deltas.py).
        self.pieces = owned_pieces(self.buckets, rank)
        self.group = (
            OwnedGroupSender(comm, owned_session(session, self.pieces), members)
            if self.manifest.agreed.delta
            else PackedGroup(comm, session, members)
        )
        #: Buffers in rotation: ``num_buffers``, never more than the group's streams allow.
        self.nbuf = self.group.nbuf
        self.segments: list[Segment] = [b.segments[rank] for b in self.buckets]
        self.inplace: list[tuple[Piece, ...]] = [b.inplace[rank] for b in self.buckets]
        self._buffers: list[torch.Tensor] = []
        #: Called with each bucket's index once its segment is on its way (progress hooks,
        #: fault injection in tests).
        self.on_segment: Callable[[int], None] | None = None

    @property
    def peers(self) -> tuple[str, ...]:
        return self.group.members[1:]

    def walks(self, targets: Sequence[str], verify: bool) -> int:
        return 0

    def buffers(self) -> list[torch.Tensor]:
        """``num_buffers`` buffers, each as large as this rank's largest segment."""
        if not self._buffers:
            size = max((s.nbytes for s in self.segments), default=0)
            device = self.group.comm.device
            self._buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(self.nbuf)]
        return self._buffers

    def send(self, sources: Sources, call: SyncCall, deadline: float) -> tuple[list[int], tuple[str, ...]]:
        group = self.group
        try:
            if isinstance(group, OwnedGroupSender):
                return send_owned(self, sources, call, deadline), ()
            group.agree(deadline)
        except WeightSyncError as exc:
            if exc.blames:
                raise
            raise rebrand(exc, self.peers, f"{group.me}: sending its owned bytes") from exc
        nbuf = self.nbuf
        in_flight: list[Work | None] = [None] * nbuf
        # In-place broadcasts in flight, with the tensor each reads (a cast copy, maybe).
        alone: deque[tuple[Work, torch.Tensor]] = deque()
        caller = group.streams.caller_stream()
        checksums: list[int] = []
        used = 0
        try:
            for b, (segment, pieces) in enumerate(zip(self.segments, self.inplace)):
                if segment.nbytes:
                    slot = used % nbuf
                    used += 1
                    pending = in_flight[slot]
                    if pending is not None:
                        pending.wait(deadline)
                        in_flight[slot] = None
                    in_flight[slot] = self._send_packed(segment, sources.local, slot, caller, call.verify, checksums)
                for piece in pieces:
                    while len(alone) >= nbuf:
                        alone.popleft()[0].wait(deadline)
                    alone.append(self._send_alone(piece, sources.local, caller, call.verify, checksums))
                if self.on_segment is not None:
                    self.on_segment(b)
            for last in [*in_flight, *(work for work, _ in alone)]:
                if last is not None:
                    last.wait(deadline)
            group.streams.drain(deadline, f"{group.me}: the last owned segment did not go out in time")
        except WeightSyncError as exc:
            if exc.blames:
                raise
            raise rebrand(exc, self.peers, f"{group.me}: sending its owned bytes") from exc
        finally:
            alone.clear()
        group.done()
        return checksums, ()

    def rows(self, piece: Piece, local: Sequence[torch.Tensor]) -> torch.Tensor:
        """The rows ``piece`` names, from this rank's own tensor (its shard, or the whole)."""
        spec = self.manifest.specs[piece.index]
        held = local_part(local[piece.index]).detach()
        if self.layout.rows[piece.index] and spec.shape:
            first, _ = row_span(spec.shape[0], self.layout.ranks, self.rank)
            held = held[piece.start - first : piece.stop - first]
        return held

    def _send_packed(
        self,
        segment: Segment,
        local: Sequence[torch.Tensor],
        slot: int,
        caller: torch.cuda.Stream | None,
        verify: bool,
        checksums: list[int],
    ) -> Work:
        group = self.group
        specs = self.manifest.specs
        buffer = self.buffers()[slot]
        with group.streams.use(slot), torch.no_grad():
            group.streams.wait_for(slot, caller)
            for piece in segment.pieces:
                spec = specs[piece.index]
                shape = (piece.stop - piece.start, *spec.shape[1:]) if spec.shape else ()
                view = buffer[piece.offset : piece.offset + piece.nbytes].view(spec.torch_dtype).view(shape)
                view.copy_(self.rows(piece, local))
            if verify:
                checksums.append(byte_checksum(buffer, segment.nbytes))
            work = group.comm.broadcast(buffer[: segment.nbytes], 0, group.streams.stream_pointer(slot))
        group.in_flight.append(work)
        return work

    def _send_alone(
        self,
        piece: Piece,
        local: Sequence[torch.Tensor],
        caller: torch.cuda.Stream | None,
        verify: bool,
        checksums: list[int],
    ) -> tuple[Work, torch.Tensor]:
        """Broadcast one large piece from the shard's own bytes (a contiguous wire-dtype copy
        when the shard is strided or of another dtype, alive until its broadcast completed)."""
        group = self.group
        spec = self.manifest.specs[piece.index]
        lane = group.lane
        with group.streams.use(lane), torch.no_grad():
            group.streams.wait_for(lane, caller)
            wire = self.rows(piece, local).to(device=group.comm.device, dtype=spec.torch_dtype).contiguous()
            if verify:
                checksums.append(contiguous_checksum(wire))
            work = group.comm.broadcast(as_bytes(wire), 0, group.streams.stream_pointer(lane))
        group.in_flight.append(work)
        return work, wire

    def abort(self) -> None:
        self.group.abort()

    def close(self, abort: bool = False) -> None:
        self._buffers = []
        self.group.close(abort)
