"""End to end on a real local Ray cluster (loopback, CPU)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import Any

import pytest
import ray
import torch

from tests.conftest import RAY_TIMEOUT, ROOT
from tests.helpers import MixedModel, assert_bit_equal, perturb, state_of
from weightsync import ClosedError, LoadWeightsSink, SettingsError, SetupError, TrainerActor, WeightSync, WorkerActor
from weightsync.core.wire.shm_names import current_scope
from weightsync.glue.actors import TrainerHost, TrainerMixin, WorkerMixin
from weightsync.mechanisms.shm import leftover_segments
from weightsync.tools.models import PolicyFactory, train_step


def get(ref: Any) -> Any:
    return ray.get(ref, timeout=RAY_TIMEOUT)


def assert_workers_match(trainer: Any, workers: list[Any]) -> None:
    expected = get(trainer.call.remote(state_of))
    for worker in workers:
        got = get(worker.call.remote(state_of))
        assert got.keys() == expected.keys()
        for name in expected:
            assert_bit_equal(got[name], expected[name], name)


def start(actors: Any, n_workers: int, factory: Any = None, **worker_options: Any) -> tuple[Any, list[Any]]:
    factory = factory or PolicyFactory("1mb", seed=0)
    trainer = actors.add(TrainerActor.options(num_cpus=0).remote(factory))
    workers = [
        actors.add(WorkerActor.options(num_cpus=0).remote(PolicyFactory("1mb", seed=i + 1), **worker_options))
        for i in range(n_workers)
    ]
    return trainer, workers


@pytest.mark.parametrize("transport", ["broadcast", "ipc", "direct"])
def test_three_syncs_with_training_in_between_are_bit_exact(
    transport: str, actors: Any, no_shm_leftovers: None
) -> None:
    trainer, workers = start(actors, 2)
    with WeightSync(trainer, workers, transport=transport, buffer_bytes=64 * 1024, timeout_s=60) as ws:
        assert set(ws.transports().values()) == {transport}
        before = get(workers[0].call.remote(state_of))
        for version in (1, 2, 3):
            loss = get(trainer.call.remote(train_step, version))
            assert loss > 0
            report = ws.sync(version)
            assert report.version == version and report.bytes == ws.manifest.total_bytes  # type: ignore[union-attr]
            assert [w.version for w in report.workers] == [version, version]
            assert {w.state for w in report.workers} == {"committed"}
            assert_workers_match(trainer, workers)
        after = get(workers[0].call.remote(state_of))
        assert any(not torch.equal(before[n], after[n]) for n in before), "the weights must have changed"
        assert ws.verify()
    assert not leftover_segments(scope=current_scope())


def test_auto_picks_direct_for_colocated_module_workers_and_ipc_for_load_weights(actors: Any) -> None:
    trainer = actors.add(TrainerActor.options(num_cpus=0).remote(functools.partial(MixedModel, seed=0)))
    module_worker = actors.add(WorkerActor.options(num_cpus=0).remote(functools.partial(MixedModel, seed=1)))
    loader = actors.add(
        WorkerActor.options(num_cpus=0).remote(functools.partial(LoadingMixedModel, seed=2), sink="load_weights")
    )
    with WeightSync(trainer, {"module": module_worker, "loader": loader}, buffer_bytes=4096) as ws:
        assert ws.transports() == {"module": "direct", "loader": "ipc"}
        get(trainer.call.remote(perturb, 5))
        ws.sync(1)
        assert_workers_match(trainer, [module_worker, loader])


class LoadingMixedModel(MixedModel):
    """Loads the way engines do: through load_weights, by name, copying each tensor."""

    def load_weights(self, weights: Any) -> set[str]:
        own = dict(self.named_parameters()) | dict(self.named_buffers())
        loaded = set()
        for name, tensor in weights:
            own[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


def test_mixed_sync_uses_broadcast_ipc_and_direct_in_one_call(actors: Any) -> None:
    trainer, workers = start(actors, 3)
    names = {"bcast": workers[0], "ipc": workers[1], "direct": workers[2]}
    with WeightSync(
        trainer, names, transport={"bcast": "broadcast", "ipc": "ipc", "direct": "direct"}, buffer_bytes=100_096
    ) as ws:
        for version in (1, 2):
            get(trainer.call.remote(train_step, version))
            report = ws.sync(version)
            assert report.transports == {"broadcast": 1, "ipc": 1, "direct": 1}
            assert_workers_match(trainer, workers)


def test_tied_weights_travel_once_and_stay_tied(actors: Any) -> None:
    trainer, workers = start(actors, 2)
    with WeightSync(trainer, workers, transport={"worker-0": "broadcast", "worker-1": "direct"}) as ws:
        names = ws.manifest.names  # type: ignore[union-attr]
        assert "embed.weight" in names and "head.weight" not in names
        get(trainer.call.remote(train_step, 1))
        ws.sync(1)
        for worker in workers:
            assert get(worker.call.remote(lambda m: m.head.weight.data_ptr() == m.embed.weight.data_ptr()))
        assert_workers_match(trainer, workers)


# --- instrumented: one call per side per sync, and no slot rewritten while read ---------


def _check_slot(
    receiver: Any, items: list[tuple[str, torch.Tensor]], state: dict[str, int], nbuf: int, nchunks: int
) -> None:
    """Hold chunk g's views until the trainer is blocked on this slot (or done), then check them."""
    snapshot = [t.clone() for _, t in items]
    g = state["g"]
    end = (state["sync"] + 1) * nchunks
    while True:
        published, waiting = receiver.half("ipc").progress()
        if waiting == g + nbuf + 1 or published > g + nbuf or published == end:
            break
    state["rewritten"] += sum(not torch.equal(a, b) for (_, a), b in zip(items, snapshot))
    state["g"] += 1


