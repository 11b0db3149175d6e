"""Several WeightSyncs on one trainer: each its own session, groups, regions and push state.

One trainer feeds two pools over different transports (broadcast; direct and ipc), set up,
synced, failed and closed in any order, each pool bit-exact and untouched by the other's
failures; two push-mode pools on one trainer, pushed to by label; a worker taken over by
another WeightSync refuses the first one's syncs by name; a WeightSync dropped without
close() closes its session. (Two WeightSyncs on one sharded trainer: tests/test_sharded.py.)
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import pytest
import ray
import torch
from torch import nn

from tests.helpers import MixedModel, perturb
from tests.test_ray_e2e import assert_workers_match, get
from weightsync import SyncError, TrainerActor, WeightSync, WorkerActor
from weightsync.core.wire.messages import PushResult
from weightsync.glue.actors import TrainerHost
from weightsync.tools.models import PolicyFactory, train_step


def retype(model: nn.Module, dtype: torch.dtype) -> str:
    """Run in a worker: change its first parameter's dtype (a later sync refuses it by name)."""
    name, param = next(iter(model.named_parameters()))
    param.data = param.data.to(dtype)
    return name


def counted(ws: WeightSync) -> list[int]:
    """Count the setups ``ws`` runs from now on (one entry per setup)."""
    runs: list[int] = []
    run = ws._setup.run

    def counting() -> Any:
        runs.append(1)
        return run()

    ws._setup.run = counting  # type: ignore[method-assign]
    return runs


def test_two_pools_on_one_trainer_over_broadcast_and_colocated_transports_interleaved(
    actors: Any, no_shm_leftovers: None
) -> None:
    trainer = actors.add(TrainerActor.options(num_cpus=0).remote(PolicyFactory("1mb", seed=0)))
    pool = [actors.add(WorkerActor.options(num_cpus=0).remote(PolicyFactory("1mb", seed=i + 1))) for i in range(4)]
    rollout = {"a0": pool[0], "a1": pool[1]}
    evaluation = {"b0": pool[2], "b1": pool[3]}
    a = WeightSync(trainer, rollout, transport="broadcast", buffer_bytes=64 * 1024, timeout_s=30)
    b = WeightSync(trainer, evaluation, transport={"b0": "direct", "b1": "ipc"}, buffer_bytes=64 * 1024, timeout_s=30)
    try:
        a.setup()
        b.setup()  # used to tear a's session down: a's next sync then hung to its deadline
        sessions = get(trainer.weightsync_sessions.remote())
        assert sessions == {a.label: ("broadcast",), b.label: ("direct", "ipc")}
        setups_a, setups_b = counted(a), counted(b)
        get(trainer.call.remote(train_step, 1))
        assert [w.version for w in a.sync(1).workers] == [1, 1]
        assert [w.version for w in b.sync(1).workers] == [1, 1]
        assert_workers_match(trainer, pool)
        get(trainer.call.remote(train_step, 2))
        b.sync(2)
        a.sync(2, verify=True)
        assert_workers_match(trainer, pool)

        # A failure of one pool (b0 refuses: a tensor changed dtype) tears down only its session.
        name = get(pool[2].call.remote(retype, torch.float64))
        with pytest.raises(SyncError) as refused:
            b.sync(3)
        assert refused.value.culprits == ["b0"] and name in str(refused.value)
        assert get(trainer.weightsync_sessions.remote()) == {a.label: ("broadcast",), b.label: ()}
        get(trainer.call.remote(train_step, 3))
        a.sync(3)
        assert_workers_match(trainer, rollout.values())
        get(pool[2].call.remote(retype, torch.float32))
        b.sync(3)  # sets up again, alone
        assert_workers_match(trainer, pool)
        assert (len(setups_a), len(setups_b)) == (0, 1)

        # The other way round: a1 refuses, b goes on without a setup.
        get(pool[1].call.remote(retype, torch.float64))
        get(trainer.call.remote(train_step, 4))
        with pytest.raises(SyncError) as refused:
            a.sync(4)
        assert refused.value.culprits == ["a1"]
        b.sync(4)
        assert_workers_match(trainer, evaluation.values())
        get(pool[1].call.remote(retype, torch.float32))
        a.sync(4)
        assert_workers_match(trainer, pool)
        assert (len(setups_a), len(setups_b)) == (1, 1)

        # Closing one leaves the other's session as it was.
        a.close()
        assert get(trainer.weightsync_sessions.remote()) == {b.label: ("direct", "ipc")}
        get(trainer.call.remote(train_step, 5))
        b.sync(5)
        assert_workers_match(trainer, evaluation.values())
        assert [get(w.version.remote()) for w in rollout.values()] == [(4, "committed")] * 2
    finally:
        a.close()
        b.close()
    assert get(trainer.weightsync_sessions.remote()) == {}


