"""Gathering a sharded rank's DTensors, bucket by bucket, within one sync's deadline.

:class:`GatheredTensors` is what a sharded rank's transports read as ``sources.tensors``
(see :mod:`weightsync.core.sharded` for the walk rule every rank follows); it gathers each
bucket (:func:`plan_buckets`) as it is reached, with the DTensors' own mesh, and holds only
that bucket. ``Shard(0)`` on a 1-D mesh and ``Replicate`` are gathered with async
collectives waited with the sync's deadline (:class:`Wait`); other layouts go through
``full_tensor()``.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

import torch
import torch.distributed as dist

from weightsync.core.dtensors import is_dtensor
from weightsync.core.wire.errors import TransferError, TransferTimeout, WeightSyncError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def plan_buckets(nbytes: Sequence[int], budget: int) -> list[range]:
    """Consecutive tensor indices holding at most ``budget`` bytes each (or one larger tensor)."""
    buckets: list[range] = []
    start, size = 0, 0
    for index, n in enumerate(nbytes):
        if index > start and size + n > budget:
            buckets.append(range(start, index))
            start, size = index, 0
        size += n
    if nbytes:
        buckets.append(range(start, len(nbytes)))
    return buckets


def row_or_replicated(t: DTensor) -> bool:
    """``Shard(0)`` or ``Replicate`` over a 1-D mesh: gathered with async collectives here,
    and sendable by its owners (:mod:`weightsync.core.owned_plan`)."""
    from torch.distributed.tensor import Replicate, Shard  # loaded already: ``t`` is a DTensor

    return t.device_mesh.ndim == 1 and tuple(t.placements) in ((Shard(0),), (Replicate(),))


class Wait:
    """Waits on async collectives with one deadline; names what it waited for when it fails."""

    def __init__(self, until: float, name: str, peers: Sequence[str]) -> None:
        self.until, self.name, self.peers = until, name, tuple(peers)

    def __call__(self, work: Any, what: str) -> None:
        left = max(0.001, self.until - time.monotonic())
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))
        except Exception as exc:
            if not work.is_completed():
                raise TransferTimeout(
                    f"{self.name}: {what} did not complete by the sync's deadline: a trainer rank "
                    f"({', '.join(self.peers)}) is stalled or not in this sync; the trainer's process "
                    "group now holds a pending collective: rebuild it before training on",
                    blames=self.peers,
                ) from exc
            raise TransferError(
                f"{self.name}: {what} failed on the trainer's process group ({type(exc).__name__}: "
                f"{str(exc)[:300]}): a trainer rank ({', '.join(self.peers)}) failed or died",
                blames=self.peers,
            ) from exc


class GatheredTensors(Sequence[torch.Tensor]):
    """``sources.tensors`` of a sharded rank: full tensors, gathered as they are read.

    Reading index ``i`` gathers (in order, on every rank) each bucket up to the one holding
    ``i``; reading an earlier index ends the walk (gathering its remaining buckets) and
    starts the next. :meth:`finish` completes the agreed number of walks. Only the current
    bucket is held.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        buckets: Sequence[range],
        walks: int,
        wait: Wait,
        on_bucket: Callable[[int], None] | None = None,
    ) -> None:
        self._tensors = tensors
        self._buckets = buckets
        self._bucket_of = [b for b, r in enumerate(buckets) for _ in r]
        self.walks = walks
        self.started = 0
        self._current: int | None = None  # bucket of the walk in progress, None: no walk
        self._held: dict[int, torch.Tensor] = {}
        self._wait = wait
        self._on_bucket = on_bucket
        self.broken = False
        self.gathered = 0  # buckets gathered this sync
        self.peak_bytes = 0  # most bytes of gathered tensors held at once

    def __len__(self) -> int:
        return len(self._tensors)

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Tensor]: ...
    def __getitem__(self, index: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        bucket = self._bucket_of[index]
        if self._current is not None and bucket < self._current:
            self._end_walk()
        if self._current is None:
            if self.started >= self.walks:
                raise WeightSyncError(
                    f"{self._wait.name}: a transport read the tensors more often than the {self.walks} "
                    "walk(s) the ranks agreed on (a weightsync bug: report it)"
                )
            self.started += 1
            self._current = -1
        while self._current < bucket:
            self._current += 1
            self._gather(self._current)
        return self._held[index]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    def _end_walk(self) -> None:
        assert self._current is not None
        while self._current < len(self._buckets) - 1:
            self._current += 1
            self._gather(self._current)
        self._current = None
        self._release()

    def finish(self) -> None:
        """Complete the walk in progress and blank walks up to the agreed number; a no-op
        once a gather failed (the group cannot gather any more)."""
        try:
            if self.broken:
                return
            if self._current is not None:
                self._end_walk()
            while self.started < self.walks:
                self.started += 1
                self._current = -1
                self._end_walk()
        finally:
            self._release()

    def _release(self) -> None:
        if any(t.is_cuda for t in self._held.values()):
            # The packing streams may still read them; their memory must not be reused first.
            torch.cuda.synchronize()
        self._held = {}

    def _gather(self, bucket: int) -> None:
        self._release()
        if self.broken:
            raise WeightSyncError(f"{self._wait.name}: an earlier gather of this sync failed")
        try:
            self._held = gather_bucket(self._tensors, self._buckets[bucket], self._wait)
        except BaseException:
            self.broken = True
            raise
        self.gathered += 1
        held = sum(t.untyped_storage().nbytes() for t in self._held.values())
        self.peak_bytes = max(self.peak_bytes, held)
        if self._on_bucket is not None:
            self._on_bucket(bucket)


def gather_bucket(tensors: Sequence[torch.Tensor], indices: range, wait: Wait) -> dict[int, torch.Tensor]:
    """The full tensors of ``indices``: plain tensors as they are, DTensors gathered.

    ``Shard(0)`` tensors of a 1-D mesh are padded to equal chunks (torch.chunk's split, as
    DTensor and FSDP2 use) and all-gathered asynchronously, all of the bucket's at once,
    then waited for; other layouts go through ``full_tensor()`` in the same order.
    """
    out: dict[int, torch.Tensor] = {}
    pending: list[tuple[int, Any, torch.Tensor, int]] = []
    with torch.no_grad():
        for i in indices:
            t = tensors[i]
            if not is_dtensor(t):
                out[i] = t.detach()
            elif not row_or_replicated(t):
                out[i] = t.full_tensor()
            elif t.placements[0].is_replicate():
                out[i] = t.to_local().detach()
            else:
                n = t.shape[0]
                mesh = t.device_mesh
                world = mesh.size(0)
                rows = -(-n // world)
                local = t.to_local()
                if n == 0 or rows == 0:
                    out[i] = local.new_empty(t.shape)
                    continue
                piece = local.new_zeros((rows, *t.shape[1:]))
                piece[: local.shape[0]].copy_(local)
                full = local.new_empty((world * rows, *t.shape[1:]))
                work = dist.all_gather_into_tensor(full, piece, group=mesh.get_group(0), async_op=True)
                pending.append((i, work, full, n))
        for i, work, full, n in pending:
            wait(work, f"gathering tensor {i} from the trainer's ranks")
            out[i] = full[:n]
        if pending and pending[0][2].is_cuda:
            # gloo stages CUDA tensors through host memory and orders its copy back only
            # before the current stream; the packing streams read the bucket too.
            torch.cuda.current_stream(pending[0][2].device).synchronize()
    return dict(sorted(out.items()))
