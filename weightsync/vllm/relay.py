"""Tensor parallelism: every TP rank of an engine loads every tensor of a sync.

The coordinator sees an engine as one worker: its calls reach every TP rank together
(``collective_rpc`` runs the same method on each). TP rank 0 is the weightsync receiver
(handshake, transports, state machine); each tensor batch it hands to its sink is also
broadcast over vLLM's own TP group, so ranks 1..N-1 receive the same full tensors and
load them with their own ``load_weights``, which narrows each to the rank's shard. Call
order for one protocol call, on every rank at once::

    rank 0:   call runs -> batch: send(batch) ... -> finally: finish(outcome)
    rank k:   follow(load) -> receives each batch, loads it -> returns rank 0's outcome

The group is vLLM's (``vllm.distributed.parallel_state.get_tp_group()``): tensors go over
its device group (NCCL on GPUs, gloo on CPUs), the small headers over its CPU group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from weightsync import WeightSyncError


@dataclass(frozen=True)
class BatchHeader:
    """The tensors that follow, in order: (name, shape, dtype name)."""

    items: tuple[tuple[str, tuple[int, ...], str], ...]


@dataclass(frozen=True)
class Finish:
    """Rank 0's call ended; ``settle`` says whether the reload lifecycle ends now."""

    settle: bool
    state: tuple[int | None, str] | None


_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class TpRelay:
    """Rank 0's batches, mirrored onto the other TP ranks."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.device = device

    @property
    def size(self) -> int:
        return int(self.group.world_size)

    @property
    def rank(self) -> int:
        return int(self.group.rank_in_group)

    def send(self, items: list[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in items:
            if str(tensor.dtype).removeprefix("torch.") not in _DTYPES:
                raise WeightSyncError(f"TP relay: tensor dtype {tensor.dtype} is not supported")
        header = BatchHeader(tuple((n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in items))
        self.group.broadcast_object(header, src=0)
        for _, tensor in items:
            self.group.broadcast(tensor.to(self.device).contiguous(), src=0)

    def finish(self, outcome: Finish) -> None:
        self.group.broadcast_object(outcome, src=0)

    def follow(self, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> Finish:
        """Receive and load rank 0's batches until its call ends; returns how it ended.

        A batch this rank fails to load does not end the loop: rank 0 goes on sending (its
        object broadcasts do not wait for the other ranks), so the rest of the call is
        still received, and dropped, up to rank 0's Finish. Only then is the load's error
        raised, as :class:`RelayLoadError` carrying that Finish: the next call starts in
        step instead of reading this one's leftovers.
        """
        failure: Exception | None = None
        while True:
            message = self.group.broadcast_object(None, src=0)
            if isinstance(message, Finish):
                if failure is not None:
                    raise RelayLoadError(self.rank, message, failure) from failure
                return message
            if not isinstance(message, BatchHeader):
                raise WeightSyncError(f"TP relay on rank {self.rank}: unexpected message {type(message).__name__}")
            batch = []
            for name, shape, dtype in message.items:
                tensor = torch.empty(shape, dtype=_DTYPES[dtype], device=self.device)
                self.group.broadcast(tensor, src=0)
                batch.append((name, tensor))
            if failure is None:
                try:
                    load(batch)
                except Exception as exc:  # noqa: BLE001 - raised once rank 0's call has ended
                    failure = exc


class RelayLoadError(WeightSyncError):
    """A TP rank failed to load a relayed batch; ``finish`` is how rank 0's call ended."""

    def __init__(self, rank: int, finish: Finish, cause: Exception) -> None:
        super().__init__(f"TP rank {rank} failed to load a relayed batch: {type(cause).__name__}: {cause}")
        self.finish = finish


def tp_relay(device: torch.device) -> TpRelay:
    """The relay over this vLLM worker's TP group (call inside a vLLM worker process)."""
    from vllm.distributed.parallel_state import get_tp_group

    return TpRelay(get_tp_group(), device)
