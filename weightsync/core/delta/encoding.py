"""How one tensor of a delta sync travels: its kind, its count, and its payload's layout.

Every tensor of a delta sync is one of four kinds, chosen by the trainer per tensor and
told to every receiver in the sync's header (:mod:`weightsync.core.delta.header`) as one
int64 *code* (``count * 4 + kind``), from which both sides derive the same payload size
and layout:

* ``UNCHANGED``: no element's bit pattern changed; nothing travels.
* ``DENSE``: the tensor's wire bytes, as a dense sync sends them.
* ``INDICES``: the ``count`` changed elements' flat indices (int32, or int64 for a tensor
  of 2**31 elements or more), each once, in any order (ascending from a CPU; in the GPU
  kernel's order from a GPU), then their new values in the same order.
* ``BITMASK``: one bit per element (element ``i`` is bit ``i % 8`` of byte ``i // 8``),
  set where it changed, then the ``count`` new values in index order.

Values are the elements' bit patterns (the wire dtype's bytes), never arithmetic
differences, so applying a delta is bit-exact for every dtype: NaN payloads, -0.0 and
+0.0, denormals and integers alike. Values start at a 16-byte aligned offset inside the
payload, so a typed view of them is legal for every dtype (complex128 included).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from weightsync.core.wire.errors import ManifestError
from weightsync.core.wire.manifest import TensorSpec
from weightsync.core.wire.plan import align_up

#: Offsets inside a payload are aligned to this many bytes (the widest element, complex128).
PAYLOAD_ALIGN = 16
_INT32_LIMIT = 2**31 - 1


class Kind(enum.IntEnum):
    UNCHANGED = 0
    DENSE = 1
    INDICES = 2
    BITMASK = 3


#: The integer dtype whose elements have the bit pattern of a wire element of each size
#: (16-byte elements, complex128, are compared as pairs of int64).
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64, 16: torch.int64}


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype :func:`bits_of` views a tensor of ``dtype`` as."""
    return _BITS[dtype.itemsize]


def bits_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat integer view of a contiguous tensor's bit patterns: one integer per element,
    or for 16-byte elements a ``[numel, 2]`` int64 view (one row per element)."""
    size = tensor.element_size()
    flat = tensor.reshape(-1)
    if tensor.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    view = flat.view(_BITS[size])
    return view.view(-1, 2) if size == 16 else view


def index_dtype(numel: int) -> torch.dtype:
    """int32 for tensors whose every flat index fits it, int64 beyond."""
    return torch.int32 if numel <= _INT32_LIMIT else torch.int64


def index_bytes(numel: int) -> int:
    return 4 if numel <= _INT32_LIMIT else 8


def encode_code(kind: Kind, count: int) -> int:
    return count * 4 + int(kind)


def decode_code(code: int, spec: TensorSpec) -> tuple[Kind, int]:
    """(kind, count) of a header's code for ``spec``; refuses, naming the tensor, a code no
    trainer could have written for it (an out-of-step or corrupted header)."""
    if code < 0:
        raise ManifestError(f"delta header: tensor {spec.name!r} has a negative code {code}")
    kind, count = Kind(code & 3), code >> 2
    if kind is Kind.UNCHANGED:
        fits = count == 0
    elif kind is Kind.DENSE:
        fits = count == spec.numel
    else:
        fits = 0 < count <= spec.numel
    if not fits:
        raise ManifestError(
            f"delta header: tensor {spec.name!r} ({spec.numel} elements) says {kind.name} with {count} element(s), "
            "which no trainer sends; the two sides are out of step (set up again)"
        )
    return kind, count


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the parts of one tensor's payload lie: the positions (indices or mask) at 0,
    the values at ``values_offset``, ``nbytes`` in all."""

    kind: Kind
    count: int
    positions_nbytes: int
    values_offset: int
    nbytes: int


def layout(spec: TensorSpec, kind: Kind, count: int) -> Layout:
    """The payload layout of ``spec`` sent as ``kind`` with ``count`` changed elements."""
    itemsize = spec.torch_dtype.itemsize
    if kind is Kind.UNCHANGED:
        return Layout(kind, 0, 0, 0, 0)
    if kind is Kind.DENSE:
        return Layout(kind, spec.numel, 0, 0, spec.nbytes)
    positions = count * index_bytes(spec.numel) if kind is Kind.INDICES else math.ceil(spec.numel / 8)
    offset = align_up(positions, PAYLOAD_ALIGN)
    return Layout(kind, count, positions, offset, offset + count * itemsize)


def best_kind(spec: TensorSpec, count: int) -> Kind:
    """The smallest way to send ``spec`` with ``count`` changed elements (dense on a tie:
    it costs neither an encoding nor an apply)."""
    if count == 0:
        return Kind.UNCHANGED
    sizes = {kind: layout(spec, kind, count).nbytes for kind in (Kind.INDICES, Kind.BITMASK)}
    kind = min(sizes, key=lambda k: (sizes[k], k))
    return kind if sizes[kind] < spec.nbytes else Kind.DENSE
