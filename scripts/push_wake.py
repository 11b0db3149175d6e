"""Push through ``WeightSync.sync`` against plain ``direct``, with and without the wake-up.

One trainer and one worker (half a GPU each on CUDA); blocks of syncs of each kind
alternate (each block set up afresh), so drift of the host hits all alike:

    direct           a Ray call to the trainer and one to the worker
    push             one Ray call to the trainer; the coordinator rings the worker's
                     listener as it makes it (``Mode.wake``)
    push, no wake    the same without the coordinator's ring: the listener wakes only at
                     the trainer's ring, a Ray start leg later

Prints each kind's median and its difference from ``direct``::

    .venv/bin/python scripts/push_wake.py --device cuda --size 16gb
"""

from __future__ import annotations

import argparse
import statistics
import time

from weightsync import WeightSync
from weightsync.glue.setup import Setup
from weightsync.tools.cluster import connect
from weightsync.tools.colocated import colocated_pair

KINDS = ("direct", "push", "push, no wake")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1mb")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--blocks", type=int, default=4, help="blocks of each kind, in turn")
    parser.add_argument("--syncs", type=int, default=20, help="syncs per block (the first of each is not counted)")
    args = parser.parse_args()
    connect(num_cpus=4)
    trainer, worker = colocated_pair(args.size, args.device)
    wake = Setup.wake
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    version = 0
    for _ in range(args.blocks):
        for kind in KINDS:
            Setup.wake = wake if kind == "push" else lambda self: None  # type: ignore[method-assign]
            with WeightSync(trainer, [worker], transport="direct", push=kind != "direct") as ws:
                ws.setup()
                for i in range(args.syncs):
                    version += 1
                    start = time.perf_counter()
                    ws.sync(version)
                    if i:
                        times[kind].append(time.perf_counter() - start)
    Setup.wake = wake  # type: ignore[method-assign]
    base = statistics.median(times["direct"]) * 1e3
    for kind in KINDS:
        ms = statistics.median(times[kind]) * 1e3
        print(
            f"{args.size} {args.device} {kind:<14} {ms:8.3f} ms   {ms - base:+7.3f} ms against direct   "
            f"median of {len(times[kind])}",
            flush=True,
        )


if __name__ == "__main__":
    main()
