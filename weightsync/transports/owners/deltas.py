"""Owner sends in a delta session: each rank encodes and sends only the rows it owns.

Rank ``r``'s part of every bucket (its packed pieces, then its in-place ones, bucket after
bucket: :func:`owned_pieces`) is a Manifest of its own (:func:`owned_manifest`: one tensor
per piece, named as the full tensor, shaped as its rows), which both sides derive from the
plan. In a delta session each owner group then carries a broadcast of that Manifest
exactly as the broadcast transport carries the model's: the agreement, the delta header,
then its plan or the payloads' (:class:`OwnedGroupSender`, :class:`OwnedGroupReceiver`). A
rank's base is the wire bytes of its own rows (an encoder of its own,
``DeltaSending.encoder_for``), so no rank gathers or diffs what another rank sends. Every
rank names its bytes with the sync's one token (``SyncCall.delta_token``), so a worker
holds one name for what all of them sent. A worker takes the groups one after the other,
each landing in :class:`OwnedRows`: the rows of its own tensors (a module sink's), or of
its ``load_weights`` sink's copy of the wire bytes, handed over whole once every group
landed (:meth:`~weightsync.core.sinks.LoadWeightsSink.hand_rows`). Call order::

    send_owned(sender, sources, call, deadline)            # each rank
    receive_owned(receiver, sink, call, begin)             # each worker, sink: DeltaReceiving
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch

from weightsync.core.delta.apply import apply_delta
from weightsync.core.delta.encoding import Kind
from weightsync.core.delta.header import Mode, SyncHeader
from weightsync.core.delta.landing import DeltaReceiving
from weightsync.core.halves import Sources
from weightsync.core.owned_plan import Bucket, Piece
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.manifest import Manifest, TensorSpec
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.session import Session
from weightsync.transports.broadcast.halves import BroadcastReceiver, BroadcastSender
from weightsync.transports.owners.common import KIND


class OwnedSending(Protocol):
    """What :func:`send_owned` needs of an owners send half."""

    group: Any
    sent_nbytes: int | None

    @property
    def pieces(self) -> Sequence[Piece]: ...

    def rows(self, piece: Piece, local: Sequence[torch.Tensor]) -> torch.Tensor: ...


class OwnedReceiving(Protocol):
    """What :func:`receive_owned` needs of an owners receive half."""

    manifest: Manifest

    @property
    def groups(self) -> Sequence[Any]: ...

    @property
    def owned(self) -> Sequence[Sequence[Piece]]: ...


class OwnedGroupSender(BroadcastSender):
    """Rank r's owner group in a delta session: a broadcast of its own rows' Manifest."""

    kind = KIND


class OwnedGroupReceiver(BroadcastReceiver):
    """A worker's side of one owner group in a delta session."""

    kind = KIND


def owned_pieces(buckets: Sequence[Bucket], rank: int) -> list[Piece]:
    """Every piece ``rank`` sends, in the order of its sends."""
    return [p for b in buckets for p in (*b.segments[rank].pieces, *b.inplace[rank])]


def owned_manifest(manifest: Manifest, pieces: Sequence[Piece]) -> Manifest:
    """The Manifest of ``pieces``: per piece its rows of its tensor, under the session's settings."""
    specs = []
    for p in pieces:
        spec = manifest.specs[p.index]
        shape = (p.stop - p.start, *spec.shape[1:]) if spec.shape else ()
        specs.append(TensorSpec(spec.name, shape, spec.dtype))
    return Manifest.planned(specs, manifest.agreed)


def owned_session(session: Session, pieces: Sequence[Piece]) -> Session:
    """``session`` over the owned Manifest of ``pieces`` (what one owner group carries)."""
    return replace(session, manifest=owned_manifest(session.manifest, pieces))


def send_owned(half: OwnedSending, sources: Sources, call: SyncCall, deadline: float) -> list[int]:
    """This rank's rows, encoded against its own base, broadcast in its group."""
    group = half.group
    assert isinstance(group, OwnedGroupSender) and sources.deltas is not None
    rows = [half.rows(p, sources.local) for p in half.pieces]
    encoder = sources.deltas.encoder_for(KIND)
    place = sources.deltas.place(group.comm.device)
    with torch.no_grad():
        prepared = encoder.prepare(group.manifest, rows, False, place, call.delta_holds, call.delta_token)
    walked = Sources(rows, None)
    walked.delta = prepared
    checksums, _ = group.send(walked, call, deadline)
    prepared.complete()
    half.sent_nbytes = group.sent_nbytes
    return checksums


