"""What reading a push's answer from its parts saves, against `direct` on the same actors.

One trainer and one worker (half a GPU each on CUDA); blocks of syncs alternate between
plain ``direct``, push through ``WeightSync.sync`` as it runs (the answer built from the
trainer's and the worker's own posts on the reply board, ``weightsync/glue/push_parts.py``)
and push with the trainer relaying the worker's answer (this driver asks for no parts), each
block set up afresh, so drift of the host hits all three alike; prints the medians::

    .venv/bin/python scripts/push_parts.py --device cuda --size 16gb --blocks 4 --syncs 12
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from weightsync import WeightSync
from weightsync.glue import round as round_module
from weightsync.glue.push_parts import PushParts
from weightsync.tools.colocated import colocated_pair, connect_colocated, timed_syncs

KINDS = ("direct", "push", "push, relayed")


class _Relayed:
    """Asks for no parts: the trainer's call carries the push's whole answer."""

    @staticmethod
    def ask(*args: Any, **kwargs: Any) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1mb")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--blocks", type=int, default=4, help="blocks of each kind, in turn")
    parser.add_argument("--syncs", type=int, default=20, help="syncs per block (the first of each is not counted)")
    args = parser.parse_args()
    connect_colocated(args.device, "scripts/push_parts.py")
    trainer, worker = colocated_pair(args.size, args.device)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    version = 0
    for _ in range(args.blocks):
        for kind in KINDS:
            push = kind != "direct"
            round_module.PushParts = _Relayed if kind == "push, relayed" else PushParts  # type: ignore[misc,assignment]
            ws = WeightSync(trainer, [worker], transport="direct", push=push)
            ws.setup()
            times[kind] += timed_syncs(ws, version, args.syncs)
            version += args.syncs
            ws.close()
    medians = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
    for kind in KINDS:
        print(
            f"{args.size} {args.device} {kind:<14} {medians[kind]:8.3f} ms   against direct "
            f"{medians[kind] - medians['direct']:+7.3f} ms   median of {len(times[kind])}",
            flush=True,
        )


if __name__ == "__main__":
    main()
