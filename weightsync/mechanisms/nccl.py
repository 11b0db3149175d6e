"""An NCCL :class:`~weightsync.transports.broadcast.halves.Communicator` through CuPy.

Works with cupy-cuda12x and cupy-cuda13x; CuPy finds libnccl from the ``nvidia-nccl-cu12``
/ ``-cu13`` pip package. Rank 0 makes the unique id (:func:`make_unique_id`) and the
coordinator passes it to every rank; all ranks then construct the communicator together.
Collectives run on the CUDA stream passed in (the engine's per-slot stream), so ordering
with packing and unpacking is by stream, and completion is awaited by polling the streams
with a deadline; on timeout or error the communicator is aborted, which releases every
rank still inside a collective.

The unique id travels as the 128 raw bytes of NCCL's ``ncclUniqueId``. CuPy 14 returns and
takes it as ``bytes``; CuPy 13 and older return and take a tuple of C ``char`` values (signed
on x86, unsigned on ARM and POWER), so :func:`make_unique_id` normalises to bytes and the
constructor converts back for the CuPy in use.

Creation has a deadline. ``ncclCommInitRank`` blocks until every rank has joined, and CuPy
exposes neither ``ncclCommInitRankConfig`` nor a non-blocking init (``NCCL_COMM_BLOCKING=0``
makes NCCL return ``ncclInProgress``, which CuPy reports as a failure). So the blocking init
runs in a daemon thread (CuPy releases the GIL around it) and the constructor waits for it
up to ``timeout_s``; past that it raises :class:`TransferTimeout` naming this rank and the
ranks it was waiting for. What is left behind then: that thread stays blocked inside NCCL
(with NCCL's bootstrap socket and thread) until the missing ranks join or the process exits;
if it ever returns, the communicator it built is aborted at once, so a late join never
yields a live communicator nobody owns. Restart the process to reclaim the thread.
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from weightsync.core.wire.errors import TransferTimeout, WeightSyncError
from weightsync.mechanisms.streams import wait_for_stream

UNIQUE_ID_BYTES = 128


def _nccl() -> Any:
    try:
        from cupy.cuda import nccl
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise WeightSyncError(
            f"the NCCL transport needs CuPy with NCCL: pip install 'weightsync[cuda12]' (or [cuda13]) ({exc})"
        ) from exc
    if not getattr(nccl, "available", True):
        raise WeightSyncError("CuPy is installed but cannot load NCCL; install nvidia-nccl-cu12 or -cu13")
    return nccl


def nccl_version() -> str | None:
    try:
        v = int(_nccl().get_version())
    except Exception:  # noqa: BLE001 - a probe for `doctor`; the reason is reported there
        return None
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}" if v >= 10000 else f"{v // 1000}.{v // 100 % 10}.{v % 100}"


def unique_id_as_bytes(raw: bytes | bytearray | tuple[int, ...] | list[int]) -> bytes:
    """The 128 bytes of an NCCL unique id, from CuPy's bytes (14+) or char tuple (13 and older)."""
    data = bytes(raw) if isinstance(raw, (bytes, bytearray)) else bytes(int(v) & 0xFF for v in raw)
    if len(data) != UNIQUE_ID_BYTES:
        raise WeightSyncError(f"an NCCL unique id has {UNIQUE_ID_BYTES} bytes, got {len(data)}")
    return data


def make_unique_id() -> bytes:
    """A fresh NCCL unique id, as bytes (this process hosts NCCL's bootstrap root for it)."""
    return unique_id_as_bytes(_nccl().get_unique_id())


def _cupy_takes_bytes() -> bool:
    import cupy

    return int(str(cupy.__version__).split(".")[0]) >= 14


def _char_is_signed() -> bool:
    return platform.machine().lower() in {"x86_64", "amd64", "i386", "i686", "x86"}


def unique_id_for_cupy(unique_id: bytes, takes_bytes: bool, char_is_signed: bool) -> bytes | tuple[int, ...]:
    """``unique_id`` in the form ``cupy.cuda.nccl.NcclCommunicator`` accepts."""
    data = unique_id_as_bytes(unique_id)
    if takes_bytes:
        return data
    return tuple(b - 256 if char_is_signed and b > 127 else b for b in data)


class _StreamOrdered:
    """NCCL work is ordered on its stream; the engine drains streams with a deadline."""

    def wait(self, deadline: float) -> None:
        if time.monotonic() > deadline:
            raise TransferTimeout("NCCL transfer past its deadline; a peer in the group is dead, stuck or too slow")


