"""Time ipc syncs at several slot sizes and counts, in interleaved rounds (one GPU or CPU).

On one GPU the producer's and consumer's kernels are time-sliced, so the slot layout
decides how many hand-offs a sync pays (docs/benchmarks.md, "One ipc slot on a GPU")::

    .venv/bin/python scripts/ipc_slots.py --device cuda --size 16gb --layouts auto,2x2,4x1,8x1 --rounds 3

A layout is ``GIBxCOUNT`` (``num_buffers`` slots of that many GiB; on CPU MiB) or ``auto``
(the library's default). Each round syncs every layout in turn (a fresh setup, two warm-up
syncs, then ``--syncs`` timed), so a drift of the machine touches every layout alike; prints
each layout as agreed, its median and its share of two raw copies (the bench's raw limit,
timed in the trainer).
"""

from __future__ import annotations

import argparse
import statistics

import ray

from weightsync import WeightSync
from weightsync.tools.bench import probes
from weightsync.tools.colocated import colocated_pair, connect_colocated, timed_syncs
from weightsync.tools.models import SIZES


def parse_layout(text: str, unit: int) -> tuple[int | str, int]:
    if text == "auto":
        return "auto", 2
    size, _, count = text.partition("x")
    return int(float(size) * unit), int(count or 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16gb", choices=sorted(SIZES))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--layouts", default="auto,2x2,4x1", help="comma-separated GIBxCOUNT (MiB on CPU) or auto")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--syncs", type=int, default=9)
    args = parser.parse_args()
    unit = 1 << 30 if args.device == "cuda" else 1 << 20
    layouts = [parse_layout(t, unit) for t in args.layouts.split(",")]
    connect_colocated(args.device, "scripts/ipc_slots.py")
    trainer, worker = colocated_pair(args.size, args.device)
    times: dict[str, list[float]] = {text: [] for text in args.layouts.split(",")}
    agreed: dict[str, str] = {}
    copy_s = 0.0
    version = 0
    for round_index in range(args.rounds):
        for text, (size, count) in zip(times, layouts):
            ws = WeightSync(trainer, [worker], transport="ipc", buffer_bytes=size, num_buffers=count)
            manifest = ws.setup()
            if not copy_s:
                # The bench's raw limit, in the trainer: one copy of a buffer of the model's size.
                copy_s = ray.get(trainer.call.remote(probes.raw_copy_seconds, manifest.total_bytes, 5), timeout=600)
            agreed[text] = f"{manifest.agreed.buffer_bytes / unit:g} x {manifest.agreed.num_buffers}"
            agreed[text] += f", {len(manifest.chunks)} chunks"
            times[text] += timed_syncs(ws, version, args.syncs + 2, skip=2)
            version += args.syncs + 2
            ws.close()
            print(
                f"round {round_index} {text} ({agreed[text]}): {statistics.median(times[text][-args.syncs :]) * 1e3:.2f} ms"
            )
    print(f"{args.size} on {args.device}: two raw copies {2 * copy_s * 1e3:.2f} ms")
    for text, values in times.items():
        median = statistics.median(values)
        print(
            f"  {text:>6} ({agreed[text]}): median of {len(values)} {median * 1e3:.2f} ms = {2 * copy_s / median:.1%} of two copies"
        )


if __name__ == "__main__":
    main()
