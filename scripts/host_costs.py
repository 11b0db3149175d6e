"""What the host pays per direct sync for each step around the copy, timed in a tight loop.

One process, one GPU, two copies of a model with the 16gb model's 194 tensors but small
bytes (host work grows with the tensor count): the trainer's per-sync check that its model
did not change (``TensorPaths.unchanged``, ``plan_key``, the whole
``WeightSender.checked_sources``), queueing the batched copy kernel, ordering the copy
stream after the caller's, and for comparison a CUDA graph replay of the same launch and one
plain ``copy_``. Medians in microseconds of host time::

    .venv/bin/python scripts/host_costs.py

Hot caches: inside a sync, between long waits, the same steps can cost more (see
``scripts/profile_push.py`` for a push's steps as they happen).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from weightsync.core.sender import WeightSender
from weightsync.core.sinks import module_tensors
from weightsync.core.tensor_paths import TensorPaths
from weightsync.core.wire import SyncSettings
from weightsync.mechanisms.batched_copy import BatchedCopier, plan_key
from weightsync.mechanisms.streams import SlotStreams
from weightsync.tools.models import PolicyFactory


def host_us(fn: Callable[[], object], repeats: int = 300) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    if not torch.cuda.is_available():
        print("scripts/host_costs.py times CUDA launches and torch sees no GPU here; run it on a GPU machine")
        raise SystemExit(2)
    device = torch.device("cuda", 0)
    factories = [PolicyFactory("1mb", seed, "cuda") for seed in (0, 1)]
    for factory in factories:
        factory.cfg = replace(factory.cfg, layers=32)  # the 16gb model's 194 tensors
    source, destination = factories[0](), factories[1]()
    names = [name for name, _ in module_tensors(source)]
    sources = [tensor for _, tensor in module_tensors(source)]
    destinations = [tensor for _, tensor in module_tensors(destination)]
    paths = TensorPaths(source, names)
    sender = WeightSender(model=source, device=device)
    sender.manifest(SyncSettings())
    copier = BatchedCopier.create(device)
    if copier is None:
        print("scripts/host_costs.py times the batched copy kernel, which needs CuPy; install cupy for this CUDA")
        raise SystemExit(2)
    plan = copier.plan(destinations, sources)
    streams = SlotStreams(device, 1)
    stream = streams.stream(0)
    copier.launch(plan, stream)  # the first launch outside the capture: nothing left to load in it
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin()
        copier.launch(plan, torch.cuda.current_stream())
        graph.capture_end()
    torch.cuda.synchronize()
    one_in, one_out = torch.empty(1 << 20, device=device), torch.empty(1 << 20, device=device)
    steps: list[tuple[str, Callable[[], object]]] = [
        ("TensorPaths.unchanged", paths.unchanged),
        ("plan_key", lambda: plan_key(sources)),
        ("WeightSender.checked_sources", sender.checked_sources),
        ("BatchedCopier.launch", lambda: copier.launch(plan, stream)),
        ("SlotStreams.wait_for", lambda: streams.wait_for(0, streams.caller_stream())),
        ("CUDA graph replay of the launch", graph.replay),
        ("one copy_ of 4 MiB", lambda: one_out.copy_(one_in)),
    ]
    print(f"{len(sources)} tensors on {torch.cuda.get_device_name(device)}; median host time of 300 calls:")
    for name, step in steps:
        print(f"  {name:<34} {host_us(step):8.1f} us")
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
