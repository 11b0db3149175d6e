"""The chunks of :mod:`weightsync.packed_tensor`: vLLM's boundary rule, packing and unpacking.

Import these names from :mod:`weightsync.packed_tensor`; this module exists so that neither
file grows past one job. Both sides of a packed transfer cut chunks by vLLM's rule (take
tensors until their running total exceeds ``buffer_size_bytes``: :func:`take`) and lay each
chunk's bytes back to back, with no padding (:func:`pack_into`); :func:`pack_tensors` and
:func:`unpack_tensor` are vLLM's two public functions for that, with the differences
:mod:`weightsync.compat.packed_tensor` lists.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from weightsync.compat.packed_ipc import check_sizes
from weightsync.core.packing import as_bytes, bytes_as, write_bytes_at
from weightsync.core.wire import dtype_from_name


@dataclass
class PackedChunk:
    """Tensors packed back to back into one uint8 tensor, with what is needed to unpack them."""

    packed_tensor: torch.Tensor
    names: list[str]
    shapes: list[list[int]]
    dtypes: list[torch.dtype]
    tensor_sizes: list[int]


@dataclass
class Taken:
    """What one chunk took from the iterator, before it is packed."""

    tensors: list[torch.Tensor] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)


def take(
    iterator: Iterator[tuple[str, torch.Tensor]],
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
    buffer_size_bytes: int,
    current_size: int,
) -> Taken:
    """Take items until the running total exceeds ``buffer_size_bytes`` (vLLM's boundary rule)."""
    taken = Taken()
    total = current_size
    for item in iterator:
        tensor = post_iter_func(item)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"post_iter_func returned {type(tensor).__name__} for tensor {item[0]!r}, not a Tensor")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > buffer_size_bytes:
            # The opening words are vLLM's, so warning filters written against its module still match.
            warnings.warn(
                f"Tensor '{item[0]}' has size {nbytes} bytes, which exceeds buffer_size_bytes={buffer_size_bytes}; "
                f"it goes in one oversize chunk (raise buffer_size_bytes to at least {nbytes} to keep chunks bounded)",
                UserWarning,
                stacklevel=3,
            )
        taken.tensors.append(tensor)
        taken.names.append(item[0])
        taken.shapes.append(list(tensor.shape))
        taken.dtypes.append(tensor.dtype)
        taken.sizes.append(nbytes)
        total += nbytes
        if total > buffer_size_bytes:
            break
    return taken


def pack_into(buffer: torch.Tensor, offset: int, tensors: list[torch.Tensor], stream: Any = None) -> int:
    """Write ``tensors`` back to back into ``buffer`` from ``offset``; the offset after them.
    ``stream``: the CUDA stream that reads them (each is recorded on it)."""
    for tensor in tensors:
        if stream is not None and tensor.is_cuda:
            tensor.record_stream(stream)  # read on the slot stream: keep it from being reused before
        offset += write_bytes_at(buffer, offset, tensor)
    return offset


def pack_tensors(
    iterator: Iterator[tuple[str, torch.Tensor]],
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
    buffer_size_bytes: int,
    tensor_list: list[torch.Tensor] | None = None,
    current_size: int = 0,
) -> PackedChunk | None:
    """Take (name, tensor) pairs until more than ``buffer_size_bytes`` are held, and pack them.

    ``post_iter_func`` maps each pair to the tensor to send. Taking stops after the tensor
    that takes the running total (starting at ``current_size``) past ``buffer_size_bytes``,
    or when the iterator ends; None when nothing was taken. ``tensor_list`` holds tensors
    already taken by the caller: they are packed first (their names are the caller's to
    keep) and the new tensors' bytes are appended to it, as in vLLM. The result is one
    uint8 tensor on the first tensor's device, bytes back to back.
    """
    taken = take(iterator, post_iter_func, buffer_size_bytes, current_size)
    held = list(tensor_list or [])
    if tensor_list is not None:
        tensor_list.extend(as_bytes(t.contiguous()) for t in taken.tensors)
    everything = held + taken.tensors
    if not everything:
        return None
    total = sum(t.numel() * t.element_size() for t in everything)
    packed = torch.empty(total, dtype=torch.uint8, device=everything[0].device)
    pack_into(packed, 0, everything)
    return PackedChunk(packed, taken.names, taken.shapes, taken.dtypes, taken.sizes)


def dtype_of(dtype: torch.dtype | str) -> torch.dtype:
    """A dtype, or a dtype's name resolved through the allow-list."""
    return dtype_from_name(dtype) if isinstance(dtype, str) else dtype


def unpack_tensor(
    packed_tensor: torch.Tensor,
    names: list[str],
    shapes: list[list[int]],
    dtypes: list[torch.dtype],
    tensor_sizes: list[int],
) -> list[tuple[str, torch.Tensor]]:
    """Split a back-to-back packed uint8 tensor into named tensors.

    Results are views of ``packed_tensor`` where the slice may start its dtype, and copies
    where it may not; clone the views before the packed storage is reused. A dtype given as
    a name goes through the allow-list.
    """
    resolved = [dtype_of(d) for d in dtypes]
    check_sizes(names, shapes, resolved, tensor_sizes)
    if sum(tensor_sizes) > packed_tensor.numel():
        raise ValueError(
            f"tensor_sizes add up to {sum(tensor_sizes)} bytes, the packed tensor has {packed_tensor.numel()}"
        )
    out = []
    offset = 0
    for name, shape, dtype, size in zip(names, shapes, resolved, tensor_sizes):
        out.append((name, bytes_as(packed_tensor, offset, size, dtype, shape)))
        offset += size
    return out
