"""The reference design's actors: one slot, packed and consumed chunk by chunk through Ray.

The bench measures weightsync against the design it grew from, which hands every chunk over
with a Ray call to the trainer (pack it) and one to the worker (consume it). These actors add
those two calls on top of the ready-made ones, through the per-chunk IPC API
(``IpcSender.pack`` / ``IpcReceiver.consume``); the shipped worker protocol has no such call.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from weightsync.core.transport.base import unpacker_for
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.messages import ChunkHandle
from weightsync.glue.actors import _Trainer, _Worker


class ChunkTrainer(_Trainer):
    def pack_chunk(self, chunk_index: int, slot: int) -> ChunkHandle:
        sender = self._ws()
        if sender.ipc is None:
            raise WeightSyncError("trainer: no IPC export is open; set up an ipc WeightSync first")
        return sender.ipc.pack(chunk_index, slot, sender.checked_sources().tensors)

    def push_seconds(self, version: int) -> float:
        """A push from inside this actor's own call (push mode), timed here: what a loop that
        trains and pushes in one call pays for the sync."""
        start = time.perf_counter()
        self.weightsync_push(version)
        return time.perf_counter() - start


class ChunkWorker(_Worker):
    def consume_chunk(self, handle: ChunkHandle) -> None:
        receiver = self._wr()
        ipc = receiver.ipc
        if ipc is None or receiver.manifest is None:
            raise WeightSyncError(f"{receiver.name}: no IPC export is attached; set up an ipc WeightSync first")
        ipc.consume(handle, unpacker_for(receiver.manifest, receiver.sink), receiver.sink.consume)


ChunkTrainerActor: Any = ray.remote(ChunkTrainer)
ChunkWorkerActor: Any = ray.remote(ChunkWorker)
