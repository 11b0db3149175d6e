"""Chunk planning, packing into preallocated buffers, and unpacking out of them.

Both sides compute the same chunk plan from the specs alone
(:func:`weightsync.core.wire.manifest.plan_chunks`), so a sync sends nothing but bytes. Every
piece starts at an aligned offset, which keeps a dtype
view of any slice legal (an odd-sized fp16 tensor followed by an fp32 one is the classic
failure of unaligned packing). A tensor larger than the buffer is split across consecutive
chunks and put back together on the receiving side.

Packing writes each source tensor straight into its slice of a buffer allocated once by the
caller (``copy_`` handles any strides and casts to the wire dtype on the way); nothing is
concatenated and nothing is allocated per chunk.

vLLM's back-to-back layout (no alignment, the drop-in :mod:`weightsync.packed_tensor` and its
``pack_tensors`` / ``unpack_tensor``) goes through :func:`write_bytes_at` and
:func:`bytes_as`, which keep a typed view legal at any offset.

This module imports no transport and no Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

import torch

from weightsync.core.wire.errors import ManifestError
from weightsync.core.wire.manifest import TensorSpec
from weightsync.core.wire.plan import Chunk, ChunkPiece


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (0-d and empty tensors included)."""
    if not tensor.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    return tensor.reshape(-1).view(torch.uint8)


