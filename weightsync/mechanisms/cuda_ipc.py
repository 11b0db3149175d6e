"""CUDA export over CUDA IPC: a device allocation made once and mapped by other processes.

The producer allocates a region and exports it once with torch's ``reduce_tensor``; the
handle is keyed by the physical GPU's UUID because CUDA_VISIBLE_DEVICES gives the same GPU
different indices in different actors. The consumer finds its own index for that UUID,
maps the region once per session and keeps the mapping: torch pairs one export with one
rebuild and one release, and rebuilding per chunk drives its cross-process refcount
negative and leaks the producer's buffer (vLLM #51258).
"""

from __future__ import annotations

import torch

from weightsync.core.wire.errors import DeviceMismatch
from weightsync.core.wire.messages import CudaIpcHandle


def gpu_uuid(device_index: int) -> str:
    return str(torch.cuda.get_device_properties(device_index).uuid)


def local_index_of(uuid: str) -> int | None:
    for index in range(torch.cuda.device_count()):
        if gpu_uuid(index) == uuid:
            return index
    return None


class CudaRegion:
    """A producer-owned device allocation of ``nbytes``, exported once."""

    def __init__(self, nbytes: int, device: torch.device, session: str) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        self.nbytes = nbytes
        self.session = session
        self.device = device
        self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)[:nbytes]
        _, args = reduce_tensor(self.tensor)
        self._handle = CudaIpcHandle(
            gpu_uuid=gpu_uuid(device.index or 0), rebuild_args=tuple(args), nbytes=nbytes, session=session
        )

    def handle(self) -> CudaIpcHandle:
        return self._handle

    def unlink(self) -> None:
        """Nothing to unlink for CUDA IPC; present so regions share one interface."""

    def close(self) -> None:
        del self.tensor
        torch.cuda.ipc_collect()


def map_cuda_ipc(handle: CudaIpcHandle, who: str = "this process") -> torch.Tensor:
    """Map ``handle`` here, on the local index of its GPU; refuses another GPU's handle."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = local_index_of(handle.gpu_uuid)
    if index is None:
        visible = [gpu_uuid(i) for i in range(torch.cuda.device_count())]
        raise DeviceMismatch(
            f"{who}: CUDA IPC handle is for GPU {handle.gpu_uuid}, which is not visible here "
            f"(visible: {visible}); the ipc and direct transports need trainer and worker on "
            "the same GPU (use transport='broadcast' otherwise)"
        )
    args = list(handle.rebuild_args)
    args[6] = index
    return rebuild_cuda_tensor(*args)