class TwoPoolTrainer(TrainerHost):
    def train_and_push(self, step: int, sync: str | None = None) -> PushResult:
        perturb(self.model, seed=300 + step)
        return self.weightsync_push(version=step, sync=sync)


def test_two_push_pools_on_one_trainer_are_pushed_to_by_label(actors: Any) -> None:
    trainer = actors.add(ray.remote(TwoPoolTrainer).options(num_cpus=0).remote(functools.partial(MixedModel, seed=0)))
    w0, w1 = (actors.add(WorkerActor.options(num_cpus=0).remote(functools.partial(MixedModel, seed=i))) for i in (1, 2))
    with (
        WeightSync(trainer, {"p0": w0}, transport="direct", push=True, timeout_s=30) as a,
        WeightSync(trainer, {"q0": w1}, transport="direct", push=True, timeout_s=30) as b,
    ):
        with pytest.raises(ray.exceptions.RayTaskError) as unsure:
            get(trainer.train_and_push.remote(1))
        assert a.label in str(unsure.value) and b.label in str(unsure.value) and "sync=" in str(unsure.value)
        result = get(trainer.train_and_push.remote(1, a.label))
        assert sorted(result.workers) == ["p0"]
        assert_workers_match(trainer, [w0])
        assert get(w1.version.remote()) == (None, "committed")
        get(trainer.train_and_push.remote(2, b.label))
        assert_workers_match(trainer, [w1])
        get(trainer.call.remote(perturb, 7))
        a.sync(3)  # the coordinator's push, in its own session
        assert_workers_match(trainer, [w0])
        b.close()
        with pytest.raises(ray.exceptions.RayTaskError, match="closed"):
            get(trainer.train_and_push.remote(4, b.label))
        result = get(trainer.train_and_push.remote(4))  # one push session left: no label needed
        assert sorted(result.workers) == ["p0"]
        assert_workers_match(trainer, [w0])


def test_a_worker_taken_over_by_another_weightsync_refuses_the_first_ones_sync_by_name(actors: Any) -> None:
    trainer = actors.add(TrainerActor.options(num_cpus=0).remote(PolicyFactory("1mb", seed=0)))
    worker = actors.add(WorkerActor.options(num_cpus=0).remote(PolicyFactory("1mb", seed=1)))
    first = WeightSync(trainer, {"w": worker}, transport="broadcast", timeout_s=30)
    second = WeightSync(trainer, {"w": worker}, transport="broadcast", timeout_s=30)
    try:
        first.sync(1)
        second.sync(2)  # its setup takes the worker over
        with pytest.raises(SyncError) as refused:
            first.sync(3)
        assert refused.value.outcomes["w"].error == "SessionTornDown"
        assert second.label in refused.value.outcomes["w"].message
        assert refused.value.held == {"w": (2, "committed")}  # the other's session was not settled
        second.sync(4)  # first's failure tore nothing of second's down
        assert_workers_match(trainer, [worker])
    finally:
        first.close()
        second.close()


def test_a_weightsync_dropped_without_close_closes_its_session(actors: Any) -> None:
    trainer = actors.add(TrainerActor.options(num_cpus=0).remote(PolicyFactory("1mb", seed=0)))
    worker = actors.add(WorkerActor.options(num_cpus=0).remote(PolicyFactory("1mb", seed=1)))
    kept = WeightSync(trainer, {"k": worker}, transport="direct", timeout_s=30)
    kept.sync(1)
    dropped = WeightSync(trainer, [actors.add(WorkerActor.options(num_cpus=0).remote(PolicyFactory("1mb")))])
    dropped.sync(1)
    label = dropped.label
    assert set(get(trainer.weightsync_sessions.remote())) == {kept.label, label}
    del dropped
    gc.collect()
    # The teardown went out before this call (one caller: Ray keeps their order).
    assert set(get(trainer.weightsync_sessions.remote())) == {kept.label}
    kept.sync(2)
    assert_workers_match(trainer, [worker])
    kept.close()
