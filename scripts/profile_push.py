"""Where an in-trainer push's time goes, step by step on both sides.

A push from inside the trainer's own call (``TrainerMixin.weightsync_push``) costs one copy
of the model plus the host work around it: the pusher's post and ring, the trainer's check
of its tensors, queueing the copies, and after them the worker's commit and answer. This
runs a block of pushes with each step stamped (start and end, on the wall clock that every
process on the machine shares) in the trainer and in the worker's listener, prints each
step's median in ms after the push began, the pushes' own median time and one raw copy of
the model's bytes on the same device::

    .venv/bin/python scripts/profile_push.py --device cuda --size 16gb --pushes 40

``--beside`` also runs a block of pushes while another thread of the trainer's process wakes
every 0.1 ms (a data loader's stand-in), and prints how late that thread woke at worst in
each push, against the same stretch of time with no push: what a push's waits, which spin
inside their window, take from the trainer's other threads. When in each push its worst wait
began says which step held the thread off.

``--layers 32`` gives a small size the 16gb model's 194 tensors (the host work grows with
the tensor count, not their bytes). ``--cprofile`` profiles another block of pushes
function by function on both sides (cProfile slows Python down: read it for shares).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
import torch

from weightsync import WeightSync
from weightsync.core.receiver import WeightReceiver
from weightsync.core.sender import WeightSender
from weightsync.core.sinks import ModuleSink, module_tensors
from weightsync.glue.actors import TrainerHost, WorkerHost
from weightsync.mechanisms import batched_copy, mailbox, streams
from weightsync.mechanisms.doorbell import Bell
from weightsync.tools.colocated import colocated_pair, connect_colocated
from weightsync.transports.direct import target, writer
from weightsync.transports.push import listener, pusher

Stamps = dict[str, list[tuple[float, float]]]

#: Pushes at the start of each block that warm up and are left out of every median.
WARM_UP = 2

#: (class or module, function, step name): the trainer's steps, then the worker's.
TRAINER_STEPS: list[tuple[Any, str, str]] = [
    (pusher.Pusher, "_push", "push"),
    (Bell, "ring", "ring"),
    (WeightSender, "send", "send"),
    (WeightSender, "checked_sources", "check sources"),
    (writer.DirectWriter, "_announced", "wait for announce"),
    (batched_copy.BatchedCopier, "run", "launch copies"),
    (streams.SlotStreams, "drain", "wait for copies"),
    (writer.DirectWriter, "_publish", "publish written"),
    (pusher.Pusher, "_collect", "wait for answer"),
]
WORKER_STEPS: list[tuple[Any, str, str]] = [
    (listener.Listener, "_serve", "serve"),
    (WeightReceiver, "receive", "receive"),
    (ModuleSink, "direct_tensors", "sink tensors"),
    (target.DirectTarget, "stale", "stale check"),
    (target.DirectTarget, "_await_writers", "wait for written"),
    (WeightReceiver, "_commit", "commit"),
    (mailbox.Mailbox, "reply", "answer"),
]


def _stamp(steps: list[tuple[Any, str, str]]) -> Stamps:
    """Wrap each step so every call appends its (start, end) wall times."""
    stamps: Stamps = {name: [] for _, _, name in steps}
    for owner, function, name in steps:
        original = getattr(owner, function)

        def wrapper(*args: Any, _original: Callable[..., Any] = original, _into: str = name, **kwargs: Any) -> Any:
            start = time.time()
            try:
                return _original(*args, **kwargs)
            finally:
                stamps[_into].append((start, time.time()))

        setattr(owner, function, wrapper)
    return stamps


def _report(profile: cProfile.Profile, lines: int) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(lines)
    return out.getvalue()


class StampedTrainer(TrainerHost):
    def stamp(self) -> None:
        self.stamps = _stamp(TRAINER_STEPS)

    def pushes(self, version: int, count: int, profiled: bool) -> tuple[list[float], str]:
        """Seconds of each of ``count`` pushes (versions ``version + 1`` on); with
        ``profiled``, the profile of them all too (its times are then not meaningful)."""
        profile = cProfile.Profile() if profiled else None
        times = []
        for i in range(count):
            start = time.perf_counter()
            if profile is not None:
                profile.runcall(self.weightsync_push, version + 1 + i)
            else:
                self.weightsync_push(version + 1 + i)
            times.append(time.perf_counter() - start)
        return times, _report(profile, 30) if profile is not None else ""

    def pushes_beside(
        self, version: int, count: int
    ) -> tuple[list[float], list[tuple[float, float]], list[tuple[float, float]]]:
        """``count`` pushes while a thread beside them wakes every 0.1 ms, then ``count``
        idle stretches as long as the pushes' median: (push seconds, then for each push and
        each idle stretch the thread's worst lateness in it and when that wait began,
        seconds after the span began)."""
        wakes: list[tuple[float, float, float]] = []  # (slept from, woke at, seconds late)
        stop = threading.Event()

        def tick() -> None:
            while not stop.is_set():
                before = time.perf_counter()
                time.sleep(1e-4)
                after = time.perf_counter()
                wakes.append((before, after, after - before - 1e-4))

        thread = threading.Thread(target=tick, daemon=True)
        thread.start()
        try:
            windows, times = [], []
            for i in range(count):
                start = time.perf_counter()
                self.weightsync_push(version + 1 + i)
                times.append(time.perf_counter() - start)
                windows.append((start, time.perf_counter()))
            idle = []
            for _ in range(count):
                start = time.perf_counter()
                time.sleep(statistics.median(times))
                idle.append((start, time.perf_counter()))
        finally:
            stop.set()
            thread.join(timeout=10)

        def worst(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
            # A wait counts in every span it overlaps: one held up to a push's end, or through
            # a whole push, wakes after the push and is still the push's doing.
            return [
                max(((late, slept - a) for slept, woke, late in wakes if slept < b and woke > a), default=(0.0, 0.0))
                for a, b in spans
            ]

        return times, worst(windows), worst(idle)

    def raw_copy_ms(self, repeats: int) -> float:
        """One device copy of a buffer of the model's bytes (median of ``repeats``)."""
        nbytes = sum(t.numel() * t.element_size() for _, t in module_tensors(self.model))  # tied: once
        source = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        destination = torch.empty_like(source)
        times = []
        for _ in range(repeats + 1):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            destination.copy_(source)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        del source, destination
        torch.cuda.empty_cache()
        return statistics.median(times[1:])

    def get_stamps(self) -> Stamps:
        return self.stamps


