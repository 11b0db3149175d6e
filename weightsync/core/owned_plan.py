"""The plan of owner sends: which bytes of each bucket every trainer rank owns and sends.

With owner sends (:mod:`weightsync.transports.owners.plugin`) no rank gathers: rank ``r`` of ``R``
broadcasts, bucket by bucket, only the rows it holds, and every worker puts the R pieces
together. Both sides derive the same plan from the Manifest and an :class:`OwnedLayout`
(one flag per tensor, exchanged once at setup), so nothing but bytes moves per sync.

A tensor is either

- *rows*: ``Shard(0)`` over a 1-D mesh of R ranks, split as ``torch.chunk`` (and FSDP2)
  split it: rank r holds rows ``[r*c, min((r+1)*c, n))`` with ``c = ceil(n / R)``; or
- *whole*: ``Replicate`` or a plain tensor, sent whole by one owner, rank ``index % R``
  (deterministic, and it spreads the replicated tensors over the ranks).

Buckets are consecutive tensors of at most ``buffer_bytes`` wire bytes (or one larger
tensor), as a sharded rank's gathers use. Within a bucket, rank r's *segment* packs its
pieces back to back, each at an offset aligned to the manifest's alignment; a piece of at
least ``inplace_bytes`` (when that is set) travels alone instead, *in place*: straight from
the rank's shard into the worker's rows of the tensor, since a row range is one contiguous
run of bytes on both sides. Per bucket, a group carries the packed segment first, then the
in-place pieces in order.

At setup the ranks agree on the layout before anything is planned: :func:`agreed_layout`,
the first step of both owner transports, asks every rank for its own (:func:`placements`,
answered by a trainer side that :class:`HoldsShards`) and refuses ranks that disagree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from weightsync.core.dtensors import is_dtensor
from weightsync.core.gathering import plan_buckets, row_or_replicated
from weightsync.core.plugin import Opening, Request, TrainerSide
from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.manifest import Manifest


@dataclass(frozen=True, kw_only=True)
class OwnedLayout:
    """How the trainer's ranks hold the model, as far as owner sends need to know."""

    ranks: int
    """R: the trainer's ranks, each the owner of a part of every bucket."""

    rows: tuple[bool, ...]
    """Per manifest tensor: True when it is split by rows over the R ranks, False when whole."""

    def __post_init__(self) -> None:
        if not isinstance(self.ranks, int) or isinstance(self.ranks, bool) or self.ranks < 1:
            raise SettingsError(f"an owned layout needs a positive number of ranks, got {self.ranks!r}")
        object.__setattr__(self, "rows", tuple(self.rows))
        if not all(isinstance(flag, bool) for flag in self.rows):
            raise SettingsError("an owned layout's rows must be one bool per tensor")


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` of tensor ``index``, at ``offset`` in its segment (``nbytes`` long)."""

    index: int
    start: int
    stop: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Segment:
    """One rank's bytes of one bucket."""

    pieces: tuple[Piece, ...]
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    """Consecutive tensors ``indices`` and, per rank, the packed segment and the in-place
    pieces (each at offset 0, alone) it sends of them."""

    indices: range
    segments: tuple[Segment, ...]
    inplace: tuple[tuple[Piece, ...], ...]


def row_span(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` rank ``rank`` holds of a tensor of ``rows`` rows split over ``ranks``."""
    per = -(-rows // ranks)
    start = min(rank * per, rows)
    return start, min(start + per, rows)


def plan(manifest: Manifest, layout: OwnedLayout) -> list[Bucket]:
    """The buckets of one sync and every rank's segment of each (see the module doc)."""
    specs = manifest.specs
    if len(layout.rows) != len(specs):
        raise SettingsError(
            f"the owned layout describes {len(layout.rows)} tensor(s), the manifest {len(specs)}: "
            "the trainer's ranks and the manifest disagree; set up again"
        )
    align = manifest.agreed.alignment
    alone = manifest.agreed.inplace_bytes
    ranks = layout.ranks
    buckets: list[Bucket] = []
    for indices in plan_buckets([s.nbytes for s in specs], manifest.agreed.buffer_bytes):
        pieces: list[list[Piece]] = [[] for _ in range(ranks)]
        inplace: list[list[Piece]] = [[] for _ in range(ranks)]
        sizes = [0] * ranks
        for i in indices:
            spec = specs[i]
            rows = spec.shape[0] if spec.shape else 1
            row_bytes = spec.nbytes // rows if rows else 0
            if layout.rows[i] and spec.shape:
                spans = [(r, *row_span(rows, ranks, r)) for r in range(ranks)]
            else:
                spans = [(i % ranks, 0, rows)]
            if not spec.nbytes:
                spans = [(i % ranks, 0, rows)]  # an empty tensor: one piece of no bytes, so it is handed over
            for r, start, stop in spans:
                nbytes = (stop - start) * row_bytes
                if nbytes == 0 and spec.nbytes:
                    continue
                if alone and nbytes >= alone:
                    inplace[r].append(Piece(i, start, stop, 0, nbytes))
                    continue
                offset = math.ceil(sizes[r] / align) * align
                pieces[r].append(Piece(i, start, stop, offset, nbytes))
                sizes[r] = offset + nbytes
        segments = tuple(Segment(tuple(p), n) for p, n in zip(pieces, sizes))
        buckets.append(Bucket(indices, segments, tuple(tuple(p) for p in inplace)))
    return buckets


