"""A party whose sync method ends before its side of the sync began tells its peers at once
(weightsync/core/abandon.py): they fail the sync naming it, instead of waiting out their
deadline for an announcement or a write that never comes.

Every sync here runs with a 60 s deadline: a peer left waiting would be named timed out
(a TransferTimeout) after it, where a told one names the party that failed.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest
import ray
import torch

from tests.helpers import MixedModel, both_sides, perturb
from tests.test_loose_ends import direct_pair
from tests.test_ray_e2e import assert_workers_match, get
from weightsync import SyncError, WeightSync
from weightsync.core.abandon import abandon_receive, abandon_send
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.messages import ReceiveResult, SendResult, SyncCall
from weightsync.core.wire.outcome import Outcome, Status, failed
from weightsync.glue.actors import TrainerHost, WorkerHost
from weightsync.glue.replies import on_board

DEADLINE_S = 60


class RefusesVersion2(WorkerHost):
    """Its override refuses version 2 with a failed answer of its own, never calling the
    mixin's receive."""

    @on_board
    def ws_receive(self, call: SyncCall) -> Outcome:
        if call.version == 2:
            return failed(self._me(), "receive", WeightSyncError(f"{self._me()} does not take version 2"))
        return super().ws_receive(call)


class RaisesOnVersion2(TrainerHost):
    @on_board
    def ws_send(self, call: SyncCall) -> Outcome:
        if call.version == 2:
            raise RuntimeError(f"{self._me()} will not send version 2")
        return super().ws_send(call)


def _parties(actors: Any, trainer_cls: type, worker_cls: type) -> tuple[Any, dict[str, Any]]:
    def made(cls: type, seed: int) -> Any:
        return actors.add(ray.remote(cls).options(num_cpus=0).remote(functools.partial(MixedModel, seed=seed)))

    return made(trainer_cls, 0), {"odd": made(worker_cls, 1), "plain": made(WorkerHost, 2)}


def _told(outcome: Outcome, party: str) -> None:
    """``outcome`` failed because ``party`` said so, not at a deadline."""
    assert outcome.status is Status.FAILED, outcome.line()
    assert outcome.error != "TransferTimeout" and party in outcome.message, outcome.line()


def _second_sync_fails(ws: WeightSync, trainer: Any) -> SyncError:
    """Sync version 1, a training step, then version 2, which must fail: its error."""
    ws.sync(1)
    get(trainer.call.remote(perturb, 2))
    with pytest.raises(SyncError) as info:
        ws.sync(2)
    return info.value


def _third_sync(ws: WeightSync, trainer: Any, workers: dict[str, Any]) -> list[Any]:
    """A training step and version 3, every worker then bit-exact; what each worker reported."""
    get(trainer.call.remote(perturb, 3))
    report = ws.sync(3)
    assert_workers_match(trainer, list(workers.values()))
    return list(report.workers)


TRANSPORTS = ["direct", "ipc", "broadcast"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_worker_whose_override_refuses_without_receiving_is_named_by_the_trainer_at_once(
    actors: Any, transport: str
) -> None:
    trainer, workers = _parties(actors, TrainerHost, RefusesVersion2)
    with WeightSync(trainer, workers, transport=transport, timeout_s=DEADLINE_S) as ws:
        error = _second_sync_fails(ws, trainer)
        _told(error.outcomes["trainer"], "odd")
        assert "odd" in error.culprits
        # Nothing was written into it: it still holds version 1, and the next sync goes on.
        assert {w.name: w.version for w in _third_sync(ws, trainer, workers)} == {"odd": 3, "plain": 3}


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_trainer_whose_override_raises_before_sending_is_named_by_every_worker_at_once(
    actors: Any, transport: str
) -> None:
    trainer, workers = _parties(actors, RaisesOnVersion2, WorkerHost)
    with WeightSync(trainer, workers, transport=transport, timeout_s=DEADLINE_S) as ws:
        error = _second_sync_fails(ws, trainer)
        assert "will not send version 2" in error.outcomes["trainer"].message
        for name in workers:
            _told(error.outcomes[name], "trainer")
        # Nothing was written and both still hold version 1. A direct worker that had
        # announced already cannot tell that the trainer wrote nothing: it may say dirty.
        may_be = {"committed", "dirty"} if transport == "direct" else {"committed"}
        held = ws.status()
        assert {v for v, _ in held.values()} == {1} and {s for _, s in held.values()} <= may_be, held
        _third_sync(ws, trainer, workers)


def test_a_side_that_began_or_belongs_to_another_coordinator_is_left_alone() -> None:
    """Nothing is aborted for a sync whose side already ran (its own failure told the peers,
    or it succeeded), nor for a call of a coordinator that no longer holds the worker; a
    sync that began on neither side is aborted on both, and the next one is unharmed."""
    sender, receiver, _ = direct_pair(DEADLINE_S)
    receiver.owner = "the coordinator"
    first = SyncCall(seq=0, version=1, targets={"direct": ("worker-0",)}, owner="the coordinator")
    sent, received = both_sides(sender, receiver, first)
    assert isinstance(sent, SendResult) and isinstance(received, ReceiveResult)
    assert not abandon_receive(receiver, first) and not abandon_send(sender, first)
    assert not abandon_receive(receiver, replace(first, seq=1, owner="another coordinator"))
    never = replace(first, seq=1, version=2)
    assert abandon_send(sender, never) and abandon_receive(receiver, never)
    assert receiver.status() == (1, "committed")
    perturb(sender.model, seed=3)
    sent, received = both_sides(sender, receiver, replace(first, seq=2, version=3))
    assert isinstance(received, ReceiveResult) and received.version == 3
    state = receiver.sink.module.state_dict()  # type: ignore[attr-defined]
    for name, tensor in sender.model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
