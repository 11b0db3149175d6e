"""Chunk planning, packing into preallocated buffers, and unpacking out of them.

Both sides compute the same chunk plan from the specs alone
(:func:`weightsync.wire.manifest.plan_chunks`), so a sync sends nothing but bytes. Every
piece starts at an aligned offset, which keeps a dtype
view of any slice legal (an odd-sized fp16 tensor followed by an fp32 one is the classic
failure of unaligned packing). A tensor larger than the buffer is split across consecutive
chunks and put back together on the receiving side.

Packing writes each source tensor straight into its slice of a buffer allocated once by the
caller (``copy_`` handles any strides and casts to the wire dtype on the way); nothing is
concatenated and nothing is allocated per chunk.

:func:`pack_tensors` and :func:`unpack_tensor` keep the call signatures of vLLM's
``packed_tensor`` helpers for code being ported; the engines here do not use them.

This module imports no transport and no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from weightsync.wire.dtypes import dtype_from_name
from weightsync.wire.errors import ManifestError
from weightsync.wire.manifest import Chunk, TensorSpec


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
        if piece.nbytes == 0:
            continue
        spec = specs[piece.spec_index]
        source = sources[piece.spec_index]
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
    if not tensors:
        return []
    sums = torch.stack([word_sum(t) for t in tensors]).cpu()
    return [int(v) & 0xFFFFFFFFFFFFFFFF for v in sums.tolist()]


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

    def unpack(self, chunk: Chunk, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        handed: list[tuple[str, torch.Tensor]] = []
        for piece in chunk.pieces:
            spec = self._specs[piece.spec_index]
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
            got = self._received.get(piece.spec_index, 0) + piece.nbytes
            if got < spec.nbytes:
                self._received[piece.spec_index] = got
                continue
            self._received.pop(piece.spec_index, None)
            assembled = self._partial.pop(piece.spec_index, None)
            if assembled is not None:
                handed.append((spec.name, assembled))
        return handed

    def finish(self) -> None:
        if self._received:
            names = [self._specs[i].name for i in self._received]
            self._received.clear()
            self._partial.clear()
            raise ManifestError(f"transfer ended with tensors only partly received: {names}")


# ---------------------------------------------------------------------------------------
# Call-compatible helpers for code ported from vLLM's packed_tensor module.


@dataclass
class PackedChunk:
    """Tensors packed back to back into one uint8 tensor, with what is needed to unpack."""

    packed_tensor: torch.Tensor
    names: list[str]
    shapes: list[list[int]]
    dtypes: list[torch.dtype]
    tensor_sizes: list[int]


def pack_tensors(
    iterator: Iterator[tuple[str, torch.Tensor]],
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
    buffer_size_bytes: int,
    tensor_list: list[torch.Tensor] | None = None,
    current_size: int = 0,
) -> PackedChunk | None:
    """Take (name, tensor) pairs until more than ``buffer_size_bytes`` are held, and pack them.

    Same call and meaning as vLLM's helper: ``post_iter_func`` maps each pair to the tensor
    to send; packing stops after the tensor that takes the running total (starting at
    ``current_size``, counting ``tensor_list``'s bytes first) past ``buffer_size_bytes``,
    or when the iterator ends; None when nothing was taken. The result is packed back to
    back, as vLLM does; use :func:`unpack_tensor` (which copes with unaligned slices).
    """
    held = list(tensor_list or [])
    names: list[str] = []
    shapes: list[list[int]] = []
    dtypes: list[torch.dtype] = []
    sizes: list[int] = []
    total = current_size
    for item in iterator:
        tensor = post_iter_func(item)
        held.append(tensor)
        names.append(item[0])
        shapes.append(list(tensor.shape))
        dtypes.append(tensor.dtype)
        sizes.append(tensor.numel() * tensor.element_size())
        total += sizes[-1]
        if total > buffer_size_bytes:
            break
    if not held:
        return None
    device = held[0].device
    packed = torch.empty(sum(t.numel() * t.element_size() for t in held), dtype=torch.uint8, device=device)
    offset = 0
    for tensor in held:
        n = tensor.numel() * tensor.element_size()
        if n:
            packed[offset : offset + n].copy_(as_bytes(tensor.contiguous()))
        offset += n
    return PackedChunk(packed, names, shapes, dtypes, sizes)


def unpack_tensor(
    packed_tensor: torch.Tensor,
    names: list[str],
    shapes: list[list[int]],
    dtypes: list[torch.dtype],
    tensor_sizes: list[int],
) -> list[tuple[str, torch.Tensor]]:
    """Split a back-to-back packed uint8 tensor into named tensors.

    Results are views of ``packed_tensor`` where the slice is aligned for its dtype, and
    copies where it is not (vLLM's version fails there with "storage_offset must be
    divisible"). Clone the views before the packed storage is reused.
    """
    if not (len(names) == len(shapes) == len(dtypes) == len(tensor_sizes)):
        raise ValueError(
            f"names, shapes, dtypes and tensor_sizes must have equal lengths, got "
            f"{len(names)}, {len(shapes)}, {len(dtypes)}, {len(tensor_sizes)}"
        )
    out = []
    offset = 0
    for name, shape, dtype, size in zip(names, shapes, dtypes, tensor_sizes):
        if isinstance(dtype, str):
            dtype = dtype_from_name(dtype)
        expected = math.prod(shape) * dtype.itemsize
        if expected != size:
            raise ValueError(
                f"tensor {name!r}: shape {list(shape)} of {dtype} needs {expected} bytes, but tensor_sizes says {size}"
            )
        piece = packed_tensor[offset : offset + size]
        if (piece.storage_offset() * piece.element_size()) % dtype.itemsize:
            piece = piece.clone()
        out.append((name, piece.view(dtype).view(shape)))
        offset += size
    return out
