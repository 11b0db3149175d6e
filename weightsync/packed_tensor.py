"""The public name of the drop-in for vLLM's ``vllm.distributed.weight_transfer.packed_tensor``.

Change ``from vllm.distributed.weight_transfer.packed_tensor import ...`` to
``from weightsync.packed_tensor import ...``. The code lives in
:mod:`weightsync.compat.packed_tensor`, whose docstring lists every behaviour that differs
from vLLM's module.
"""

from weightsync.compat.packed_tensor import (
    CPU_HANDLE_KEY,
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    DEFAULT_TIMEOUT_S,
    CommunicatorGroup,
    GlooGroup,
    PackedBufferImporter,
    PackedChunk,
    PackedIpcChunk,
    pack_tensors,
    packed_ipc_consumer,
    packed_ipc_producer,
    packed_nccl_broadcast_consumer,
    packed_nccl_broadcast_producer,
    unpack_tensor,
)

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
