"""What the reply board saves: the same syncs with the answers read from it and from Ray.

One trainer and one worker (half a GPU each on CUDA); per transport, blocks of syncs with
``reply_board=True`` and ``reply_board=False`` alternate (each block set up afresh), so
drift of the host hits both alike; prints the medians and the difference::

    .venv/bin/python scripts/reply_board.py --device cuda --size 16gb --transports direct,ipc,push

Read it against the bench's Ray floor: the board takes Ray's return leg out of a sync, not
its start (the calls still go through Ray).
"""

from __future__ import annotations

import argparse
import statistics

from weightsync import WeightSync
from weightsync.tools.colocated import colocated_pair, connect_colocated, timed_syncs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1mb")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--transports", default="direct,ipc,push", help="comma-separated: direct, ipc, broadcast, push")
    parser.add_argument("--blocks", type=int, default=4, help="blocks of each kind, alternating")
    parser.add_argument("--syncs", type=int, default=20, help="syncs per block (the first of each is not counted)")
    args = parser.parse_args()
    connect_colocated(args.device, "scripts/reply_board.py")
    trainer, worker = colocated_pair(args.size, args.device)
    version = 0
    for transport in args.transports.split(","):
        push = transport == "push"
        times: dict[bool, list[float]] = {True: [], False: []}
        for block in range(2 * args.blocks):
            board = block % 2 == 0
            ws = WeightSync(trainer, [worker], transport="direct" if push else transport, push=push, reply_board=board)
            ws.setup()
            times[board] += timed_syncs(ws, version, args.syncs)
            version += args.syncs
            ws.close()
        on, off = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
        print(
            f"{args.size} {args.device} {transport:<9} reply board {on:8.3f} ms   Ray answers {off:8.3f} ms   "
            f"saved {off - on:6.3f} ms ({(off - on) / off:.1%}), median of {len(times[True])} each",
            flush=True,
        )


if __name__ == "__main__":
    main()