class OwnedRows:
    """A Landing over one rank's owned Manifest (see :func:`owned_manifest`): each piece is
    rows of a worker tensor, its sink's own (:meth:`rows_target`) or, for a sink that
    stages, of its stage (``staged``: the sink's destinations this sync), written, copied
    into or patched in place; records which tensors changed."""

    keeps_references = False

    def __init__(
        self,
        sink: Any,
        manifest: Manifest,
        pieces: Sequence[Piece],
        device: torch.device,
        staged: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        self.sink, self.manifest, self.pieces, self.device = sink, manifest, pieces, device
        self.staged = staged
        self.touched: set[int] = set()

    def _rows(self, j: int) -> torch.Tensor:
        piece = self.pieces[j]
        spec = self.manifest.specs[piece.index]
        target = self.staged[piece.index] if self.staged is not None else None
        if target is None:
            target = self.sink.rows_target(piece.index, spec, self.device)
        return target if not spec.shape else target[piece.start : piece.stop]

    def destinations(self, manifest: Manifest) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for j, spec in enumerate(manifest.specs):
            rows = self._rows(j).detach()
            usable = rows.is_contiguous() and rows.dtype == spec.torch_dtype
            out.append(rows if usable else None)
        return out

    def consume(self, items: list[tuple[str, torch.Tensor]]) -> None:
        by_name = {self.manifest.specs[p.index].name: j for j, p in enumerate(self.pieces)}
        with torch.no_grad():
            for name, tensor in items:
                self._rows(by_name[name]).copy_(tensor)

    def patch(self, j: int, spec: TensorSpec, kind: Kind, count: int, payload: torch.Tensor) -> None:
        with torch.no_grad():
            apply_delta(self._rows(j).detach(), spec, kind, count, payload)

    def delta_done(self, manifest: Manifest, kinds: Sequence[tuple[Kind, int]]) -> None:
        self.touched.update(self.pieces[j].index for j, (kind, _) in enumerate(kinds) if kind is not Kind.UNCHANGED)

    def direct_tensors(self, manifest: Manifest) -> None:
        return None

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        raise TypeError("owner sends take no direct writes")


def receive_owned(half: OwnedReceiving, sink: DeltaReceiving, call: SyncCall, begin: Callable[[], None]) -> list[int]:
    """Every rank's group in turn into ``sink``'s tensors; ``sink.header`` then says what the
    worker holds (the sync's token; DELTA only when every group sent one)."""
    began = False

    def begin_once() -> None:
        nonlocal began
        if not began:
            began = True
            begin()

    checksums: list[int] = []
    took: list[bool] = []
    tokens: set[int] = set()
    touched: set[int] = set()
    # A module sink finds its tensors for rows_target; a staging sink opens its stage, which
    # every piece lands in (only dense syncs reach it: a stage holds no base).
    views = sink.sink.destinations(half.manifest)
    stages = bool(getattr(sink.sink, "staged", False))
    for r, group in enumerate(half.groups):
        rows = OwnedRows(sink.sink, half.manifest, half.owned[r], group.comm.device, views if stages else None)
        landing = DeltaReceiving(rows, group.manifest, sink.held_token, sink.who)
        assert isinstance(group, OwnedGroupReceiver)
        got, _ = group.receive(landing, call, begin_once)
        checksums.extend(got)
        assert landing.header is not None
        took.append(landing.took_delta)
        tokens.add(landing.header.new_token)
        touched |= rows.touched if landing.took_delta else {p.index for p in half.owned[r]}
    if len(tokens) != 1:
        raise WeightSyncError(
            f"{sink.who}: the trainer's ranks named this sync's bytes differently ({len(tokens)} tokens); "
            "a weightsync bug: set up again"
        )
    sink.header = SyncHeader(Mode.DELTA if all(took) else Mode.DENSE, sink.held_token or 0, tokens.pop())
    hand = getattr(sink.sink, "hand_rows", None)
    if callable(hand) and not stages:  # a stage lands at the commit
        hand(half.manifest, sorted(touched))
    return checksums