class CheckingWorker(WorkerMixin):
    def __init__(self, seed: int, nbuf: int) -> None:
        self.model = MixedModel(seed=seed, big=100)
        self.state = {"g": 0, "sync": 0, "rewritten": 0, "receive_calls": 0}
        self.nbuf = nbuf
        self.weightsync_sink = LoadWeightsSink(self._load)

    def _load(self, items: Any) -> None:
        items = list(items)
        nchunks = len(self._ws_receiver.manifest.chunks)
        _check_slot(self._ws_receiver, items, self.state, self.nbuf, nchunks)
        own = dict(self.model.named_parameters()) | dict(self.model.named_buffers())
        for name, tensor in items:
            own[name].data.copy_(tensor)

    def ws_receive(self, call: Any) -> Any:
        self.state["receive_calls"] += 1
        self.state["sync"] = call.seq
        return super().ws_receive(call)

    def call(self, fn: Any, *args: Any) -> Any:
        return fn(self.model, *args)

    def counters(self) -> dict[str, int]:
        return dict(self.state)

    def pid(self) -> int:
        return os.getpid()


class CountingTrainer(TrainerHost):
    sends = 0

    def ws_send(self, *args: Any, **kwargs: Any) -> Any:
        self.sends += 1
        return super().ws_send(*args, **kwargs)

    def send_calls(self) -> int:
        return self.sends


@pytest.mark.parametrize("nbuf", [1, 2])
def test_ipc_slots_are_never_rewritten_while_a_worker_reads_and_each_side_gets_one_call(nbuf: int, actors: Any) -> None:
    # No tensor is split (the largest is 800 bytes), so every chunk reaches the sink.
    trainer = actors.add(
        ray.remote(CountingTrainer).options(num_cpus=0).remote(functools.partial(MixedModel, seed=0, big=100))
    )
    workers = [actors.add(ray.remote(CheckingWorker).options(num_cpus=0).remote(i + 1, nbuf)) for i in range(2)]
    with WeightSync(trainer, workers, transport="ipc", buffer_bytes=1024, num_buffers=nbuf) as ws:
        nchunks = len(ws.manifest.chunks)  # type: ignore[union-attr]
        assert nchunks >= 3
        for version in (1, 2, 3):
            get(trainer.call.remote(perturb, version))
            ws.sync(version)
            assert_workers_match(trainer, workers)
    assert get(trainer.send_calls.remote()) == 3
    for worker in workers:
        counters = get(worker.counters.remote())
        assert counters["rewritten"] == 0
        assert counters["g"] == 3 * nchunks  # the check ran on every chunk
        assert counters["receive_calls"] == 3


# --- the demo and job-submission entry points --------------------------------------------


def test_demo_command_in_a_small_configuration(ray_session: None, capsys: pytest.CaptureFixture[str]) -> None:
    from weightsync.tools.cli import main

    assert main(["demo", "--size", "1mb", "--steps", "3", "--workers", "2", "--transport", "broadcast"]) == 0
    out = capsys.readouterr().out
    assert "demo passed: 3 syncs to 2 worker(s)" in out
    assert out.count("  bit-exact\n") == 3
    assert "broadcast@3 broadcast@3" in out


