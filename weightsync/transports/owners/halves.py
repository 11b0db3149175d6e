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

A sender reads its rank's own tensors (``Sources.local``), never a gathered walk. Failures,
per group, as broadcast handles its one group: before the agreement a failing party refuses
(nothing moved), after it the group is aborted; a failing worker refuses or aborts in every
group. A worker blames the rank of the group that failed, a rank its group's workers; a
worker commits only once every rank's answer is known (the commit is chained on all).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import torch

from weightsync.core.dtensors import local_part
from weightsync.core.halves import Landing, ReceiveHalf, SendHalf, Sources
from weightsync.core.owned_plan import Bucket, OwnedLayout, Piece, Segment, plan, row_span
from weightsync.core.packing import as_bytes, byte_checksum, contiguous_checksum
from weightsync.core.wire.errors import PeerAborted, TransferError, TransferTimeout, WeightSyncError
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.session import Session
from weightsync.transports.broadcast.halves import Communicator, PackedGroup, Work

KIND = "owners"
#: A posted receive: (rank, operation, the in-place piece or None for the packed segment,
#: where that piece lands when not straight in its destination).
_Posted = tuple[int, "Work", "Piece | None", "torch.Tensor | None"]


def _rebrand(exc: WeightSyncError, blames: Sequence[str], where: str) -> WeightSyncError:
    """``exc`` (a group's failure, which cannot name the party behind it) blaming ``blames``,
    of the same kind (a timeout stays a timeout, a peer's abort a peer's abort)."""
    cls: type[WeightSyncError] = TransferError
    for kind in (TransferTimeout, PeerAborted):
        if isinstance(exc, kind):
            cls = kind
    return cls(f"{where}: {exc}", blames=blames)


class OwnedSender(SendHalf):
    """Rank ``rank`` of R: sends its segment of every bucket in its own group."""

    kind = KIND

    def __init__(
        self, comm: Communicator, session: Session, members: Sequence[str], layout: OwnedLayout, rank: int
    ) -> None:
        if not 0 <= rank < layout.ranks:
            raise WeightSyncError(f"{session.party}: owner rank {rank} out of range for {layout.ranks} rank(s)")
        self.group = PackedGroup(comm, session, members)
        #: Buffers in rotation: ``num_buffers``, never more than the group's streams allow.
        self.nbuf = self.group.nbuf
        self.manifest = session.manifest
        self.layout = layout
        self.rank = rank
        self.buckets: list[Bucket] = plan(self.manifest, layout)
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
            group.agree(deadline)
        except WeightSyncError as exc:
            if exc.blames:
                raise
            raise _rebrand(exc, self.peers, f"{group.me}: the agreement of its owner group") from exc
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
            raise _rebrand(exc, self.peers, f"{group.me}: sending its owned bytes") from exc
        finally:
            alone.clear()
        group.done()
        return checksums, ()

    def _rows(self, piece: Piece, local: Sequence[torch.Tensor]) -> torch.Tensor:
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
                view.copy_(self._rows(piece, local))
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
            wire = self._rows(piece, local).to(device=group.comm.device, dtype=spec.torch_dtype).contiguous()
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