def layout_of(party: str, named: Sequence[tuple[str, torch.Tensor]], ranks: int, rank: int) -> OwnedLayout:
    """The :class:`OwnedLayout` of one rank's tensors (``rank`` of ``ranks`` on their mesh):
    ``Shard(0)`` over a 1-D mesh with the rows ``torch.chunk`` gives this rank is split,
    ``Replicate`` and plain tensors are whole; any other layout is refused naming the tensor."""
    rows: list[bool] = []
    for name, t in named:
        if not is_dtensor(t):
            rows.append(False)
            continue
        if not row_or_replicated(t):
            raise SettingsError(
                f"{party}: {name} is laid out as {tuple(t.placements)} over a {t.device_mesh.ndim}-D mesh; "
                "owner sends take Shard(0) over a 1-D mesh, Replicate or plain tensors: use "
                "transport='broadcast' for this trainer (it gathers)"
            )
        split = not t.placements[0].is_replicate() and t.ndim > 0
        if split:
            start, stop = row_span(t.shape[0], ranks, rank)
            local = t.to_local()
            held = local.shape[0] if local.ndim else 0
            if held != stop - start:
                raise SettingsError(
                    f"{party}: {name} holds {held} row(s) of {t.shape[0]}, but an even Shard(0) split over "
                    f"{ranks} ranks gives rank {rank} {stop - start}: owner sends need torch.chunk's split; use "
                    "transport='broadcast' for this trainer (it gathers)"
                )
        rows.append(split)
    return OwnedLayout(ranks=ranks, rows=tuple(rows))


@runtime_checkable
class HoldsShards(Protocol):
    """A trainer side whose ranks hold the model sharded (DTensors) and can say how."""

    def owned_layout(self) -> OwnedLayout:
        """This rank's :class:`OwnedLayout` (:func:`layout_of` its tensors)."""


def agreed_layout(opening: Opening, instead: str) -> OwnedLayout:
    """Every rank's :class:`OwnedLayout` (action ``placements``), refused unless all agree and
    the ranks are the mesh's, in rank order; ``instead``: the transport to suggest."""
    ranks = opening.servers
    laid = opening.step({r: Request(action="placements") for r in ranks}, "describing what each rank holds")
    layout: OwnedLayout = laid[ranks[0]]
    odd = [r for r in ranks if laid[r] != layout]
    if odd or layout.ranks != len(ranks):
        raise SettingsError(
            f"{', '.join(odd) or ranks[0]} hold(s) the model differently from {ranks[0]} "
            f"({layout.ranks} mesh rank(s) for {len(ranks)} trainer rank(s)): every rank must be one rank of one "
            f"mesh, in rank order; use transport={instead!r} (it gathers)"
        )
    return layout


def placements(side: TrainerSide) -> OwnedLayout:
    """The owner transports' first trainer action: this rank's :class:`OwnedLayout`."""
    if not isinstance(side, HoldsShards):
        raise SettingsError(
            f"{side.session.party}: owner sends need the ranks of a sharded (DTensor) trainer, and this one holds "
            "plain tensors; use transport='broadcast'"
        )
    return side.owned_layout()
