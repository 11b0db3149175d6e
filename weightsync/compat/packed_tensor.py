"""A drop-in for vLLM's ``vllm.distributed.weight_transfer.packed_tensor``, wire-compatible with it.

Code written against vLLM's module runs by changing the import to ``weightsync.packed_tensor``:
the same names and call signatures. The broadcast producer and consumer derive chunk
boundaries as vLLM's do (take tensors until their running total exceeds
``buffer_size_bytes``; the bytes back to back, no padding), so a weightsync producer feeds
vLLM's consumer and the other way round. ``group`` is anything with
``broadcast(tensor, src=...)``: vLLM's ``PyNcclCommunicator``, or
:class:`~weightsync.mechanisms.groups.GlooGroup` (a ``torch.distributed`` gloo group, CPU) and
:class:`~weightsync.mechanisms.groups.CommunicatorGroup` (weightsync's gloo or NCCL
communicator), both exported here. Call order, on every rank at once::

    packed_nccl_broadcast_producer(model.named_parameters(), group, 0, lambda item: item[1])
    packed_nccl_broadcast_consumer(iter(meta), group, 0, model.load_weights, device="cuda:0")

where ``meta`` is ``(name, (shape, dtype))`` per tensor, in the producer's order, with the
shapes and dtypes of what ``post_iter_func`` returns.

Behaviour that differs from vLLM's module (each is a bug fix or an addition). With the
default arguments the broadcasts are vLLM's byte for byte: the same collectives, of the
same sizes, holding the same bytes, at the same chunk boundaries (the tests record both
modules' broadcasts and compare them, and feed each module's consumer the other's producer):

- Chunk metadata records the dtype and shape of the tensor actually packed, after
  ``post_iter_func``; vLLM records the original tensor's, so a cast in ``post_iter_func``
  (fp32 -> bf16) unpacked the bf16 bytes as fp32.
- A slice at an offset its dtype cannot start at (an odd-sized fp16 tensor followed by an
  fp32 one) is copied out instead of viewed; vLLM fails there ("storage_offset must be
  divisible", vLLM PR 57665). Everything else unpacks as views, as in vLLM.
- 0-d tensors pack (vLLM's ``view(torch.uint8)`` refuses a 0-d tensor wider than a byte).
- An empty iterator sends nothing, allocates nothing and returns (vLLM's IPC producer
  allocated and exported a whole buffer first).
- The IPC producer also yields a final chunk whose tensors are all zero bytes (vLLM
  dropped it, so those tensors were never delivered).
- Dtype names from the wire (``PackedIpcChunk.dtype_names``, string dtypes given to
  ``unpack_tensor`` or to the consumer's metadata) resolve through weightsync's allow-list
  (:data:`weightsync.ALLOWED_DTYPES`), never ``getattr(torch, name)``.
- A tensor larger than ``buffer_size_bytes`` in ``pack_tensors`` or the broadcast producer
  is sent in one oversize chunk, as in vLLM, with vLLM's ``UserWarning`` (``Tensor '<name>'
  has size <n> bytes, which exceeds buffer_size_bytes=<b>``, followed by what to raise).
  ``packed_ipc_producer`` refuses it, as vLLM does, with a ``ValueError`` that opens with
  the same words and names the size the buffer must have. ``packed_ipc_consumer`` given
  handles for other GPUs only raises vLLM's ``ValueError`` (``IPC handle not found for GPU
  UUID ...``, the available UUIDs and what to pass), as ``DeviceMismatch``, a subclass.
- Every wait on a CUDA stream has a deadline (keyword-only ``timeout_s``, per wait; vLLM
  waits forever on a dead peer) and raises ``TransferTimeout``; on any failure the group's
  ``abort()`` is called when it has one, so peers fail at once instead of at their timeout.
- Slot streams wait for the caller's stream before packing or unpacking, so no parameter
  is read or written while the caller's queued work still uses it. CUDA sources are
  recorded on the slot stream that reads them.
- The producer packs each chunk into a per-slot buffer that is reused (and grown when a
  chunk needs more) instead of concatenating a new tensor per chunk. The consumer
  receives every chunk into a new tensor, as vLLM does, so the views it hands to
  ``post_unpack_func`` stay valid after the call.
- CPU tensors work: the broadcast functions run without streams over a CPU group, and the
  IPC functions export a ``/dev/shm`` buffer when ``gpu_uuid="cpu"``.
- An opt-in size header (``size_header=True`` on the producer and every consumer, all
  weightsync; off by default, as vLLM's module neither sends nor expects it): a consumer
  whose ``buffer_size_bytes`` or metadata differ from the producer's raises ``ValueError``
  naming the chunk and both sizes before receiving it, where vLLM's unpacked wrong bytes or
  aborted inside gloo. Over gloo a side whose ``size_header`` differs is refused by name
  (:mod:`weightsync.compat.packed_header` says where that cannot be seen).
- ``unpack_tensor`` and ``packed_ipc_consumer`` refuse metadata whose lists differ in
  length or whose sizes disagree with the shapes, naming the tensor; ``PackedBufferImporter``
  counts its ``mapped`` and ``released`` buffers.

This module holds the broadcast functions; the chunk rule with ``pack_tensors`` and
``unpack_tensor`` lives in :mod:`weightsync.compat.packed_chunks`, the IPC functions in
:mod:`weightsync.compat.packed_ipc`, the size header in :mod:`weightsync.compat.packed_header`.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from weightsync.compat import packed_header
from weightsync.compat.packed_chunks import PackedChunk, dtype_of, pack_into, pack_tensors, take, unpack_tensor
from weightsync.compat.packed_ipc import (
    CPU_HANDLE_KEY,
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    PackedBufferImporter,
    PackedIpcChunk,
    packed_ipc_consumer,
    packed_ipc_producer,
)
from weightsync.core.wire.settings import DEFAULT_TIMEOUT_S
from weightsync.mechanisms.groups import CommunicatorGroup, GlooGroup
from weightsync.mechanisms.streams import SlotStreams

#: Buffers in rotation by default, as in vLLM (vLLM's value, kept if weightsync's changes).
DEFAULT_PACKED_NUM_BUFFERS = 2
# DEFAULT_TIMEOUT_S, the default deadline of each wait on a CUDA stream inside the broadcast
# functions, is the library's (weightsync.core.wire.settings).


def _check_settings(buffer_size_bytes: int, num_buffers: int, timeout_s: float) -> None:
    for what, value in (("buffer_size_bytes", buffer_size_bytes), ("num_buffers", num_buffers)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{what} must be a positive int, got {value!r}")
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < math.inf):
        raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")


def _abort(group: Any) -> None:
    abort = getattr(group, "abort", None)
    if callable(abort):
        abort()


def _late(what: str, timeout_s: float) -> str:
    return (
        f"{what} did not complete within {timeout_s:.1f}s: a peer of the group is dead, stuck or too slow "
        "(raise timeout_s for slow links)"
    )


def _room(buffer: torch.Tensor | None, nbytes: int, device: torch.device) -> torch.Tensor:
    """``buffer`` when it holds ``nbytes`` on ``device``, else a new one that does (a slot's
    buffer grows to its largest chunk and is reused)."""
    if buffer is None or buffer.numel() < nbytes or buffer.device != device:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buffer


def packed_nccl_broadcast_producer(
    iterator: Iterator[tuple[str, torch.Tensor]],
    group: Any,
    src: int,
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    size_header: bool = False,
) -> None:
    """Broadcast ``post_iter_func(item)`` for every item from rank ``src``, packed into chunks.

    With CUDA tensors, chunk k is packed and broadcast on slot stream ``k % num_buffers``, so
    packing chunk k+1 overlaps sending chunk k; a slot is reused only after its stream
    finished. Every slot is drained before returning. Consumers must use the same
    ``buffer_size_bytes`` and metadata for the same tensors in the same order. By default
    the broadcasts are vLLM's, byte for byte; ``size_header=True`` (every consumer's too)
    sends a size header before each chunk (:mod:`weightsync.compat.packed_header`).
    """
    _check_settings(buffer_size_bytes, num_buffers, timeout_s)
    iterator = iter(iterator)
    first = next(iterator, None)
    if first is None:
        return
    device = first[1].device if first[1].is_cuda else torch.device("cpu")
    streams = SlotStreams(device, num_buffers)
    items = itertools.chain([first], iterator)
    buffers: list[torch.Tensor | None] = [None] * num_buffers
    caller = streams.caller_stream()
    slot = 0
    sent_on = device
    try:
        while True:
            streams.drain_slot(
                slot, time.monotonic() + timeout_s, _late(f"slot {slot}'s previous broadcast", timeout_s)
            )
            with streams.use(slot):
                streams.wait_for(slot, caller)
                taken = take(items, post_iter_func, buffer_size_bytes, 0)
                if not taken.names:
                    if size_header:  # the end, so a consumer expecting more tensors says so
                        # on the chunks' device: post_iter_func may have moved them from the items'
                        packed_header.send(group, src, sent_on, buffer_size_bytes, 0, 0)
                    break
                total = sum(taken.sizes)
                buffer = buffers[slot] = _room(buffers[slot], total, taken.tensors[0].device)
                pack_into(buffer, 0, taken.tensors, streams.stream(slot) if streams.is_cuda else None)
                sent_on = buffer.device
                if size_header:
                    packed_header.send(group, src, sent_on, buffer_size_bytes, total, len(taken.names))
                del taken
                group.broadcast(buffer[:total], src=src)
            slot = (slot + 1) % num_buffers
        streams.drain(time.monotonic() + timeout_s, _late("the last broadcasts", timeout_s))
    except BaseException:
        _abort(group)
        raise


def _take_meta(
    iterator: Iterator[tuple[str, tuple[list[int], torch.dtype]]], buffer_size_bytes: int
) -> list[tuple[str, list[int], torch.dtype, int]]:
    metas: list[tuple[str, list[int], torch.dtype, int]] = []
    total = 0
    for name, (shape, dtype) in iterator:
        resolved = dtype_of(dtype)
        shape = list(shape)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape} must be non-negative integers")
        nbytes = math.prod(shape) * resolved.itemsize
        metas.append((name, shape, resolved, nbytes))
        total += nbytes
        if total > buffer_size_bytes:
            break
    return metas


def packed_nccl_broadcast_consumer(
    iterator: Iterator[tuple[str, tuple[list[int], torch.dtype]]],
    group: Any,
    src: int,
    post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None],
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
    device: torch.device | str = "cuda",
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    size_header: bool = False,
) -> None:
    """Receive what the producer broadcasts and hand each chunk's tensors to ``post_unpack_func``.

    ``iterator`` gives ``(name, (shape, dtype))`` in the producer's order; chunk boundaries
    follow from it exactly as the producer's follow from its tensors. ``device`` is where
    chunks are received (the communicator's device). ``post_unpack_func`` runs on the slot's
    stream with views into that chunk's own tensor. Every slot is drained before returning.
    By default the receives are vLLM's. With ``size_header=True`` (the producer's too) each
    chunk's size is checked before it is received: a different ``buffer_size_bytes`` or
    metadata raises ``ValueError`` naming the chunk's first tensor and both sizes.
    """
    _check_settings(buffer_size_bytes, num_buffers, timeout_s)
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    streams = SlotStreams(dev, num_buffers)
    in_flight: list[torch.Tensor | None] = [None] * num_buffers
    caller = streams.caller_stream()
    iterator = iter(iterator)
    slot = 0
    chunk = 0
    try:
        while True:
            metas = _take_meta(iterator, buffer_size_bytes)
            if not metas and not (size_header and chunk):
                break  # no metadata at all: the producer's empty iterator sends nothing either
            streams.drain_slot(slot, time.monotonic() + timeout_s, _late(f"slot {slot}'s previous chunk", timeout_s))
            in_flight[slot] = None
            with streams.use(slot):
                streams.wait_for(slot, caller)
                packed = packed_header.receive_chunk(group, src, dev, buffer_size_bytes, metas, chunk, size_header)
                if packed is None:
                    break
                chunk += 1
                in_flight[slot] = packed
                names, shapes, dtypes, sizes = (list(column) for column in zip(*metas))
                post_unpack_func(unpack_tensor(packed, names, shapes, dtypes, sizes))
            slot = (slot + 1) % num_buffers
        streams.drain(time.monotonic() + timeout_s, _late("unpacking the last chunks", timeout_s))
    except BaseException:
        _abort(group)
        raise


__all__ = [
    "CPU_HANDLE_KEY",
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
    "DEFAULT_PACKED_NUM_BUFFERS",
    "DEFAULT_TIMEOUT_S",
    "CommunicatorGroup",
    "GlooGroup",
    "PackedBufferImporter",
    "PackedChunk",
    "PackedIpcChunk",
    "pack_tensors",
    "packed_ipc_consumer",
    "packed_ipc_producer",
    "packed_nccl_broadcast_consumer",
    "packed_nccl_broadcast_producer",
    "unpack_tensor",
]
