"""The reference design's actors: one slot, packed and consumed chunk by chunk through Ray.

The bench measures weightsync against the design it grew from, which hands every chunk over
with a Ray call to the trainer (pack it) and one to the worker (consume it). These actors add
those two calls on top of the ready-made ones, through the per-chunk hand-off of
:mod:`~weightsync.tools.bench.chunks`; the shipped worker protocol has no such call.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from weightsync.core.halves import unpacker_for
from weightsync.core.wire.errors import WeightSyncError
from weightsync.glue.actors import TrainerHost, WorkerHost
from weightsync.tools.bench.chunks import ChunkHandle, SlotPacker, SlotReader, consume_chunk, pack_chunk


class ChunkTrainer(TrainerHost):
    def pack_chunk(self, chunk_index: int, slot: int, sync: str) -> ChunkHandle:
        """Pack one chunk into the ipc slots of WeightSync ``sync``'s session (its label)."""
        sender = self._ws(sync)
        ipc = sender.half("ipc")
        if not isinstance(ipc, SlotPacker):
            raise WeightSyncError("trainer: no IPC export is open; set up an ipc WeightSync first")
        return pack_chunk(ipc, chunk_index, slot, sender.checked_sources().tensors)

    def push_seconds(self, version: int) -> float:
        """A push from inside this actor's own call (push mode), timed here: what a loop that
        trains and pushes in one call pays for the sync."""
        start = time.perf_counter()
        self.weightsync_push(version)
        return time.perf_counter() - start


class ChunkWorker(WorkerHost):
    def consume_chunk(self, handle: ChunkHandle) -> None:
        receiver = self._wr()
        ipc = receiver.half("ipc")
        if not isinstance(ipc, SlotReader) or receiver.manifest is None:
            raise WeightSyncError(f"{receiver.name}: no IPC export is attached; set up an ipc WeightSync first")
        consume_chunk(ipc, handle, unpacker_for(receiver.manifest, receiver.sink), receiver.sink.consume)


ChunkTrainerActor: Any = ray.remote(ChunkTrainer)
ChunkWorkerActor: Any = ray.remote(ChunkWorker)
