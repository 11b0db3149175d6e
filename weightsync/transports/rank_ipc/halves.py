"""Rank ipc: each part of a worker of several processes fed by the trainer rank beside it.

The halves of the ``rank-ipc`` transport (plug-in: :mod:`weightsync.transports.rank_ipc.plugin`).
An inference engine with tensor parallelism is one worker of N processes (its TP ranks),
each of which loads every tensor and keeps its own shard. In the colocated layout, trainer
rank k and engine part k share a device; rather than part 0 receiving everything and
handing it on over the engine's own group (a second pass over every byte, one process at
a time), every rank k runs its own ipc export for part k, all ranks at once::

    rank k (RankIpcSender)       packs the model (a sharded rank: as it gathers it, every
                                 rank holds each gathered tensor whole) into its own slots
    part k (RankIpcReceiver)     unpacks from rank k's slots into its sink; a failure waits
                                 on, and names, ``trainer-rank-<k>``, not the rank that
                                 accepted the engine

The mechanism is :mod:`weightsync.transports.ipc.halves`'s, unchanged: these classes give it
its own kind, so a rank may serve plain ``ipc`` workers beside a fed engine, and tell each
part which rank feeds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from weightsync.core.wire.session import Session
from weightsync.transports.ipc.halves import IpcReceiver, IpcSender

KIND = "rank-ipc"
_T = TypeVar("_T")


class RankIpcSender(IpcSender):
    """Trainer rank k's slots, for part k of every worker it feeds this way."""

    kind = KIND
    #: A worker fed by several ranks holds one version made of every rank's bytes, with no
    #: one base a delta could be made against: always dense.
    carries_deltas = False


class RankIpcReceiver(IpcReceiver):
    """Part k of a worker: attaches trainer rank ``server``'s slots (named in its failures)."""

    kind = KIND
    carries_deltas = False

    def __init__(self, session: Session, device: torch.device, server: str, part: int) -> None:
        super().__init__(session, device)
        self.server = server
        self.part = part

    def own_senders(self, sent: Sequence[_T]) -> Sequence[_T]:
        return sent[self.part : self.part + 1]