def typed_view(buffer: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    """The slice of ``buffer`` at ``offset`` seen as ``spec``'s dtype and shape."""
    return buffer[offset : offset + spec.nbytes].view(spec.torch_dtype).view(spec.shape)


def pack_chunk(
    chunk: Chunk,
    specs: Sequence[TensorSpec],
    sources: Sequence[torch.Tensor],
    buffer: torch.Tensor,
) -> None:
    """Copy every piece of ``chunk`` from ``sources`` (aligned with ``specs``) into ``buffer``.

    A whole tensor is copied with one ``copy_`` into a typed view of its slice, which reads
    any strides and casts to the wire dtype. A piece of a split tensor copies raw bytes, so
    its source must be (or is made) contiguous in the wire dtype.
    """
    for piece in chunk.pieces:
        pack_piece(piece, specs[piece.spec_index], sources[piece.spec_index], buffer)


def pack_piece(piece: ChunkPiece, spec: TensorSpec, source: torch.Tensor, buffer: torch.Tensor) -> None:
    """Copy one piece of a chunk from its tensor ``source`` into ``buffer`` (see :func:`pack_chunk`)."""
    if piece.nbytes == 0:
        return
    if piece.nbytes == spec.nbytes:
        typed_view(buffer, piece.buffer_offset, spec).copy_(source)
    else:
        flat = as_bytes(source.to(spec.torch_dtype).contiguous())
        buffer[piece.buffer_offset : piece.buffer_offset + piece.nbytes].copy_(
            flat[piece.tensor_offset : piece.tensor_offset + piece.nbytes]
        )


def byte_checksum(buffer: torch.Tensor, nbytes: int) -> int:
    """A cheap checksum of ``buffer[:nbytes]``, computed where the buffer lives.

    The wrapping sum of the bytes read as 64-bit words (plus the trailing bytes): any single
    flipped bit changes it, and it allocates nothing the size of the chunk. ``buffer`` must
    start 8-byte aligned, as every buffer weightsync allocates does.
    """
    words = nbytes // 8 * 8
    total = int(buffer[:words].view(torch.int64).sum().item()) if words else 0
    if nbytes > words:
        total += int(buffer[words:nbytes].sum(dtype=torch.int64).item())
    return total & 0xFFFFFFFFFFFFFFFF


def contiguous_checksum(tensor: torch.Tensor) -> int:
    """:func:`byte_checksum` of a contiguous tensor's own bytes (an in-place broadcast chunk)."""
    flat = as_bytes(tensor)
    if flat.storage_offset() % 8:
        flat = flat.clone()
    return byte_checksum(flat, flat.numel())


def word_sum(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`byte_checksum` of one tensor's bytes as a 0-d int64 tensor on its device
    (nothing is read back to the host)."""
    flat = as_bytes(tensor.detach().contiguous())
    words = flat.numel() // 8 * 8
    total = flat.new_zeros((), dtype=torch.int64)
    if words:
        total = total + flat[:words].view(torch.int64).sum()
    if flat.numel() > words:
        total = total + flat[words:].sum(dtype=torch.int64)
    return total


def tensor_checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """:func:`word_sum` of each tensor, read back to the host once for all.

    The per-tensor check of the direct transport and of ``WeightSync.verify``: a 64-bit
    additive checksum, computed where the tensors live; it catches corrupted bytes, not a
    reordering of whole 8-byte words.
    """
    return read_checksums([word_sum(t) for t in tensors])


def read_checksums(sums: Sequence[torch.Tensor]) -> list[int]:
    """Per-tensor :func:`word_sum` results read back to the host in one transfer, as unsigned."""
    if not sums:
        return []
    return [int(v) & 0xFFFFFFFFFFFFFFFF for v in torch.stack(list(sums)).cpu().tolist()]


DestinationFn = Callable[[int], "torch.Tensor | None"]


class ChunkUnpacker:
    """Unpacks chunks into destinations, or into tensors handed to a sink.

    ``destination(spec_index)`` returns a contiguous tensor of the spec's dtype and shape to
    copy into (one copy, from the buffer straight to the parameter), or None when the sink
    wants the tensor handed to it. Handed-out tensors are views into the buffer when
    ``keeps_references`` is False (the sink must copy before the next chunk), and clones
    otherwise. Split tensors are reassembled across chunks; call :meth:`finish` after the
    last chunk to check that nothing was left half-delivered.
    """

    def __init__(
        self,
        specs: Sequence[TensorSpec],
        destination: DestinationFn,
        keeps_references: bool,
    ) -> None:
        self._specs = specs
        self._destination = destination
        self._keeps_references = keeps_references
        self._partial: dict[int, torch.Tensor] = {}
        self._received: dict[int, int] = {}

    def unpack(self, chunk: Chunk, buffer: torch.Tensor, copied: Container[int] = ()) -> list[tuple[str, torch.Tensor]]:
        """Copy or hand out every piece of ``chunk`` from ``buffer``; the pieces at positions
        in ``copied`` (into their destinations) were copied by the caller already and are only
        counted towards their tensors."""
        handed: list[tuple[str, torch.Tensor]] = []
        for position, piece in enumerate(chunk.pieces):
            spec = self._specs[piece.spec_index]
            if position in copied:
                if piece.nbytes != spec.nbytes:
                    self._count(piece, spec)
                continue
            dest = self._destination(piece.spec_index)
            if piece.nbytes == spec.nbytes:
                view = typed_view(buffer, piece.buffer_offset, spec)
                if dest is not None:
                    dest.copy_(view)
                else:
                    handed.append((spec.name, view.clone() if self._keeps_references else view))
                continue
            target = dest
            if target is None:
                target = self._partial.get(piece.spec_index)
                if target is None:
                    target = torch.empty(spec.shape, dtype=spec.torch_dtype, device=buffer.device)
                    self._partial[piece.spec_index] = target
            src = buffer[piece.buffer_offset : piece.buffer_offset + piece.nbytes]
            as_bytes(target)[piece.tensor_offset : piece.tensor_offset + piece.nbytes].copy_(src)
            if self._count(piece, spec):
                assembled = self._partial.pop(piece.spec_index, None)
                if assembled is not None:
                    handed.append((spec.name, assembled))
        return handed

    def _count(self, piece: ChunkPiece, spec: TensorSpec) -> bool:
        """Count a split tensor's piece as received; True once the whole tensor is."""
        got = self._received.get(piece.spec_index, 0) + piece.nbytes
        if got < spec.nbytes:
            self._received[piece.spec_index] = got
            return False
        self._received.pop(piece.spec_index, None)
        return True

    def finish(self) -> None:
        if self._received:
            names = [self._specs[i].name for i in self._received]
            self._received.clear()
            self._partial.clear()
            raise ManifestError(f"transfer ended with tensors only partly received: {names}")


def _view_is_legal(piece: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a uint8 slice may be viewed as ``dtype`` in place (its start is a multiple of
    the element size; torch's allocations and mappings start at least 64-byte aligned)."""
    return (piece.storage_offset() * piece.element_size()) % dtype.itemsize == 0


def write_bytes_at(buffer: torch.Tensor, offset: int, tensor: torch.Tensor) -> int:
    """Copy ``tensor``'s bytes into the uint8 ``buffer`` at ``offset``; returns how many.

    Where the slice may be viewed as the tensor's dtype, one ``copy_`` into that view reads
    any strides directly; at an offset the dtype cannot start at, the bytes of a contiguous
    copy are copied instead. Either way the bytes written are the tensor's, bit for bit.
    """
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return 0
    dest = buffer[offset : offset + nbytes]
    if _view_is_legal(dest, tensor.dtype):
        dest.view(tensor.dtype).view(tensor.shape).copy_(tensor)
    else:
        dest.copy_(as_bytes(tensor.resolve_conj().resolve_neg().contiguous()))
    return nbytes


def bytes_as(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """``buffer[offset:offset + nbytes]`` seen as ``dtype`` and ``shape``.

    A view where the dtype may start at ``offset``, else a copy (a view there fails with
    "storage_offset must be divisible", vLLM PR 57665). The caller checks that ``nbytes``
    matches the shape.
    """
    piece = buffer[offset : offset + nbytes]
    if not _view_is_legal(piece, dtype):
        piece = piece.clone()
    return piece.view(dtype).view(tuple(shape))
