"""The TP relay's follower (``weightsync.vllm.relay``), over an in-order stand-in for vLLM's
TP group: rank 0's object broadcasts go through a queue and do not wait for the other
ranks (vLLM's shared-memory message queue), so a follower that fails to load a batch must
still take the rest of the call off the queue, or the next call reads its leftovers."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
import torch

from weightsync.vllm.relay import Finish, RelayLoadError, TpRelay


class QueuedGroup:
    """One side of a two-rank group whose broadcasts are queued in order."""

    def __init__(self, rank: int, queue: deque[Any]) -> None:
        self.rank_in_group, self.world_size, self.queue = rank, 2, queue

    def broadcast_object(self, obj: Any, src: int) -> Any:
        if self.rank_in_group == src:
            self.queue.append(obj)
            return obj
        return self.queue.popleft()

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        if self.rank_in_group == src:
            self.queue.append(tensor.clone())
        else:
            tensor.copy_(self.queue.popleft())


def batch(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"w{seed}", torch.randn(3, 4, generator=g)), (f"b{seed}", torch.randn(4, generator=g))]


def test_a_follower_that_fails_a_load_drains_the_call_and_the_next_call_is_in_step() -> None:
    queue: deque[Any] = deque()
    lead, follower = (
        TpRelay(QueuedGroup(0, queue), torch.device("cpu")),
        TpRelay(QueuedGroup(1, queue), torch.device("cpu")),
    )
    first = Finish(True, (1, "committed"))
    lead.send(batch(1))
    lead.send(batch(2))
    lead.finish(first)
    second = Finish(True, (2, "committed"))
    lead.send(batch(3))
    lead.finish(second)

    def refuse(items: list[tuple[str, torch.Tensor]]) -> None:
        raise KeyError(f"the model has no parameter {items[0][0]!r}")

    with pytest.raises(RelayLoadError, match="TP rank 1.*KeyError.*'w1'") as err:
        follower.follow(refuse)
    assert err.value.finish == first  # raised once rank 0's first call had ended

    loaded: list[tuple[str, torch.Tensor]] = []
    assert follower.follow(loaded.extend) == second
    assert [n for n, _ in loaded] == ["w3", "b3"]
    for (name, got), (_, sent) in zip(loaded, batch(3), strict=True):
        assert torch.equal(got, sent), name
    assert not queue, f"{len(queue)} message(s) of the calls left behind"