class _PendingInit:
    """The hand-over between the init thread and the constructor waiting for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.comm: Any = None
        self.error: BaseException | None = None
        self.abandoned = False


def _init_in_thread(
    nccl: Any, cupy_id: bytes | tuple[int, ...], rank: int, world_size: int, device_index: int, state: _PendingInit
) -> None:
    import cupy

    try:
        with cupy.cuda.Device(device_index):
            comm = nccl.NcclCommunicator(world_size, cupy_id, rank)
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting constructor, which raises it
        state.error = exc
        state.done.set()
        return
    with state.lock:
        if state.abandoned:
            comm.abort()  # the constructor gave up: nobody owns this communicator
        else:
            state.comm = comm
    state.done.set()


class NcclCommunicator:
    """One rank of an NCCL group on ``device``.

    Construction blocks until every rank has joined, at most ``timeout_s``; past that it
    raises :class:`TransferTimeout` (see the module docstring for what stays behind).
    """

    def __init__(
        self,
        unique_id: bytes,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        members: Sequence[str] = (),
    ) -> None:
        """``members``: the parties' names by rank, so a rank that never joins is blamed by name."""
        nccl = _nccl()
        if not 0 <= rank < world_size:
            raise WeightSyncError(f"NCCL rank {rank} is outside a world of {world_size} ranks")
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._timeout_s = timeout_s
        self._uint8 = nccl.NCCL_UINT8
        self._int32 = nccl.NCCL_INT32
        self._sum = nccl.NCCL_SUM
        cupy_id = unique_id_for_cupy(unique_id, _cupy_takes_bytes(), _char_is_signed())
        index = device.index if device.index is not None else torch.cuda.current_device()
        state = _PendingInit()
        thread = threading.Thread(
            target=_init_in_thread,
            args=(nccl, cupy_id, rank, world_size, index, state),
            name=f"weightsync-nccl-init-rank{rank}",
            daemon=True,
        )
        thread.start()
        state.done.wait(timeout_s)
        with state.lock:
            if state.comm is None and state.error is None:
                state.abandoned = True
        if state.error is not None:
            raise WeightSyncError(
                f"rank {rank} of {world_size}: creating the NCCL communicator on cuda:{index} failed: {state.error}"
            ) from state.error
        if state.comm is None:
            others = [r for r in range(world_size) if r != rank]
            raise TransferTimeout(
                f"rank {rank} of {world_size}: the NCCL communicator was not created within {timeout_s:.1f}s; "
                f"not every rank joined (this rank waited for ranks {others}). Check that each of them is alive, "
                "was given the same unique id, and can reach this host (NCCL_SOCKET_IFNAME); raise timeout_s if "
                "ranks start slowly. An NCCL thread stays blocked in this process until it exits.",
                blames=[members[r] for r in others] if len(members) == world_size else [],
            )
        self._comm: Any = state.comm

    def broadcast(self, tensor: torch.Tensor, src: int, stream_pointer: int) -> _StreamOrdered:
        if self._comm is None:
            raise WeightSyncError(f"rank {self.rank}: the NCCL communicator was closed or aborted")
        if not tensor.is_contiguous():
            raise WeightSyncError(f"rank {self.rank}: NCCL broadcast needs a contiguous tensor")
        if stream_pointer == 0:
            stream_pointer = int(torch.cuda.current_stream(self.device).cuda_stream)
        ptr = tensor.data_ptr()
        self._comm.broadcast(ptr, ptr, tensor.numel() * tensor.element_size(), self._uint8, src, stream_pointer)
        return _StreamOrdered()

    def agree(self, refuse: bool, deadline: float) -> list[int]:
        if self._comm is None:
            raise WeightSyncError(f"rank {self.rank}: the NCCL communicator was closed or aborted")
        flags = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        if refuse:
            flags[self.rank] = 1
        stream = torch.cuda.current_stream(self.device)
        self._comm.allReduce(
            flags.data_ptr(), flags.data_ptr(), self.world_size, self._int32, self._sum, int(stream.cuda_stream)
        )
        wait_for_stream(stream, deadline, f"rank {self.rank}: the NCCL agreement did not complete in time")
        return [rank for rank, flag in enumerate(flags.cpu().tolist()) if flag]

    def abort(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()
