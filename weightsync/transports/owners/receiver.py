"""The owners transport's worker half (the whole story: :mod:`weightsync.transports.owners.halves`):
one group per trainer rank, every rank's pieces put in place."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from weightsync.core.delta.landing import DeltaReceiving
from weightsync.core.halves import Landing, ReceiveHalf
from weightsync.core.owned_plan import OwnedLayout, Piece, plan
from weightsync.core.packing import as_bytes, byte_checksum, contiguous_checksum
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.session import Session
from weightsync.transports.broadcast.halves import Communicator, PackedGroup, Work
from weightsync.transports.owners.common import KIND, rebrand
from weightsync.transports.owners.deltas import OwnedGroupReceiver, owned_pieces, owned_session, receive_owned

#: A posted receive: (rank, operation, the in-place piece or None for the packed segment,
#: where that piece lands when not straight in its destination).
_Posted = tuple[int, "Work", "Piece | None", "torch.Tensor | None"]


class OwnedReceiver(ReceiveHalf):
    """A worker of the owners transport: one group per trainer rank, pieces put in place."""

    kind = KIND
    carries_deltas = True
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
        self.session = session
        self.manifest = session.manifest
        self.layout = layout
        self.buckets = plan(self.manifest, layout)
        #: Per rank, the pieces it sends (a delta session's groups each carry their Manifest).
        self.owned = [owned_pieces(self.buckets, r) for r in range(layout.ranks)]
        self.groups: list[PackedGroup] = [
            OwnedGroupReceiver(comm, owned_session(session, self.owned[r]), members[r])
            if self.manifest.agreed.delta
            else PackedGroup(comm, session, members[r])
            for r, comm in enumerate(comms)
        ]
        self.nbuf = self.groups[0].nbuf  # the same manifest, so the same for every group
        #: This sync's deadline, which an abort's refusals in the other groups keep to.
        self._deadline: float | None = None
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
        if isinstance(sink, DeltaReceiving):
            try:
                return receive_owned(self, sink, call, begin), ()
            except WeightSyncError as exc:
                if exc.blames:
                    raise
                raise rebrand(exc, self.senders, f"{self.session.party}: receiving owned bytes") from exc
        deadline = self._deadline or self.session.deadlines.follower(time.monotonic())
        destinations = sink.destinations(self.manifest)
        for group in self.groups:
            try:
                group.agree(deadline)
            except WeightSyncError as exc:
                if exc.blames:
                    raise
                raise rebrand(exc, [group.members[0]], f"{group.me}: the agreement with {group.members[0]}") from exc
        begin()
        checksums: list[list[int]] = [[] for _ in self.groups]
        try:
            self._receive(sink, destinations, call, deadline, checksums)
        except WeightSyncError as exc:
            if exc.blames:
                raise
            raise rebrand(exc, self.senders, f"{self.session.party}: receiving owned bytes") from exc
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
                    raise rebrand(exc, [group.members[0]], where) from exc
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