def test_demo_joins_an_existing_cluster_the_way_ray_job_submit_runs_it(ray_session: None) -> None:
    # `ray job submit -- python -m weightsync demo` runs the entrypoint with RAY_ADDRESS set
    # to the cluster; this runs the same command the same way against this session's cluster.
    # The cluster lives on 127.0.0.1, so the joining driver keeps RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    # (a driver must see the node's address as its own); demo itself never sets it when joining.
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync", "demo", "--size", "1mb", "--steps", "2", "--workers", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ray: joined" in proc.stdout
    assert "demo passed: 2 syncs to 1 worker(s)" in proc.stdout


def test_user_actors_with_the_mixins(actors: Any) -> None:
    @ray.remote(num_cpus=0)
    class MyTrainer(TrainerMixin):
        def __init__(self) -> None:
            self.model = MixedModel(seed=0)

        def step(self, seed: int) -> None:
            perturb(self.model, seed)

        def call(self, fn: Any) -> Any:
            return fn(self.model)

        def pid(self) -> int:
            return os.getpid()

    @ray.remote(num_cpus=0)
    class MyWorker(WorkerMixin):
        def __init__(self) -> None:
            self.model = MixedModel(seed=9)

        def call(self, fn: Any) -> Any:
            return fn(self.model)

        def pid(self) -> int:
            return os.getpid()

    @ray.remote(num_cpus=0)
    class ForgotItsModel(WorkerMixin):
        def __init__(self) -> None:
            self.net = MixedModel(seed=9)  # not self.model, and no weightsync_model() override

        def pid(self) -> int:
            return os.getpid()

    trainer = actors.add(MyTrainer.remote())
    worker = actors.add(MyWorker.remote())
    with WeightSync(trainer, [worker], transport="broadcast", buffer_bytes=4096) as ws:
        get(trainer.step.remote(3))
        ws.sync(1)
        assert_workers_match(trainer, [worker])
    # After the with block: refused by name, not set up again and left open.
    with pytest.raises(ClosedError, match=r"sync\(version=2\) after close\(\).*setup\(\)"):
        ws.sync(2)
    with pytest.raises(ClosedError, match=r"verify\(\) after close\(\)"):
        ws.verify()
    ws.setup()  # opens it again
    get(trainer.step.remote(4))
    ws.sync(2)
    assert_workers_match(trainer, [worker])
    ws.close()
    forgot = actors.add(ForgotItsModel.remote())
    with pytest.raises(SetupError, match=r"ForgotItsModel mixes in WorkerMixin but has no self.model") as refused:
        WeightSync(trainer, {"forgot": forgot}, transport="broadcast").setup()
    assert refused.value.culprits == ["forgot"] and "weightsync_model()" in str(refused.value)


def test_a_model_or_an_actor_without_the_protocol_is_refused_when_a_weightsync_is_made(actors: Any) -> None:
    @ray.remote(num_cpus=0)
    class Plain:
        def pid(self) -> int:
            return os.getpid()

    model = MixedModel(seed=0)
    worker = actors.add(WorkerActor.options(num_cpus=0).remote(functools.partial(MixedModel, seed=1)))
    trainer = actors.add(TrainerActor.options(num_cpus=0).remote(functools.partial(MixedModel, seed=0)))
    plain = actors.add(Plain.remote())
    with pytest.raises(
        SettingsError, match=r"the trainer is a MixedModel \(an nn.Module\), not an actor.*TrainerActor"
    ):
        WeightSync(model, [worker])
    with pytest.raises(SettingsError, match=r"worker 'w' is a MixedModel \(an nn.Module\).*WorkerActor"):
        WeightSync(trainer, {"w": MixedModel(seed=2)})
    with pytest.raises(SettingsError, match=r"trainer-rank-1 is an actor class, not an actor: start it with .remote"):
        WeightSync([trainer, TrainerActor], [worker])
    with pytest.raises(SettingsError, match=r"worker 'p' is an actor of class Plain, which lacks the worker protocol"):
        WeightSync(trainer, {"p": plain})
    with pytest.raises(SettingsError, match=r"the trainer is an actor of class WorkerHost.*TrainerMixin"):
        WeightSync(worker, [trainer])
