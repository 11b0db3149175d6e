"""Time the batched copy kernel at several block shapes on this GPU (one process, no Ray).

``direct`` copies every tensor of a model with one launch of ``batched_copy``'s kernel;
its defaults (512 threads per block, 16 KiB per block) were chosen on the H100. On another
GPU, run this and compare::

    .venv/bin/python scripts/tune_batched_copy.py --size 16gb --threads 256,512,1024 --unit-kib 8,16,32,64,128

Prints GPU time (CUDA events, median and min of ``--repeats``) for one flat copy of the
same bytes (the hardware figure), one ``copy_`` per tensor, and the kernel at each
setting; every setting's result is checked bit for bit against the sources first.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch

from weightsync.core.sinks import module_tensors
from weightsync.mechanisms.batched_copy import BatchedCopier
from weightsync.tools.models import PolicyFactory


def gpu_ms(fn: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median, min) GPU milliseconds of ``fn``'s queued work, after two warm-up runs."""
    times = []
    for i in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16gb")
    parser.add_argument("--threads", default="256,512,1024", help="threads per block, comma-separated")
    parser.add_argument("--unit-kib", default="8,16,32,64,128", help="KiB each block copies, comma-separated")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "scripts/tune_batched_copy.py needs an NVIDIA GPU (it times a CUDA copy kernel)"
            " and torch sees none here; run it on a GPU machine"
        )
        raise SystemExit(2)

    device = torch.device("cuda", 0)
    sources = [t.detach() for _, t in module_tensors(PolicyFactory(args.size, 0, "cuda")())]
    destinations = [t.detach() for _, t in module_tensors(PolicyFactory(args.size, 1, "cuda")())]
    total = sum(t.numel() * t.element_size() for t in sources)
    print(f"{torch.cuda.get_device_name(device)}; model {args.size}: {len(sources)} tensors, {total / 1e9:.2f} GB")

    def report(name: str, timing: tuple[float, float]) -> None:
        median, low = timing
        print(f"  {name:<32} {median:8.3f} ms (min {low:8.3f})  {total / median / 1e6:8.1f} GB/s", flush=True)

    flat = [torch.empty(total, dtype=torch.uint8, device=device) for _ in range(2)]
    report("one flat copy", gpu_ms(lambda: flat[1].copy_(flat[0]), args.repeats))
    flat.clear()
    report("one copy_ per tensor", gpu_ms(lambda: [d.copy_(s) for d, s in zip(destinations, sources)], args.repeats))

    stream = torch.cuda.current_stream(device)
    for threads in (int(t) for t in args.threads.split(",")):
        for unit_kib in (int(u) for u in args.unit_kib.split(",")):
            copier = BatchedCopier.create(device, threads, unit_kib * 1024 // 16)
            if copier is None:
                raise SystemExit("the batched copy kernel is unavailable here (CuPy missing or NVRTC failed)")
            for destination in destinations:
                destination.zero_()
            plan = copier.plan(destinations, sources)
            copier.run(plan, destinations, sources, stream)
            torch.cuda.synchronize(device)
            for index, (destination, source) in enumerate(zip(destinations, sources)):
                if not torch.equal(destination, source):
                    raise SystemExit(f"threads={threads} unit={unit_kib} KiB: tensor {index} differs after the copy")
            report(
                f"kernel {threads} threads, {unit_kib} KiB",
                gpu_ms(lambda: copier.run(plan, destinations, sources, stream), args.repeats),  # noqa: B023
            )


if __name__ == "__main__":
    main()
