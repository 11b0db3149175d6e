"""The chunk plans: where every tensor's bytes go in the packing buffers, derived from the
specs alone, so both sides of a transfer compute the same plan and a sync sends only bytes.

:func:`plan_chunks` packs every tensor (ipc slots); :func:`plan_broadcast` gives the tensors
of at least ``inplace_bytes`` a chunk of their own (in place) and packs the rest. The
:class:`~weightsync.core.wire.manifest.Manifest` holds both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class TensorSpec(Protocol):
    """What a plan reads of a tensor's spec (:class:`weightsync.core.wire.manifest.TensorSpec`)."""

    @property
    def nbytes(self) -> int: ...


def align_up(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


@dataclass(frozen=True, slots=True)
class ChunkPiece:
    """A contiguous byte range of one tensor placed at ``buffer_offset`` in a chunk.

    ``tensor_offset`` is the byte offset inside the tensor's own contiguous bytes; a piece
    with ``tensor_offset == 0`` and ``nbytes`` equal to the tensor's size is the whole
    tensor, which is the common case. Tensors larger than the buffer span several chunks.
    """

    spec_index: int
    tensor_offset: int
    buffer_offset: int
    nbytes: int

    def __reduce__(self) -> tuple[type[ChunkPiece], tuple[int, int, int, int]]:
        return ChunkPiece, (self.spec_index, self.tensor_offset, self.buffer_offset, self.nbytes)


@dataclass(frozen=True, slots=True)
class Chunk:
    """The contents of one buffer fill: pieces in order and the bytes actually used.

    An ``inplace`` chunk (broadcast plans only) is one whole tensor sent by its own
    collective, from the trainer's tensor into the worker's: one piece, offset 0.
    """

    index: int
    pieces: tuple[ChunkPiece, ...]
    nbytes: int
    inplace: bool = False

    def __reduce__(self) -> tuple[type[Chunk], tuple[int, tuple[ChunkPiece, ...], int, bool]]:
        return Chunk, (self.index, self.pieces, self.nbytes, self.inplace)


def plan_chunks(
    specs: Sequence[TensorSpec], buffer_bytes: int, alignment: int, sizes: Sequence[int] | None = None
) -> tuple[Chunk, ...]:
    """Assign every tensor's bytes to (chunk, offset) pairs, deterministically.

    ``sizes``: the specs' ``nbytes``, when the caller has them already.

    Tensors are placed in spec order at aligned offsets. A tensor that does not fit in what
    is left of the current buffer, but fits in an empty one, starts a new chunk rather than
    being split; only a tensor larger than the whole buffer is split, filling whole buffers
    in turn. Zero-byte tensors take a zero-length piece so that every tensor is delivered.
    """
    chunks: list[Chunk] = []
    pieces: list[ChunkPiece] = []
    cursor = 0

    def flush() -> None:
        nonlocal pieces, cursor
        used = max((p.buffer_offset + p.nbytes for p in pieces), default=0)
        chunks.append(Chunk(index=len(chunks), pieces=tuple(pieces), nbytes=used))
        pieces, cursor = [], 0

    for index, size in enumerate(sizes if sizes is not None else [spec.nbytes for spec in specs]):
        if size == 0:
            pieces.append(ChunkPiece(index, 0, min(align_up(cursor, alignment), buffer_bytes), 0))
            continue
        done = 0
        while done < size:
            start = align_up(cursor, alignment)
            space = buffer_bytes - start
            left = size - done
            if pieces and (space <= 0 or (left > space and left <= buffer_bytes)):
                flush()
                continue
            take = min(space, left)
            pieces.append(ChunkPiece(index, done, start, take))
            cursor = start + take
            done += take
    if pieces:
        flush()
    return tuple(chunks)


def plan_broadcast(
    specs: Sequence[TensorSpec], buffer_bytes: int, alignment: int, inplace_bytes: int
) -> tuple[Chunk, ...]:
    """The broadcast plan: every tensor of at least ``inplace_bytes`` (0: none) is an
    in-place chunk of its own; the runs of smaller tensors between them are packed as
    :func:`plan_chunks` packs them. Chunks follow spec order, so the trainer reads its
    tensors in manifest order (a sharded source gathers bucket by bucket in that order).
    """
    if inplace_bytes <= 0:
        return plan_chunks(specs, buffer_bytes, alignment)
    plan: list[Chunk] = []
    run: list[int] = []

    def flush() -> None:
        for chunk in plan_chunks([specs[i] for i in run], buffer_bytes, alignment):
            pieces = tuple(
                ChunkPiece(run[p.spec_index], p.tensor_offset, p.buffer_offset, p.nbytes) for p in chunk.pieces
            )
            plan.append(Chunk(index=len(plan), pieces=pieces, nbytes=chunk.nbytes))
        run.clear()

    for index, spec in enumerate(specs):
        if spec.nbytes and spec.nbytes >= inplace_bytes:
            flush()
            piece = ChunkPiece(index, 0, 0, spec.nbytes)
            plan.append(Chunk(index=len(plan), pieces=(piece,), nbytes=spec.nbytes, inplace=True))
        else:
            run.append(index)
    flush()
    return tuple(plan)
