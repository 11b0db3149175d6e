"""The IPC half of :mod:`weightsync.packed_tensor`: one exported buffer, refilled per chunk.

Import these names from :mod:`weightsync.packed_tensor`; this module exists so that neither
file grows past one job. Call order, producer and consumer in two processes::

    importer = PackedBufferImporter()                      # consumer, once per engine
    for chunk in packed_ipc_producer(params, gpu_uuid, post):        # producer
        tensors = packed_ipc_consumer(chunk.ipc_handle, chunk.names, chunk.shapes,
                                      chunk.dtype_names, chunk.tensor_sizes,
                                      device_index, importer)         # consumer
        # the consumer is done with chunk k before the producer is asked for chunk k+1
    importer.close()                                       # consumer, at shutdown

On CUDA the buffer is exported once with torch's CUDA IPC (handles keyed by the physical
GPU's UUID, rebuilt on the consumer's own index for that GPU); with ``gpu_uuid="cpu"``
(:data:`CPU_HANDLE_KEY`) it is a ``/dev/shm`` region instead, for CPU-only hosts. The
consumer maps an export once and releases it once (see :class:`PackedBufferImporter`).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.core.packing import write_bytes_at
from weightsync.core.wire import DeviceMismatch, ShmHandle, dtype_from_name, dtype_name
from weightsync.core.wire.settings import GIB
from weightsync.mechanisms.cuda_ipc import CudaRegion
from weightsync.mechanisms.cuda_ipc import gpu_uuid as gpu_uuid_of
from weightsync.mechanisms.shm import ShmRegion, map_shm

#: Default capacity of one packed buffer (1 GiB), as in vLLM.
DEFAULT_PACKED_BUFFER_SIZE_BYTES = GIB
#: ``gpu_uuid`` that makes :func:`packed_ipc_producer` export a shared-memory buffer.
CPU_HANDLE_KEY = "cpu"


def check_sizes(names: list[str], shapes: list[list[int]], dtypes: list[torch.dtype], tensor_sizes: list[int]) -> None:
    """Refuse metadata whose lists differ in length or whose sizes disagree with the shapes."""
    if not (len(names) == len(shapes) == len(dtypes) == len(tensor_sizes)):
        raise ValueError(
            f"names, shapes, dtypes and tensor_sizes must have equal lengths, got "
            f"{len(names)}, {len(shapes)}, {len(dtypes)}, {len(tensor_sizes)}"
        )
    for name, shape, dtype, size in zip(names, shapes, dtypes, tensor_sizes):
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {list(shape)} must be non-negative integers")
        expected = math.prod(shape) * dtype.itemsize
        if expected != size:
            raise ValueError(
                f"tensor {name!r}: shape {list(shape)} of {dtype} needs {expected} bytes, but tensor_sizes says {size}"
            )


@dataclass
class PackedIpcChunk:
    """One chunk as it crosses to the consumer: what was packed, and the buffer's export.

    ``dtype_names`` are allow-listed wire names (``"bfloat16"``); ``ipc_handle`` maps a GPU
    UUID to torch's CUDA rebuild arguments, or :data:`CPU_HANDLE_KEY` to a ``ShmHandle``.
    """

    names: list[str]
    shapes: list[list[int]]
    dtype_names: list[str]
    tensor_sizes: list[int]
    ipc_handle: dict[str, Any]

    def __post_init__(self) -> None:
        check_sizes(self.names, self.shapes, [dtype_from_name(n) for n in self.dtype_names], self.tensor_sizes)
        if not self.ipc_handle:
            raise ValueError("a PackedIpcChunk needs an ipc_handle with at least one entry")


def _check_buffer_size(buffer_size_bytes: int) -> None:
    if not isinstance(buffer_size_bytes, int) or isinstance(buffer_size_bytes, bool) or buffer_size_bytes <= 0:
        raise ValueError(f"buffer_size_bytes must be a positive int, got {buffer_size_bytes!r}")


def _open_region(gpu_uuid: str, nbytes: int) -> tuple[CudaRegion | ShmRegion, dict[str, Any]]:
    if gpu_uuid == CPU_HANDLE_KEY:
        shm = ShmRegion(nbytes, tag="packed")
        return shm, {CPU_HANDLE_KEY: shm.handle()}
    # The current device, as in vLLM: ``gpu_uuid`` is the caller's name for it.
    cuda = CudaRegion(nbytes, torch.device("cuda", torch.cuda.current_device()), uuid.uuid4().hex[:16])
    return cuda, {gpu_uuid: cuda.handle().rebuild_args}


def _wait_for_copies(region: CudaRegion | ShmRegion) -> None:
    if isinstance(region, CudaRegion):
        torch.cuda.current_stream(region.device).synchronize()


def packed_ipc_producer(
    iterator: Iterator[tuple[str, torch.Tensor]],
    gpu_uuid: str,
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
) -> Iterator[PackedIpcChunk]:
    """Pack ``post_iter_func(item)`` for each item into one exported buffer, one chunk at a time.

    The buffer (``buffer_size_bytes``, allocated at the first tensor, exported once) is
    refilled for every chunk, so the caller must let the consumer finish chunk k before it
    asks for chunk k+1. A chunk ends before the tensor that would overflow the buffer; a
    tensor larger than the whole buffer raises ``ValueError`` naming it and the size needed.
    The buffer is released when the generator finishes or is closed.
    """
    _check_buffer_size(buffer_size_bytes)
    region: CudaRegion | ShmRegion | None = None
    handle: dict[str, Any] = {}
    names: list[str] = []
    shapes: list[list[int]] = []
    dtype_names: list[str] = []
    sizes: list[int] = []
    used = 0
    try:
        for name, original in iterator:
            tensor = post_iter_func((name, original))
            wire = dtype_name(tensor.dtype, name)
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes > buffer_size_bytes:
                raise ValueError(
                    f"Tensor {name!r} has size {nbytes} bytes, which exceeds buffer_size_bytes={buffer_size_bytes}: "
                    f"packed_ipc_producer sends every chunk through one buffer, so raise buffer_size_bytes to "
                    f"at least {nbytes}"
                )
            if region is None:
                region, handle = _open_region(gpu_uuid, buffer_size_bytes)
            if names and used + nbytes > buffer_size_bytes:
                _wait_for_copies(region)
                yield PackedIpcChunk(names, shapes, dtype_names, sizes, dict(handle))
                names, shapes, dtype_names, sizes, used = [], [], [], [], 0
            write_bytes_at(region.tensor, used, tensor)
            names.append(name)
            shapes.append(list(tensor.shape))
            dtype_names.append(wire)
            sizes.append(nbytes)
            used += nbytes
        if names and region is not None:
            _wait_for_copies(region)
            yield PackedIpcChunk(names, shapes, dtype_names, sizes, dict(handle))
    finally:
        if region is not None:
            region.close()


class PackedBufferImporter:
    """The consumer's mapping of a producer's buffer: mapped once per export, released once.

    torch pairs one CUDA IPC export with one rebuild and one release on the consumer side;
    the producer ships the same export with every chunk, so rebuilding and releasing per
    chunk drives its cross-process refcount negative and leaks a buffer per transfer (vLLM
    #51258). This keeps the mapping of the current export and releases it when another
    export arrives or at :meth:`close`. Use one importer for all chunks of a transfer (and
    across transfers); ``mapped`` and ``released`` count what it did.
    """

    def __init__(self) -> None:
        self._entry: tuple[Hashable, torch.Tensor] | None = None
        self.mapped = 0
        self.released = 0

    def _get(self, key: Hashable, open_mapping: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self._entry is not None and self._entry[0] == key:
            return self._entry[1]
        self.close()
        tensor = open_mapping()
        self._entry = (key, tensor)
        self.mapped += 1
        return tensor

    def rebuild(self, list_args: list[Any]) -> torch.Tensor:
        """The buffer for torch's CUDA rebuild arguments (the device index already local)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return self._get(tuple(list_args), lambda: rebuild_cuda_tensor(*list_args))

    def map_shared(self, handle: ShmHandle) -> torch.Tensor:
        """The buffer for a shared-memory export (CPU producers)."""
        return self._get(handle, lambda: map_shm(handle))

    def close(self) -> None:
        """Release the held mapping, if any (one release per export)."""
        if self._entry is not None:
            self._entry = None
            self.released += 1


def rebuild_args_for(ipc_handle: dict[str, Any], local_uuid: str, device_index: int) -> list[Any]:
    """torch's rebuild arguments for the GPU ``local_uuid`` (``cuda:device_index`` here), with
    the device index made local; ``DeviceMismatch`` (a ``ValueError``, as in vLLM) when the
    chunk holds no handle for that GPU."""
    if local_uuid not in ipc_handle:
        # The opening words are vLLM's, so code that matches its message keeps working.
        raise DeviceMismatch(
            f"IPC handle not found for GPU UUID {local_uuid} (cuda:{device_index} here). Available UUIDs: "
            f"{sorted(ipc_handle)}; pass the device_index of the producer's GPU as this process numbers it"
        )
    args = list(ipc_handle[local_uuid])
    args[6] = device_index
    return args


def packed_ipc_consumer(
    ipc_handle: dict[str, Any],
    names: list[str],
    shapes: list[list[int]],
    dtype_names: list[str],
    tensor_sizes: list[int],
    device_index: int,
    importer: PackedBufferImporter | None = None,
) -> list[tuple[str, torch.Tensor]]:
    """The tensors of one chunk, each cloned out of the producer's buffer.

    The clone is what makes the result safe to keep: the producer refills the same buffer
    for the next chunk. ``device_index`` is this process's index of the producer's GPU; a
    shared-memory handle ignores it and gives CPU tensors. Pass the same ``importer`` for
    every chunk (``None`` maps and releases per call, which is only right for a one-chunk
    export).
    """
    dtypes = [dtype_from_name(n) for n in dtype_names]
    check_sizes(names, shapes, dtypes, tensor_sizes)
    if importer is None:
        importer = PackedBufferImporter()
    shared = ipc_handle.get(CPU_HANDLE_KEY)
    if isinstance(shared, ShmHandle):
        buffer = importer.map_shared(shared)
    else:
        buffer = importer.rebuild(rebuild_args_for(ipc_handle, gpu_uuid_of(device_index), device_index))
    content = sum(tensor_sizes)
    if buffer.numel() < content:
        raise ValueError(f"the chunk's tensors need {content} bytes but the exported buffer holds {buffer.numel()}")
    out = []
    offset = 0
    for name, shape, dtype, size in zip(names, shapes, dtypes, tensor_sizes):
        out.append((name, buffer[offset : offset + size].clone().view(dtype).view(tuple(shape))))
        offset += size
    return out
