"""A staged sync's bytes handed from TP rank 0's stage to the other TP ranks' stages.

An unstaged engine relays each tensor batch over vLLM's own TP group as rank 0 loads it
(``relay.py``), on the thread that runs the model, inside ``collective_rpc``. A staged
engine receives on a thread of its own while the model keeps running, and the model's own
collectives run on vLLM's TP group at the same time: two threads issuing collectives on one
group would interleave in a different order on each rank and hang or corrupt both. So the
stage goes over a group of weightsync's own: a standalone gloo group of the engine's TP
ranks (``weightsync.mechanisms.gloo``), formed once when staging is set up (its
rendezvous address handed out over vLLM's group, inside that setup call), used only by the
ranks' staging threads. On a GPU gloo carries the bytes through host memory.

Per staged receive, on every rank's staging thread once rank 0's receive ended::

    rank 0:   relay.share(stage or None)   # agree: who cannot go ahead; then the stage, in pieces
    rank k:   relay.follow(stage or None)  # True once the whole stage arrived, False when any
                                           # rank refused (nothing arrived, nothing to swap)
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

from weightsync import WeightSyncError
from weightsync.mechanisms.gloo import GlooCommunicator, open_store

#: Bytes per broadcast of a stage, and how many are in flight at once.
PIECE_BYTES = 64 << 20
DEPTH = 4


class StageRelayError(WeightSyncError):
    """A TP rank could not take part in a staged sync's relay (named in the message)."""


class StageRelay:
    """One TP rank of the engine's staging group."""

    def __init__(self, comm: GlooCommunicator, timeout_s: float) -> None:
        self.comm = comm
        self.timeout_s = timeout_s

    @classmethod
    def form(cls, tp_group: Any, timeout_s: float) -> StageRelay:
        """Every TP rank at once, inside one ``collective_rpc``: rank 0 opens the rendezvous
        store on loopback and tells the others its port over vLLM's group (``tp_group``)."""
        rank, size = int(tp_group.rank_in_group), int(tp_group.world_size)
        store, problem = None, ""
        if rank == 0:
            try:
                store = open_store("127.0.0.1", 0, size, timeout_s)
            except Exception as exc:  # noqa: BLE001 - every rank is told below, and raises
                problem = f"{type(exc).__name__}: {exc}"
        # Every rank takes part in this broadcast, also when rank 0 failed: none is left waiting.
        port = tp_group.broadcast_object(store.port if store is not None else problem, src=0)
        if not isinstance(port, int):
            raise StageRelayError(f"TP rank 0 could not open the staging group's store on 127.0.0.1 ({port})")
        comm = GlooCommunicator("127.0.0.1", port, rank, size, "weightsync-stage", timeout_s, store=store)
        return cls(comm, timeout_s)

    @property
    def rank(self) -> int:
        return self.comm.rank

    def _agree(self, ready: bool, wait_s: float) -> list[int]:
        return self.comm.agree(not ready, time.monotonic() + wait_s)

    def share(self, stage: torch.Tensor | None) -> None:
        """Rank 0: send ``stage`` (None: rank 0 has nothing to swap) once every rank agreed;
        raises naming the ranks that could not take it."""
        refused = self._agree(stage is not None, self.timeout_s)
        if stage is None:
            return
        others = [r for r in refused if r != 0]
        if others:
            raise StageRelayError(f"TP rank(s) {others} could not stage this sync (see their errors); no rank takes it")
        self._pieces(stage)

    def follow(self, stage: torch.Tensor | None) -> bool:
        """Rank k: receive rank 0's stage into ``stage`` (None: this rank cannot take it, which
        every rank is told); False when any rank refused, so there is nothing to swap. It
        waits for rank 0's receive to end first: up to twice the timeout."""
        refused = self._agree(stage is not None, 2 * self.timeout_s)
        if refused or stage is None:
            return False
        self._pieces(stage)
        return True

    def _pieces(self, stage: torch.Tensor) -> None:
        deadline = time.monotonic() + self.timeout_s
        flat = stage.view(torch.uint8).reshape(-1)
        in_flight: deque[Any] = deque()
        try:
            for start in range(0, flat.numel(), PIECE_BYTES):
                if len(in_flight) >= DEPTH:
                    in_flight.popleft().wait(deadline)
                in_flight.append(self.comm.broadcast(flat[start : start + PIECE_BYTES], 0))
            while in_flight:
                in_flight.popleft().wait(deadline)
        except BaseException:
            self.comm.abort()  # the group is unusable now: every rank's wait ends at once
            raise

    def close(self) -> None:
        self.comm.close()
