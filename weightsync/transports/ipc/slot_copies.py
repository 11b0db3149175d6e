"""The ipc transport's copies into and out of its slots, one kernel launch per chunk.

Packing a chunk is one copy per tensor from the trainer's parameters into typed views of a
slot, and unpacking one copy per tensor from those views into the worker's tensors: on a
GPU one ``copy_`` per tensor costs a launch each and a ramp and a tail in which the memory
system is not saturated (see :mod:`weightsync.mechanisms.batched_copy`). Here each
(chunk, slot) gets a :class:`~weightsync.mechanisms.batched_copy.CopyPlan` built once and
kept while the tensors on the other end stay where they were, and a chunk is then one launch
of the batched kernel plus a ``copy_`` for each piece the kernel cannot take (a cast, a
strided or unaligned tensor, a split tensor whose source is not contiguous in the wire
dtype, a piece the worker's sink wants handed to it).

A plan holds addresses only. The producer's plans depend on the sources' :func:`plan_key`
(the sender hands the same key object over while nothing moved), the consumer's on its
destinations' addresses, shapes, strides and dtypes, both on the slots (fixed for the
session). Any change drops every plan of that side, and that sync copies tensor by tensor as without
the kernel; the plans are made in the next sync that finds the tensors where they were. So
the first sync of a session copies tensor by tensor, the second makes the tables (one
blocking upload per chunk and slot), and tensors that move every sync never pay for tables.

Call order, per sync: ``use = plans.begin(...)`` once, then, when ``use``,
``plans.pack(...)`` / ``plans.unpack(...)`` per chunk on the stream that orders the chunk's
work (else the per-tensor ``pack_chunk`` / ``ChunkUnpacker.unpack``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.core.packing import ChunkUnpacker, as_bytes, pack_piece, typed_view
from weightsync.core.wire.manifest import TensorSpec
from weightsync.core.wire.plan import Chunk, ChunkPiece
from weightsync.mechanisms.batched_copy import BatchedCopier, CopyPlan

#: Per destination: address, shape, strides and dtype, or None (nothing to copy there).
DestinationKey = list[tuple[int, torch.Size, tuple[int, ...], torch.dtype] | None]


def destination_key(destinations: Sequence[torch.Tensor | None]) -> DestinationKey:
    """What a consumer's plans depend on besides the slots (see :func:`plan_key`)."""
    return [None if d is None else (d.data_ptr(), d.size(), d.stride(), d.dtype) for d in destinations]


@dataclass
class ChunkPlan:
    """One chunk's copies through one slot: the kernel's table, and the positions (in
    ``chunk.pieces``) of the pieces copied otherwise, or (unpacking) copied by the kernel."""

    copies: CopyPlan
    others: tuple[int, ...]
    batched: frozenset[int]


def _whole(piece: ChunkPiece, spec: TensorSpec) -> bool:
    return piece.nbytes == spec.nbytes


def _split_bytes(tensor: torch.Tensor, piece: ChunkPiece, spec: TensorSpec) -> torch.Tensor | None:
    """The bytes of a split tensor's piece inside ``tensor`` itself, when they can be read
    or written in place (contiguous, in the wire dtype, of the spec's size); else None."""
    if tensor.dtype != spec.torch_dtype or not tensor.is_contiguous():
        return None
    if tensor.numel() * tensor.element_size() != spec.nbytes:
        return None
    return as_bytes(tensor)[piece.tensor_offset : piece.tensor_offset + piece.nbytes]


def _finish(
    copier: BatchedCopier, pairs: list[tuple[int, torch.Tensor, torch.Tensor]], unpaired: list[int]
) -> ChunkPlan:
    """A plan over ``pairs`` (position, destination, source): the pairs the kernel cannot take
    join ``unpaired``."""
    copies = copier.plan([d for _, d, _ in pairs], [s for _, _, s in pairs], key=[])
    left = {pairs[i][0] for i in copies.leftovers}
    batched = frozenset(p for p, _, _ in pairs if p not in left)
    others = tuple(sorted([*unpaired, *left]))
    # The key of a chunk plan is its owner's (PackPlans / UnpackPlans): the leftovers are
    # reported by position instead, and the plan's own list is emptied so that no caller
    # copies them twice.
    copies.leftovers = []
    return ChunkPlan(copies, others, batched)


class _Plans:
    """One side's chunk plans, per (chunk, slot), valid while its tensors stay where they were."""

    def __init__(self, copier: BatchedCopier, specs: Sequence[TensorSpec]) -> None:
        self.copier = copier
        self.specs = specs
        self._plans: dict[tuple[int, int], ChunkPlan] = {}
        self._key: object = None
        #: Plans built since this object was made (instrumentation and tests).
        self.built = 0

    def _keep(self, key: object) -> bool:
        """True when ``key`` is last sync's; otherwise drop every plan, remember ``key``, False."""
        if key is self._key or key == self._key:
            return True
        self._plans.clear()
        self._key = key
        return False

    def clear(self) -> None:
        """Drop every plan (the slots they point into are going away)."""
        self._plans.clear()
        self._key = None


