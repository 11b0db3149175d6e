"""One sync at a time on a sharded trainer's ranks, whichever WeightSync of this process asks.

The ranks of a sharded trainer gather on the trainer's own process group: every rank must
issue the same collectives in the same order (:mod:`weightsync.core.sharded`). Two
WeightSyncs on the same ranks (rollout workers and an evaluation pool, say) take turns on
each rank actor, but two syncs started at the same moment may reach the ranks in different
orders, rank 0 running one while rank 1 runs the other. So a sync (or ``verify()``) of a
sharded trainer claims its ranks here for as long as it runs, and a second WeightSync of
this process asking meanwhile is refused at once, by name, before any call goes out::

    with claimed(ranks, ws.label, "sync of version 3"):   # ConcurrentSyncError when taken
        ...one round...

WeightSyncs of different processes cannot see each other's claims; for them the ranks'
own agreement refuses, on every rank and before any byte moves, a sync it finds the ranks
running for different WeightSyncs (``ShardedSender``). A trainer of one rank needs neither.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from weightsync.core.wire.errors import ConcurrentSyncError
from weightsync.glue.ranks import TrainerRanks, identity

_LOCK = threading.Lock()
#: Per rank actor (its identity), the label of the WeightSync syncing it and what it does.
_HELD: dict[object, tuple[str, str]] = {}


@contextlib.contextmanager
def claimed(ranks: TrainerRanks, label: str, what: str) -> Iterator[None]:
    """Hold ``ranks`` for ``label``'s ``what`` (a sync, a verify); refuse, naming the
    WeightSync holding them, when another one of this process does."""
    if not ranks.sharded or len(ranks.handles) < 2:
        yield
        return
    ids = [identity(h) for h in ranks.handles]
    with _LOCK:
        busy = [(name, _HELD[i]) for name, i in zip(ranks.names, ids) if i in _HELD]
        if busy:
            holder, doing = busy[0][1]
            raise ConcurrentSyncError(
                f"{label}: {what} refused before any call went out: {', '.join(n for n, _ in busy)} of this sharded "
                f"trainer are running the {doing} of {holder} right now. Its ranks gather on the trainer's own "
                "process group, one sync at a time: sync the WeightSyncs of one sharded trainer one after the "
                "other (the same thread, or a lock of yours around their sync() and verify())"
            )
        for i in ids:
            _HELD[i] = (label, what)
    try:
        yield
    finally:
        with _LOCK:
            for i in ids:
                if _HELD.get(i, ("",))[0] == label:
                    del _HELD[i]