class StampedWorker(WorkerHost):
    def stamp(self) -> None:
        self.stamps = _stamp(WORKER_STEPS)

    def profile_listener(self) -> None:
        """Profile every push the listener serves from now on."""
        self.listener_profile = cProfile.Profile()
        original = listener.Listener._serve

        def serve(this: Any, call: Any) -> None:
            self.listener_profile.runcall(original, this, call)

        listener.Listener._serve = serve  # type: ignore[method-assign,assignment]

    def listener_report(self) -> str:
        return _report(self.listener_profile, 30)

    def get_stamps(self) -> Stamps:
        return self.stamps


def _timeline(trainer: Stamps, worker: Stamps, skip: int) -> list[tuple[str, float, float]]:
    """Per step, (name, median start, median end) in ms after its push began."""
    begins = [start for start, _ in trainer["push"]]
    windows = list(zip(begins, [*begins[1:], float("inf")]))[skip:]
    rows = []
    for side, stamps in (("trainer", trainer), ("worker", worker)):
        for name, calls in stamps.items():
            starts, ends = [], []
            for begin, following in windows:
                # This push's call: the first that started while it ran (a step called
                # several times per push counts its first).
                mine = [(a, b) for a, b in calls if begin <= a < following]
                if mine:
                    starts.append(mine[0][0] - begin)
                    ends.append(mine[0][1] - begin)
            if starts:
                rows.append((f"{side}: {name}", statistics.median(starts) * 1e3, statistics.median(ends) * 1e3))
    return sorted(rows, key=lambda row: row[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1mb")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--pushes", type=int, default=40)
    parser.add_argument("--layers", type=int, default=0, help="blocks of the model (default: the size's own)")
    parser.add_argument("--cprofile", action="store_true", help="also profile a block of pushes function by function")
    parser.add_argument("--beside", action="store_true", help="also time another thread of the trainer during pushes")
    args = parser.parse_args()
    if args.pushes < 3:
        parser.error(f"--pushes must be at least {WARM_UP + 1} (the first {WARM_UP} warm up), got {args.pushes}")
    connect_colocated(args.device, "scripts/profile_push.py")
    trainer, worker = colocated_pair(args.size, args.device, StampedTrainer, StampedWorker, layers=args.layers)
    with WeightSync(trainer, [worker], transport="direct", push=True):  # set up on entering, closed on leaving
        timeline(args, trainer, worker)


def timeline(args: argparse.Namespace, trainer: Any, worker: Any) -> None:
    """Time and stamp a block of pushes (the session is set up), then print the timeline."""
    ray.get([trainer.stamp.remote(), worker.stamp.remote()], timeout=60)
    times, _ = ray.get(trainer.pushes.remote(0, args.pushes, False), timeout=600)
    rows = _timeline(
        ray.get(trainer.get_stamps.remote(), timeout=60), ray.get(worker.get_stamps.remote(), timeout=60), WARM_UP
    )
    print(
        f"in-trainer push, {args.size} ({args.layers or 'default'} layers) on {args.device}: median "
        f"{statistics.median(times[WARM_UP:]) * 1e3:.3f} ms of {len(times) - WARM_UP} (min {min(times[WARM_UP:]) * 1e3:.3f})"
    )
    if args.device == "cuda":
        print(f"one raw copy of the model's bytes: {ray.get(trainer.raw_copy_ms.remote(10), timeout=120):.3f} ms")
    print(f"{'step (median of each push)':<34} {'start':>8} {'end':>8}  ms after the push began")
    for name, start, end in rows:
        print(f"{name:<34} {start:8.3f} {end:8.3f}")
    if args.cprofile:
        ray.get(worker.profile_listener.remote(), timeout=60)
        _, profiled = ray.get(trainer.pushes.remote(args.pushes, args.pushes, True), timeout=600)
        print("=== trainer (pushes) ===")
        print(profiled)
        print("=== worker (listener) ===")
        print(ray.get(worker.listener_report.remote(), timeout=60))
    if args.beside:
        beside(args, trainer)


def beside(args: argparse.Namespace, trainer: Any) -> None:
    """Print how late a thread beside the pushes wakes, against idle stretches as long."""
    # Versions after the timed block's and the profiled block's.
    times, pushing, idle = ray.get(trainer.pushes_beside.remote(2 * args.pushes, args.pushes), timeout=600)

    def ms(values: list[float]) -> str:
        kept = values[WARM_UP:]
        return f"median {statistics.median(kept) * 1e3:.3f} ms, max {max(kept) * 1e3:.3f}"

    print(f"pushes with a thread beside them: {ms(times)}")
    print(f"that thread's worst lateness per push: {ms([late for late, _ in pushing])}")
    print(f"the same, idle stretches as long:      {ms([late for late, _ in idle])}")
    # Where in the push the worst wait began says which step held the GIL (the timeline above).
    began = sorted(round(at * 1e3, 2) for _, at in pushing[WARM_UP:])
    print(f"each push's worst wait began at (ms after the push began, sorted): {began}")


if __name__ == "__main__":
    main()