class PackPlans(_Plans):
    """The producer's plans: chunk pieces from the trainer's tensors into the slots."""

    def begin(self, key: object) -> bool:
        """Start a sync whose sources have :func:`plan_key` ``key``; True when it packs
        through the plans. A different key than last sync's (a tensor moved, or changed
        shape, strides or dtype) drops every plan and answers False: the caller packs this
        sync tensor by tensor, so sources that move every sync never pay for tables."""
        return self._keep(key)

    def _plan(self, chunk: Chunk, slot: int, buffer: torch.Tensor, sources: Sequence[torch.Tensor]) -> ChunkPlan:
        pairs: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        unpaired: list[int] = []
        for position, piece in enumerate(chunk.pieces):
            if piece.nbytes == 0:
                continue
            spec, source = self.specs[piece.spec_index], sources[piece.spec_index]
            if _whole(piece, spec):
                if source.shape == torch.Size(spec.shape):
                    pairs.append((position, typed_view(buffer, piece.buffer_offset, spec), source))
                else:
                    unpaired.append(position)
                continue
            flat = _split_bytes(source, piece, spec)
            if flat is None:
                unpaired.append(position)
            else:
                pairs.append((position, buffer[piece.buffer_offset : piece.buffer_offset + piece.nbytes], flat))
        self.built += 1
        return _finish(self.copier, pairs, unpaired)

    def pack(
        self,
        chunk: Chunk,
        slot: int,
        buffer: torch.Tensor,
        sources: Sequence[torch.Tensor],
        stream: torch.cuda.Stream | None,
    ) -> None:
        """Queue ``chunk``'s copies from ``sources`` into ``buffer`` (slot ``slot``) on
        ``stream``, which must also be the current stream (the other pieces' ``copy_``)."""
        plan = self._plans.get((chunk.index, slot))
        if plan is None:
            plan = self._plans[(chunk.index, slot)] = self._plan(chunk, slot, buffer, sources)
        self.copier.launch(plan.copies, stream)
        for position in plan.others:
            piece = chunk.pieces[position]
            pack_piece(piece, self.specs[piece.spec_index], sources[piece.spec_index], buffer)


class UnpackPlans(_Plans):
    """A consumer's plans: chunk pieces out of the slots into the worker's tensors."""

    def begin(self, destinations: Sequence[torch.Tensor | None]) -> bool:
        """Start a sync into ``destinations`` (per spec; None: handed to the sink); True when
        it unpacks through the plans. Any change of address, shape, strides or dtype since
        the last sync drops every plan and answers False (this sync unpacks tensor by
        tensor, as for :meth:`PackPlans.begin`)."""
        return self._keep(destination_key(destinations))

    def _plan(self, chunk: Chunk, buffer: torch.Tensor, destinations: Sequence[torch.Tensor | None]) -> ChunkPlan:
        pairs: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        for position, piece in enumerate(chunk.pieces):
            destination = destinations[piece.spec_index]
            if piece.nbytes == 0 or destination is None:
                continue
            spec = self.specs[piece.spec_index]
            if _whole(piece, spec):
                if destination.shape == torch.Size(spec.shape):
                    pairs.append((position, destination, typed_view(buffer, piece.buffer_offset, spec)))
                continue
            flat = _split_bytes(destination, piece, spec)
            if flat is not None:
                pairs.append((position, flat, buffer[piece.buffer_offset : piece.buffer_offset + piece.nbytes]))
        self.built += 1
        return _finish(self.copier, pairs, [])

    def unpack(
        self,
        chunk: Chunk,
        slot: int,
        buffer: torch.Tensor,
        destinations: Sequence[torch.Tensor | None],
        unpacker: ChunkUnpacker,
        stream: torch.cuda.Stream | None,
    ) -> list[tuple[str, torch.Tensor]]:
        """Queue ``chunk``'s copies out of ``buffer`` (slot ``slot``) on ``stream`` (the
        current stream); ``unpacker`` (made over the same ``destinations``) copies or hands
        out the rest. Returns what it hands out."""
        plan = self._plans.get((chunk.index, slot))
        if plan is None:
            plan = self._plans[(chunk.index, slot)] = self._plan(chunk, buffer, destinations)
        self.copier.launch(plan.copies, stream)
        return unpacker.unpack(chunk, buffer, copied=plan.batched)
