"""Bodies of the child processes used by the multi-process transport tests.

Each side rebuilds the expected tensors from a seed, so children check bit-exactness
themselves and report plain values back through a queue.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch

from tests.helpers import act, random_tensor
from weightsync import WeightReceiver, WeightSender
from weightsync.core.packing import ChunkUnpacker
from weightsync.core.sinks import LoadWeightsSink
from weightsync.core.wire import Manifest, SyncCall
from weightsync.mechanisms.gloo import GlooCommunicator
from weightsync.transports.broadcast.halves import BroadcastReceiver
from weightsync.transports.ipc.halves import IpcReceiver

LAYOUT = [
    ("embed", (300, 40), torch.bfloat16),  # 24000 bytes: split across 8 KiB buffers
    ("odd_half", (3, 5), torch.float16),
    ("after_odd", (7,), torch.float32),
    ("mask", (9, 3), torch.bool),
    ("scalar", (), torch.int64),
    ("empty", (0, 4), torch.float32),
    ("proj", (64, 48), torch.float32),
    ("fp8", (33,), torch.float8_e4m3fn),
]


def model_tensors(seed: int) -> dict[str, torch.Tensor]:
    return {name: random_tensor(shape, dtype, seed * 100 + i) for i, (name, shape, dtype) in enumerate(LAYOUT)}


class Holder(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        for name, tensor in model_tensors(seed).items():
            self.register_buffer(name, tensor.clone())

    def load(self, seed: int) -> None:
        for name, tensor in model_tensors(seed).items():
            getattr(self, name).copy_(tensor)

    def matches(self, seed: int) -> bool:
        return all(
            torch.equal(getattr(self, n).reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
            for n, t in model_tensors(seed).items()
        )


def gloo_rank(
    rank: int, port: int, world: int, buffer_bytes: int, num_buffers: int, seeds: list[int], queue: Any
) -> None:
    """A receiver rank: joins the group, receives one sync per seed, reports matches."""
    try:
        receiver = WeightReceiver(Holder(seed=999), name=f"rank-{rank}")
        manifest = Manifest.build(WeightSender(Holder(0)).specs(), buffer_bytes, num_buffers)
        receiver.accept(manifest)
        comm = GlooCommunicator("127.0.0.1", port, rank, world, "test-group", 30.0)
        receiver.install(
            BroadcastReceiver(comm, receiver.session, ["trainer", *(f"rank-{r}" for r in range(1, world))])
        )
        results = []
        for sync, seed in enumerate(seeds):
            receiver.receive(SyncCall(seq=sync, version=sync + 1))
            results.append(receiver.sink.module.matches(seed))  # type: ignore[attr-defined]
        receiver.close_transports()
        queue.put((rank, results, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def ipc_consumer(
    export: Any, buffer_bytes: int, num_buffers: int, seeds: list[int], queue: Any, check_slots: bool
) -> None:
    """Consumer of an IPC export, one sync per seed.

    With ``check_slots`` its sink proves no slot is rewritten while it reads. Holding chunk
    g (views into the slot), it waits until the producer has gone as far as it may: blocked
    waiting to write chunk g + num_buffers into this slot, or finished the sync, or (the
    bug) published chunk g + num_buffers. Then it checks the views still hold chunk g.
    Only events end the wait, never time, so the check is deterministic.
    """
    try:
        manifest = Manifest.build(WeightSender(Holder(0)).specs(), buffer_bytes, num_buffers)
        nchunks = len(manifest.chunks)
        holder = Holder(seed=999)
        state = {"rewritten": 0, "g": 0, "sync": 0}
        receiver: WeightReceiver

        def load(items: Any) -> None:
            items = list(items)
            if check_slots:
                snapshot = [t.clone() for _, t in items]
                ipc = receiver.half("ipc")
                assert isinstance(ipc, IpcReceiver)
                g = state["g"]
                end_of_sync = (state["sync"] + 1) * nchunks
                while True:
                    published, waiting = ipc.progress()
                    if waiting == g + num_buffers + 1 or published > g + num_buffers or published == end_of_sync:
                        break
                if any(not torch.equal(a, b) for (_, a), b in zip(items, snapshot)):
                    state["rewritten"] += 1
            for name, tensor in items:
                getattr(holder, name).copy_(tensor)

        receiver = WeightReceiver(LoadWeightsSink(load), name="consumer")
        receiver.accept(manifest)
        act(receiver, "ipc", "attach", export, 0)
        inner = ChunkUnpacker.unpack

        def counting_unpack(unpacker: ChunkUnpacker, chunk: Any, buffer: torch.Tensor) -> Any:
            state["g"] = state["sync"] * nchunks + chunk.index
            return inner(unpacker, chunk, buffer)

        ChunkUnpacker.unpack = counting_unpack  # type: ignore[method-assign]  # this child process only
        results = []
        for sync, seed in enumerate(seeds):
            state["sync"] = sync
            receiver.receive(SyncCall(seq=sync, version=sync + 1))
            results.append(holder.matches(seed))
        importer = receiver.half("ipc").importer  # type: ignore[union-attr]
        receiver.close_transports()
        queue.put((results, state["rewritten"], importer.maps, importer.releases, None))
    except BaseException:
        queue.put((None, None, None, None, traceback.format_exc()))
