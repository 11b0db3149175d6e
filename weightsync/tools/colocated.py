"""A trainer and a worker on one device, for the scripts that time or profile one colocated
sync (``scripts/sync_timeline.py``, ``scripts/profile_sync.py``, ``scripts/ipc_slots.py``,
``scripts/reply_board.py``, ``scripts/push_parts.py``, ``scripts/profile_push.py``).

Call order: ``connect_colocated(device, script)`` -> ``trainer, worker = colocated_pair(size, device)`` ->
``WeightSync(trainer, [worker], ...)``, then per block of syncs ``ws.setup()`` ->
``timed_syncs(ws, version, count)`` -> ``ws.close()``. Subclasses of the actor classes
(stamped or profiled ones) go in ``trainer_cls`` / ``worker_cls``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import ray

from weightsync.core.wire.errors import SettingsError
from weightsync.glue.actors import TrainerHost, WorkerHost
from weightsync.tools.cluster import connect_with_gpus, missing_gpus
from weightsync.tools.models import PolicyFactory


def connect_colocated(device: str, script: str) -> None:
    """Start or join Ray for ``script`` on ``device``; on a cluster without a GPU, for
    ``cuda``, print one line saying so and exit with status 2 (before Ray starts, when
    this machine would start it)."""
    problem = connect_with_gpus(1 if device == "cuda" else 0, f"{script} --device cuda", num_cpus=4)
    if problem is not None:
        print(problem, flush=True)
        raise SystemExit(2)


def colocated_pair(
    size: str, device: str, trainer_cls: type = TrainerHost, worker_cls: type = WorkerHost, layers: int = 0
) -> tuple[Any, Any]:
    """A trainer (seed 0) and a worker (seed 1) holding ``PolicyFactory(size)`` on ``device``,
    at half a GPU each on CUDA and no CPU reserved, so both fit any machine with one.
    ``layers``: that many blocks instead of the size's own (``layers=32`` gives a small size
    the 16gb model's 194 tensors: host work grows with the tensor count, not their bytes)."""
    if layers < 0:
        raise ValueError(f"layers is a number of blocks (0: the size's own), got {layers}")
    # After connect_colocated (or any ray.init): asked before Ray runs, Ray has no cluster to answer.
    problem = missing_gpus(1, f"a colocated pair on {device}") if device == "cuda" and ray.is_initialized() else None
    if problem is not None:  # else both actors would wait for a GPU for ever
        raise SettingsError(problem)
    gpus = 0.5 if device == "cuda" else 0
    factories = [PolicyFactory(size, seed, device) for seed in (0, 1)]
    for factory in factories:
        factory.cfg = replace(factory.cfg, layers=layers or factory.cfg.layers)
    trainer: Any = ray.remote(trainer_cls).options(num_cpus=0, num_gpus=gpus).remote(factories[0], device=device)
    worker: Any = ray.remote(worker_cls).options(num_cpus=0, num_gpus=gpus).remote(factories[1], device=device)
    return trainer, worker


def timed_syncs(ws: Any, version: int, count: int, skip: int = 1) -> list[float]:
    """Seconds of each of ``count`` syncs of ``ws`` (versions ``version + 1`` on), the first
    ``skip`` left out (a block's first syncs warm its halves up)."""
    times = []
    for i in range(count):
        start = time.perf_counter()
        ws.sync(version + 1 + i)
        if i >= skip:
            times.append(time.perf_counter() - start)
    return times
