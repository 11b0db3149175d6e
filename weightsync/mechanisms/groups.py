"""Groups for :mod:`weightsync.packed_tensor`: anything with ``broadcast(tensor, src=...)``.

vLLM's packed broadcast functions take a ``group`` with that one method (its
``PyNcclCommunicator`` has it). These adapters give it to a ``torch.distributed`` gloo group
(CPU tensors) and to weightsync's own communicators (:class:`GlooCommunicator` on CPU,
:class:`~weightsync.mechanisms.nccl.NcclCommunicator` on GPU)::

    group = GlooGroup()                                        # the default torch.distributed group
    group = CommunicatorGroup(NcclCommunicator(uid, rank, world, device, timeout_s))

On a CPU tensor ``broadcast`` returns once the bytes have arrived; on a CUDA tensor it is
queued on the current stream and returns at once, as ``PyNcclCommunicator`` does, so the
caller orders later work by stream. ``abort()`` fails the group's pending operations; the
packed functions call it when they fail, so no peer waits out its deadline.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch
import torch.distributed as dist

from weightsync.core.wire.settings import DEFAULT_TIMEOUT_S


class _Work(Protocol):
    def wait(self, deadline: float) -> None: ...


class _Communicator(Protocol):
    rank: int
    world_size: int

    def broadcast(self, tensor: torch.Tensor, src: int, stream_pointer: int) -> _Work: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


class GlooGroup:
    """A ``torch.distributed`` process group (gloo) as a packed-broadcast group.

    ``group=None`` is the default group. ``src`` is a rank within ``group``; the group's own
    timeout (set where it was created) bounds each broadcast.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GlooGroup needs torch.distributed initialised: call dist.init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        dist.broadcast(tensor, group=self.group, group_src=src)

    def abort(self) -> None:
        """Abort every pending operation of the group; it is unusable afterwards.

        A packed transfer that failed midway leaves its peers out of step, so the group could
        not be used again anyway; aborting lets them fail now instead of at their timeout.
        """
        (self.group or dist.group.WORLD).abort()  # type: ignore[union-attr]


class CommunicatorGroup:
    """A weightsync communicator as a packed-broadcast group.

    CPU broadcasts are waited for up to ``timeout_s`` each (the communicator raises
    ``TransferTimeout`` past it); CUDA broadcasts are stream-ordered and the packed functions
    drain their streams with their own deadline.
    """

    def __init__(self, comm: _Communicator, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not timeout_s > 0 or timeout_s == float("inf"):
            raise ValueError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
        self.comm = comm
        self.timeout_s = timeout_s
        self.rank = comm.rank
        self.world_size = comm.world_size

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if tensor.is_cuda:
            self.comm.broadcast(tensor, src, int(torch.cuda.current_stream(tensor.device).cuda_stream))
            return
        self.comm.broadcast(tensor, src, 0).wait(time.monotonic() + self.timeout_s)

    def abort(self) -> None:
        self.comm.abort()

    def close(self) -> None:
        self.comm.close()
