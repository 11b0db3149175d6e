"""Where a colocated sync's time goes, measured in one process on one GPU (no Ray).

Separates the copying that ``direct`` and ``ipc`` cannot avoid from what the sync adds on
top (Ray hand-offs, Python, host synchronization), so the bench's figures can be read
against it. Prints one line per measurement::

    .venv/bin/python scripts/profile_colocated.py --size 16gb --buffer-mib 1024

Cases:
  one-copy       one device copy of a buffer the model's size (the hardware figure)
  direct loop    one copy_ per tensor into another model's tensors (``direct`` without CuPy)
  foreach        the same copies through torch._foreach_copy_
  mapped loop    the direct loop into another process's region mapped over CUDA IPC
  mapped foreach the same through torch._foreach_copy_
  batched        the same copies as one kernel launch over a table (what ``direct`` does
                 on a GPU with CuPy), into local tensors and into the mapped region
  walk           reading the model's tensor list and checking it (per sync, on the host)
  ipc host-sync  pack chunk k, sync, unpack it, sync; two slots (what ``ipc`` does today)
  ipc events     the same with the slots ordered by CUDA events only, one sync at the end
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from weightsync.core.packing import ChunkUnpacker, pack_chunk, typed_view
from weightsync.core.sender import WeightSender
from weightsync.core.sinks import module_tensors
from weightsync.core.wire import SyncSettings
from weightsync.mechanisms.batched_copy import BatchedCopier
from weightsync.mechanisms.cuda_ipc import CudaRegion, map_cuda_ipc
from weightsync.tools.models import PolicyFactory


def gpu_ms(fn: Callable[[], None], repeats: int) -> tuple[float, float]:
    """(median wall ms including a final synchronize, median launch-only ms)."""
    walls, launches = [], []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i:
            walls.append((t2 - t0) * 1e3)
            launches.append((t1 - t0) * 1e3)
    return statistics.median(walls), statistics.median(launches)


def _export_region(nbytes: int, handles: Any, done: Any) -> None:
    """Child process: allocate and export a region, keep it until told to stop."""
    region = CudaRegion(nbytes, torch.device("cuda", 0), "profile")
    handles.put(region.handle())
    done.wait(600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16gb")
    parser.add_argument("--buffer-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "scripts/profile_colocated.py needs an NVIDIA GPU (it times CUDA copies and CUDA IPC)"
            " and torch sees none here; run it on a GPU machine"
        )
        raise SystemExit(2)

    src = PolicyFactory(args.size, 0, "cuda")()
    dst = PolicyFactory(args.size, 1, "cuda")()
    sender = WeightSender(model=src, device=torch.device("cuda", 0))
    manifest = sender.manifest(SyncSettings(buffer_bytes=args.buffer_mib << 20))
    total = manifest.total_bytes
    print(f"model {args.size}: {len(manifest.specs)} tensors, {total / 1e9:.2f} GB, {len(manifest.chunks)} chunks")

    def report(name: str, wall: float, launch: float) -> None:
        print(f"{name:<14} {wall:9.2f} ms  ({total / wall / 1e6:7.1f} GB/s)  host launch {launch:7.2f} ms", flush=True)

    pair = [torch.empty(total, dtype=torch.uint8, device="cuda") for _ in range(2)]
    report("one-copy", *gpu_ms(lambda: pair[1].copy_(pair[0]), args.repeats))
    pair.clear()

    sources = [t.detach() for _, t in module_tensors(src)]
    dests = [t.detach() for _, t in module_tensors(dst)]

    def loop() -> None:
        with torch.no_grad():
            for d, s in zip(dests, sources):
                d.copy_(s)

    report("direct loop", *gpu_ms(loop, args.repeats))
    with torch.no_grad():
        report("foreach", *gpu_ms(lambda: torch._foreach_copy_(dests, sources), args.repeats))
    copier = BatchedCopier.create(torch.device("cuda", 0))
    if copier is not None:
        stream = torch.cuda.current_stream()
        plan = copier.plan(dests, sources)
        report("batched", *gpu_ms(lambda: copier.run(plan, dests, sources, stream), args.repeats))
    ctx = mp.get_context("spawn")
    handles, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_export_region, args=(total, handles, done))
    child.start()
    region = map_cuda_ipc(handles.get(timeout=120), "profile")
    offsets, _ = manifest.region_layout()
    mapped = [typed_view(region, off, spec) for spec, off in zip(manifest.specs, offsets)]
    report("mapped loop", *gpu_ms(lambda: [d.copy_(s) for d, s in zip(mapped, sources)], args.repeats))
    with torch.no_grad():
        report("mapped foreach", *gpu_ms(lambda: torch._foreach_copy_(mapped, sources), args.repeats))
    if copier is not None:
        mapped_plan = copier.plan(mapped, sources)
        report("mapped batched", *gpu_ms(lambda: copier.run(mapped_plan, mapped, sources, stream), args.repeats))
        del mapped_plan
    mapped.clear()
    del region
    done.set()
    child.join(timeout=60)
    walls = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        sender.checked_sources()
        walls.append((time.perf_counter() - t0) * 1e3)
    print(f"{'walk':<14} {statistics.median(walls):9.2f} ms (host only)")

    slots = torch.empty(2, args.buffer_mib << 20, dtype=torch.uint8, device="cuda")
    pack_stream, unpack_stream = torch.cuda.Stream(), torch.cuda.Stream()
    srcs = list(sender.checked_sources().tensors)

    def ipc(host_sync: bool) -> None:
        unpacker = ChunkUnpacker(manifest.specs, dests.__getitem__, False)
        packed = [torch.cuda.Event() for _ in range(2)]
        freed = [torch.cuda.Event() for _ in range(2)]
        for chunk in manifest.chunks:
            slot = chunk.index % 2
            with torch.cuda.stream(pack_stream):
                if chunk.index >= 2:
                    pack_stream.wait_event(freed[slot])
                pack_chunk(chunk, manifest.specs, srcs, slots[slot])
                packed[slot].record()
            if host_sync:
                packed[slot].synchronize()
            with torch.cuda.stream(unpack_stream):
                unpack_stream.wait_event(packed[slot])
                unpacker.unpack(chunk, slots[slot])
                freed[slot].record()
            if host_sync:
                freed[slot].synchronize()
        unpack_stream.synchronize()

    report("ipc host-sync", *gpu_ms(lambda: ipc(True), args.repeats))
    report("ipc events", *gpu_ms(lambda: ipc(False), args.repeats))


if __name__ == "__main__":
    main()
