"""One broadcast group as both halves see it: the collectives it needs (:class:`Communicator`),
its buffers, streams, agreement and abort (:class:`PackedGroup`; the whole story:
:mod:`weightsync.transports.broadcast.halves`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

import torch

from weightsync.core.wire.errors import PeerAborted, WeightSyncError
from weightsync.core.wire.plan import Chunk
from weightsync.core.wire.session import Session
from weightsync.mechanisms.streams import SlotStreams

log = logging.getLogger("weightsync")

#: The fewest in-place operations each side keeps in flight (``num_buffers`` when larger;
#: docs/benchmarks.md, "CPU broadcast knobs": 1.03-1.27x faster than 2 under load).
INPLACE_DEPTH = 4


class Work(Protocol):
    """An asynchronous collective in flight."""

    def wait(self, deadline: float) -> None:
        """Block the host until the operation completed, or raise at ``deadline``."""


class Communicator(Protocol):
    """The collectives a packed broadcast needs; rank 0 is the trainer."""

    rank: int
    world_size: int
    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int, stream_pointer: int) -> Work:
        """Start broadcasting ``tensor`` from ``src`` (on ``stream_pointer`` for CUDA)."""

    def agree(self, refuse: bool, deadline: float) -> list[int]:
        """All ranks at once: the ranks that refuse to go ahead (empty: everyone agrees)."""

    def abort(self) -> None:
        """Fail every pending operation on every rank; the group is unusable after."""

    def close(self) -> None:
        """Release the group after a clean finish."""


class PackedGroup:
    """One broadcast group as a sync sees it: its members, streams, the agreement of the
    current sync and the operations in flight (the owners transport keeps one per rank)."""

    def __init__(self, comm: Communicator, session: Session, members: Sequence[str]) -> None:
        if len(members) != comm.world_size:
            raise WeightSyncError(f"broadcast group of {comm.world_size} ranks given {len(members)} member names")
        self.comm = comm
        self.session = session
        self.manifest = session.manifest
        self.deadlines = session.deadlines
        self.members = tuple(members)
        # num_buffers, never more than the plan has chunks.
        nbuf = self.nbuf = self.manifest.depth(self.manifest.broadcast_chunks)
        #: Operations in flight (sender: in-place ones; receiver: posted ahead, any kind).
        self.depth = max(nbuf, INPLACE_DEPTH)
        # One stream per buffer slot, and the last one for the in-place operations.
        self.streams = SlotStreams(comm.device, nbuf + 1)
        self.lane = nbuf
        self._buffers: list[torch.Tensor] = []
        self._scratch: torch.Tensor | None = None
        self.in_flight: list[Work] = []
        # This sync's agreement: "" (not yet), "asked", "refused" (nothing moved), "moving".
        self._agreement = ""
        self._broken = False

    @property
    def me(self) -> str:
        return self.members[self.comm.rank]

    def buffers(self, plan: Sequence[Chunk] | None = None) -> list[torch.Tensor]:
        """The packing buffers, allocated on first use, each as large as the largest packed
        chunk of the plan (the Manifest's, or a delta sync's ``plan``, for which they may
        grow between syncs); at most ``buffer_bytes``, with most bytes in place much less."""
        chunks = self.manifest.broadcast_chunks if plan is None else plan
        packed = [c.nbytes for c in chunks if not c.inplace]
        need = max(packed, default=0)
        count = max(1, min(self.nbuf, len(packed)))  # chunk p uses buffer p % nbuf
        if not self._buffers or len(self._buffers) < count or self._buffers[0].numel() < need:
            need = max(need, self._buffers[0].numel() if self._buffers else 0)
            self._buffers = [torch.empty(need, dtype=torch.uint8, device=self.comm.device) for _ in range(count)]
        return self._buffers

    def header(self, raw: torch.Tensor, deadline: float) -> None:
        """Broadcast a delta session's header ``raw`` from rank 0, first thing in the sync."""
        with self.streams.use(self.lane):
            self.in_flight.append(self.comm.broadcast(raw, 0, self.streams.stream_pointer(self.lane)))
        self.in_flight[-1].wait(deadline)
        self.streams.drain(deadline, f"{self.me}: the delta header did not arrive in time")

    def scratch(self, nbytes: int) -> torch.Tensor:
        """The receiver's reused landing for in-place tensors it cannot take directly."""
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = None
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.comm.device)
        return self._scratch

    def agree(self, deadline: float) -> None:
        self._agreement = "asked"
        try:
            refused = self.comm.agree(False, deadline)
        except BaseException:
            self._broken = True
            raise
        if refused:
            self._agreement = "refused"
            names = [self.members[r] for r in refused]
            raise PeerAborted(f"{self.me}: {', '.join(names)} refused the sync before any byte moved", blames=names)
        self._agreement = "moving"

    def done(self) -> None:
        """This sync finished on this rank: nothing in flight, the next sync agrees anew."""
        self.in_flight.clear()
        self._agreement = ""

    def abort(self, deadline: float | None = None) -> None:
        """Before this sync's agreement: refuse in it (every rank stops, the group survives),
        by ``deadline`` (default: the timeout from now). After a refused agreement: nothing
        moved, nothing to do. After bytes started to move: abort the group, which fails every
        peer's pending operation at once."""
        if self._agreement == "refused":
            return
        if self._agreement == "" and not self._broken:
            self._agreement = "refused"
            try:
                self.comm.agree(True, deadline if deadline is not None else self.deadlines.leader(time.monotonic()))
                return
            except Exception as exc:  # noqa: BLE001 - already failing; the group is aborted below
                log.warning("weightsync: %s could not refuse in the agreement (%s); aborting the group", self.me, exc)
        self._broken = True
        self.in_flight.clear()
        self.comm.abort()

    def close(self, abort: bool = False) -> None:
        self.in_flight.clear()
        self._buffers, self._scratch = [], None
        if abort or self._broken:
            self._broken = True
            self.comm.abort()
        else:
            self.comm.close()
