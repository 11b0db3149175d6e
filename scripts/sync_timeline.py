"""When each step of a colocated sync happens, as seen from the driver (median of many).

Subclasses the trainer and worker actors to stamp the start and end of their sync calls
(and, for ``direct``, the worker's announcement and the trainer's wait for its copies;
for ``ipc``, when each side queued its first and last chunk; for ``push``, the trainer's one
call and the worker's listener serving it) with the wall clock, which every process
on one machine shares; prints each mark in ms after ``WeightSync.sync`` was entered::

    .venv/bin/python scripts/sync_timeline.py --size 16gb --device cuda --transport direct

Read it against the bench's "ray floor" row: what lies between the calls' ends and the
sync's return is Ray's, what lies between a call's start and end is weightsync's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ray

from weightsync import WeightSync
from weightsync.core.sender import WeightSender
from weightsync.glue.actors import TrainerHost, WorkerHost
from weightsync.glue.replies import on_board
from weightsync.mechanisms import batched_copy, streams
from weightsync.tools.colocated import colocated_pair, connect_colocated
from weightsync.transports.direct import halves as direct
from weightsync.transports.ipc import slot_copies
from weightsync.transports.push import listener
from weightsync.transports.push.pusher import Pusher


def _stamped(cls: Any, method: str, into: list[tuple[float, float]]) -> None:
    """Wrap ``cls.method`` so each call appends its (start, end) wall times to ``into``."""
    original = getattr(cls, method)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        out = original(*args, **kwargs)
        into.append((start, time.time()))
        return out

    setattr(cls, method, wrapper)


class StampedTrainer(TrainerHost):
    def _stamp_drain(self) -> None:
        if "drains" in self.__dict__:
            return
        self.drains: list[tuple[float, float]] = []
        self.walks: list[tuple[float, float]] = []
        self.launches: list[tuple[float, float]] = []
        self.packs: list[tuple[float, float]] = []
        self.senders: list[tuple[float, float]] = []
        self.pushes: list[tuple[float, float]] = []
        _stamped(streams.SlotStreams, "drain", self.drains)
        _stamped(WeightSender, "send", self.senders)
        _stamped(Pusher, "push", self.pushes)
        _stamped(WeightSender, "checked_sources", self.walks)
        _stamped(batched_copy.BatchedCopier, "run", self.launches)
        _stamped(slot_copies.PackPlans, "pack", self.packs)

    def _timed(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.time()
        self._stamp_drain()
        out = call(*args, **kwargs)
        self.__dict__.setdefault("stamps", []).append((start, time.time()))
        return out

    # Stamped inside the answer the coordinator reads from its reply board, as the
    # library's own sync methods are (their answers skip Ray's return leg).
    @on_board
    def ws_send(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().ws_send, *args, **kwargs)

    @on_board
    def ws_push(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(super().ws_push, *args, **kwargs)

    def stamps(self) -> dict[str, list[tuple[float, float]]]:
        kinds = ("stamps", "drains", "walks", "launches", "packs", "senders", "pushes")
        return {k: self.__dict__.get(k, []) for k in kinds}


class StampedWorker(WorkerHost):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.receives: list[tuple[float, float]] = []
        self.announced: list[tuple[float, float]] = []
        self.unpacks: list[tuple[float, float]] = []
        _stamped(direct.DirectTarget, "stale", self.announced)  # checked right before announcing
        _stamped(slot_copies.UnpackPlans, "unpack", self.unpacks)
        _stamped(listener.Listener, "_serve", self.receives)  # push mode: the listener's sync

    @on_board
    def ws_receive(self, *args: Any, **kwargs: Any) -> Any:
        start = time.time()
        out = super().ws_receive(*args, **kwargs)
        self.receives.append((start, time.time()))
        return out

    def stamps(self) -> tuple[list[tuple[float, float]], list[float], list[tuple[float, float]]]:
        return self.receives, [start for start, _ in self.announced], self.unpacks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1mb")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--transport", choices=["direct", "ipc", "push"], default="direct")
    parser.add_argument("--buffer-mib", type=int, default=1024)
    parser.add_argument("--syncs", type=int, default=30)
    args = parser.parse_args()
    connect_colocated(args.device, "scripts/sync_timeline.py")
    trainer, worker = colocated_pair(args.size, args.device, StampedTrainer, StampedWorker)
    push = args.transport == "push"
    ws = WeightSync(
        trainer, [worker], transport="direct" if push else args.transport, push=push, buffer_bytes=args.buffer_mib << 20
    )
    ws.setup()
    entered, returned = [], []
    for version in range(1, args.syncs + 1):
        entered.append(time.time())
        ws.sync(version)
        returned.append(time.time())
    trainer_stamps = ray.get(trainer.stamps.remote(), timeout=60)
    sends, drains = trainer_stamps["stamps"], trainer_stamps["drains"]
    walks, launches = trainer_stamps["walks"], trainer_stamps["launches"]
    packs = trainer_stamps["packs"]
    receives, announced, unpacks = ray.get(worker.stamps.remote(), timeout=60)
    ws.close()
    skip = 3  # warm-up
    marks: dict[str, list[float]] = {}
    for i in range(skip, args.syncs):
        t0 = entered[i]
        marks.setdefault("trainer call starts", []).append(sends[i][0] - t0)
        marks.setdefault("worker listener wakes" if push else "worker call starts", []).append(receives[i][0] - t0)
        if announced:
            marks.setdefault("worker announces", []).append(announced[i] - t0)
        for name, calls in (("pusher starts", trainer_stamps["pushes"]), ("send begins", trainer_stamps["senders"])):
            if len(calls) == len(sends):
                marks.setdefault(name, []).append(calls[i][0] - t0)
        if len(walks) == len(sends):
            marks.setdefault("sources checks begin", []).append(walks[i][0] - t0)
            marks.setdefault("sources checked", []).append(walks[i][1] - t0)
        if len(launches) == len(sends):
            marks.setdefault("copy launch begins", []).append(launches[i][0] - t0)
        for name, calls, (lo, hi) in (("trainer", packs, sends[i]), ("worker", unpacks, receives[i])):
            inside = [(a, b) for a, b in calls if lo <= a <= hi]
            if inside:
                marks.setdefault(f"{name} queues chunk 0", []).append(inside[0][0] - t0)
                marks.setdefault(f"{name} queued last chunk", []).append(inside[-1][1] - t0)
        if len(drains) == len(sends):
            marks.setdefault("copies queued", []).append(drains[i][0] - t0)
            marks.setdefault("copies done", []).append(drains[i][1] - t0)
        marks.setdefault("trainer call ends", []).append(sends[i][1] - t0)
        marks.setdefault("worker answered" if push else "worker call ends", []).append(receives[i][1] - t0)
        marks.setdefault("sync returns", []).append(returned[i] - t0)
    print(f"{args.transport} {args.size} on {args.device}, median of {args.syncs - skip} syncs:")
    for name, values in marks.items():
        print(f"  {name:<20} {statistics.median(values) * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
