"""A plain worker that stages, on a real local Ray cluster: its own reads keep seeing version
N while N+1 arrives, and the commit swaps N+1 in with one copy (``WorkerActor(stage=...)``).

The trainer stops in the middle of its send (``tests/gated_trainer.py``), so the reads below
run while the transfer is provably in flight, whatever the machine's speed."""

from __future__ import annotations

import functools
import threading
from typing import Any

import pytest
import ray

from tests.conftest import RAY_TIMEOUT, ActorPool
from tests.gated_trainer import GatedTrainer
from tests.helpers import MixedModel, assert_bit_equal, perturb, state_of
from weightsync import SyncError, WeightSync, WorkerActor


def get(ref: Any, timeout: float = RAY_TIMEOUT) -> Any:
    return ray.get(ref, timeout=timeout)


def assert_same(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        assert_bit_equal(got[name], expected[name], name)


def in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as exc:  # the test looks at it
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("transport", ["ipc", "broadcast"])
def test_a_staging_worker_reads_its_version_while_the_next_arrives(transport: str, actors: ActorPool) -> None:
    trainer = actors.add(GatedTrainer.options(num_cpus=0, max_concurrency=2).remote(functools.partial(MixedModel, 0)))
    worker = actors.add(
        WorkerActor.options(num_cpus=0, max_concurrency=2).remote(functools.partial(MixedModel, 1), stage="auto")
    )
    with WeightSync(trainer, [worker], transport=transport, buffer_bytes=4096, timeout_s=60) as ws:
        ws.sync(1)
        first = get(trainer.call.remote(state_of))
        assert_same(get(worker.call.remote(state_of)), first)
        get(trainer.call.remote(perturb, 5))
        get(trainer.gate_at.remote(3))
        thread, out = in_thread(lambda: ws.sync(2))
        assert get(trainer.wait_gated.remote(60))  # the transfer is under way, stopped at tensor 3
        assert_same(get(worker.call.remote(state_of)), first)  # the worker reads version 1 meanwhile
        get(trainer.open_gate.remote())
        thread.join(RAY_TIMEOUT)
        (report,) = out
        assert not isinstance(report, Exception), report
        assert_same(get(worker.call.remote(state_of)), get(trainer.call.remote(state_of)))
        (w,) = report.workers
        assert (w.version, w.state) == (2, "committed")
        assert w.stage is not None and w.stage.where == ("device",) and w.stage.swap_s > 0
        assert w.stage.part_bytes[0] >= report.bytes and w.held_off_s is not None
        assert "staged" in report.summary()


def test_a_trainer_dying_mid_transfer_leaves_a_staging_worker_at_its_version(actors: ActorPool) -> None:
    trainer = actors.add(GatedTrainer.options(num_cpus=0, max_concurrency=2).remote(functools.partial(MixedModel, 0)))
    worker = actors.add(WorkerActor.options(num_cpus=0).remote(functools.partial(MixedModel, 1), stage="host"))
    ws = WeightSync(trainer, [worker], transport="ipc", buffer_bytes=4096, timeout_s=30)
    try:
        ws.sync(1)
        (name,) = ws.workers
        first = get(trainer.call.remote(state_of))
        get(trainer.call.remote(perturb, 5))
        get(trainer.die_at.remote(3))
        with pytest.raises(SyncError) as failed:
            ws.sync(2)
        assert failed.value.held[name] == (1, "committed"), failed.value.held
        assert_same(get(worker.call.remote(state_of)), first)
    finally:
        ws.close()