class OwnedReceiver(ReceiveHalf):
    """A worker of the owners transport: one group per trainer rank, pieces put in place."""

    kind = KIND
    knows_sender_finished = False

    def __init__(
        self,
        comms: Sequence[Communicator],
        session: Session,
        members: Sequence[Sequence[str]],
        layout: OwnedLayout,
    ) -> None:
        """``comms[r]``, ``members[r]``: group r's communicator and its parties in group rank
        order (``trainer-rank-<r>`` first, then the workers)."""
        if len(comms) != layout.ranks:
            raise WeightSyncError(f"{session.party}: {len(comms)} owner group(s) for {layout.ranks} trainer rank(s)")
        self.groups = [PackedGroup(comm, session, members[r]) for r, comm in enumerate(comms)]
        self.nbuf = self.groups[0].nbuf  # the same manifest, so the same for every group
        #: This sync's deadline, which an abort's refusals in the other groups keep to.
        self._deadline: float | None = None
        self.session = session
        self.manifest = session.manifest
        self.layout = layout
        self.buckets = plan(self.manifest, layout)
        self._buffers: list[list[torch.Tensor]] = []

    @property
    def senders(self) -> list[str]:
        return [g.members[0] for g in self.groups]

    def buffers(self) -> list[list[torch.Tensor]]:
        """Per rank, ``num_buffers`` buffers as large as that rank's largest segment."""
        if not self._buffers:
            nbuf = self.nbuf
            for r, group in enumerate(self.groups):
                size = max((b.segments[r].nbytes for b in self.buckets), default=0)
                self._buffers.append(
                    [torch.empty(size, dtype=torch.uint8, device=group.comm.device) for _ in range(nbuf)]
                )
        return self._buffers

    def start(self, call: SyncCall) -> None:
        self._deadline = self.session.deadlines.follower(time.monotonic())

    def receive(self, sink: Landing, call: SyncCall, begin: Callable[[], None]) -> tuple[list[int], tuple[str, ...]]:
        deadline = self._deadline or self.session.deadlines.follower(time.monotonic())
        destinations = sink.destinations(self.manifest)
        for group in self.groups:
            try:
                group.agree(deadline)
            except WeightSyncError as exc:
                if exc.blames:
                    raise
                raise _rebrand(exc, [group.members[0]], f"{group.me}: the agreement with {group.members[0]}") from exc
        begin()
        checksums: list[list[int]] = [[] for _ in self.groups]
        try:
            self._receive(sink, destinations, call, deadline, checksums)
        except WeightSyncError as exc:
            if exc.blames:
                raise
            raise _rebrand(exc, self.senders, f"{self.session.party}: receiving owned bytes") from exc
        for group in self.groups:
            group.done()
        return [c for per_rank in checksums for c in per_rank], ()

    def _receive(
        self,
        sink: Landing,
        destinations: list[torch.Tensor | None],
        call: SyncCall,
        deadline: float,
        checksums: list[list[int]],
    ) -> None:
        nbuf = self.nbuf
        buffers = self.buffers()
        posted: dict[int, list[_Posted]] = {}
        for b in range(min(nbuf, len(self.buckets))):
            posted[b] = self._post(b, destinations)
        for b, bucket in enumerate(self.buckets):
            partial: dict[int, torch.Tensor] = {}
            for r, work, piece, landing in posted.pop(b):
                group = self.groups[r]
                try:
                    work.wait(deadline)
                except WeightSyncError as exc:
                    if exc.blames:
                        raise
                    where = f"{group.me}: bucket {b} from {group.members[0]}"
                    raise _rebrand(exc, [group.members[0]], where) from exc
                if piece is None:
                    segment, buffer = bucket.segments[r], buffers[r][b % nbuf]
                    with group.streams.use(b % nbuf):
                        for packed in segment.pieces:
                            self._place(packed, buffer[packed.offset :], destinations, partial)
                        if call.verify:
                            checksums[r].append(byte_checksum(buffer, segment.nbytes))
                    continue
                with group.streams.use(nbuf):
                    if landing is not None:
                        self._place(piece, landing, destinations, partial)
                    if call.verify:
                        landed = (
                            landing if landing is not None else self._rows_of(piece, destinations, group.comm.device)
                        )
                        assert landed is not None
                        checksums[r].append(contiguous_checksum(landed))
            for r, segment in enumerate(bucket.segments):
                if not segment.nbytes:  # empty tensors: nothing travels, but they are handed over
                    for packed in segment.pieces:
                        self._place(packed, buffers[r][0], destinations, partial)
            for group in self.groups:
                group.streams.drain(deadline, f"{group.me}: placing bucket {b} did not complete in time")
            handed = [(self.manifest.specs[i].name, t) for i, t in partial.items() if destinations[i] is None]
            for i, full in partial.items():
                dest = destinations[i]
                if dest is not None:
                    dest.copy_(full)
            if handed:
                sink.consume(handed)
            if b + nbuf < len(self.buckets):
                posted[b + nbuf] = self._post(b + nbuf, destinations)

    def _post(self, b: int, destinations: list[torch.Tensor | None]) -> list[_Posted]:
        """Post every group's receives of bucket ``b``, in each group's order."""
        nbuf = self.nbuf
        buffers = self.buffers()
        entries: list[_Posted] = []
        for r, group in enumerate(self.groups):
            segment = self.buckets[b].segments[r]
            if segment.nbytes:
                with group.streams.use(b % nbuf):
                    target = buffers[r][b % nbuf][: segment.nbytes]
                    entries.append(
                        (r, group.comm.broadcast(target, 0, group.streams.stream_pointer(b % nbuf)), None, None)
                    )
            for piece in self.buckets[b].inplace[r]:
                rows = self._rows_of(piece, destinations, group.comm.device)
                landing = (
                    torch.empty(piece.nbytes, dtype=torch.uint8, device=group.comm.device) if rows is None else rows
                )
                with group.streams.use(nbuf):
                    work = group.comm.broadcast(landing, 0, group.streams.stream_pointer(nbuf))
                entries.append((r, work, piece, None if rows is not None else landing))
            group.in_flight.extend(e[1] for e in entries if e[0] == r)
        return entries

    def _rows_of(
        self, piece: Piece, destinations: list[torch.Tensor | None], device: torch.device
    ) -> torch.Tensor | None:
        """The bytes of the destination's rows ``piece`` names, when the destination can take
        raw bytes (a contiguous tensor of the spec's dtype and shape on ``device``); else None."""
        spec = self.manifest.specs[piece.index]
        dest = destinations[piece.index]
        if (
            dest is None
            or not dest.is_contiguous()
            or dest.dtype != spec.torch_dtype
            or tuple(dest.shape) != spec.shape
            or dest.device != device
        ):
            return None
        row_bytes = piece.nbytes // max(1, piece.stop - piece.start)
        start = piece.start * row_bytes
        return as_bytes(dest.detach())[start : start + piece.nbytes]

    def _place(
        self,
        piece: Piece,
        source: torch.Tensor,
        destinations: list[torch.Tensor | None],
        partial: dict[int, torch.Tensor],
    ) -> None:
        """Copy ``piece`` (its bytes at the start of ``source``) into its destination's rows; a
        destination that cannot take raw bytes (none, strided, another dtype) gets its
        tensor assembled in ``partial`` first, handed over once the bucket is complete."""
        rows = self._rows_of(piece, destinations, source.device)
        if rows is None:
            spec = self.manifest.specs[piece.index]
            whole = partial.get(piece.index)
            if whole is None:
                whole = torch.empty(spec.shape, dtype=spec.torch_dtype, device=source.device)
                partial[piece.index] = whole
            row_bytes = piece.nbytes // max(1, piece.stop - piece.start)
            start = piece.start * row_bytes
            rows = as_bytes(whole)[start : start + piece.nbytes]
        rows.copy_(source[: piece.nbytes])

    def abort(self) -> None:
        """Refuse, or abort, in every group, each by this sync's deadline: a rank that is
        stuck before its group's agreement must not hold the refusals for a fresh timeout."""
        for group in self.groups:
            group.abort(self._deadline)

    def close(self, abort: bool = False) -> None:
        self._buffers = []
        for group in self.groups:
            group.close(abort)
