"""Delta syncs through Ray actors over broadcast (gloo): bit-exact over many versions with
real optimizer steps, sent bytes and per-worker dense/delta in the report, a rejoining
worker and a dirty worker getting dense syncs, a load_weights worker rebuilding from its
own copy."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import ray
import torch
from torch import nn

import weightsync
from tests.catalogue import Loading, arm, assert_workers_match, get, worker_of
from tests.helpers import MixedModel, loads_by_name, perturb
from weightsync import TrainerActor
from weightsync.core.sinks import module_tensors
from weightsync.glue.actors import WorkerHost
from weightsync.tools.models import PolicyConfig, build_policy, train_step

SIZE = PolicyConfig(vocab=512, dim=64, layers=2, heads=4, ffn=128)


def policy(dtype: str, seed: int) -> nn.Module:
    from dataclasses import replace

    return build_policy(replace(SIZE, dtype=dtype, seed=seed))


def loading_policy(seed: int) -> nn.Module:
    """A bf16 policy that loads the way engines do: ``load_weights`` by name, a copy each."""
    model = policy("bfloat16", seed)
    return loads_by_name(model, dict(module_tensors(model)))


def wire_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Run in the trainer: every tensor as it travels (bf16 for floating ones)."""
    return {n: t.detach().to(torch.bfloat16 if t.is_floating_point() else t.dtype) for n, t in module_tensors(model)}


def held_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in module_tensors(model)}


def assert_same(trainer: Any, workers: list[Any]) -> None:
    expected = get(trainer.call.remote(wire_state))
    for worker in workers:
        got = get(worker.call.remote(held_state))
        for name, tensor in expected.items():
            assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name


def encodings(report: weightsync.SyncReport) -> dict[str, str]:
    return {w.name: w.encoding for w in report.workers}


def test_adamw_steps_travel_as_deltas_bit_exact_and_a_rejoining_worker_gets_dense(actors: Any) -> None:
    trainer = actors.add(
        TrainerActor.options(num_cpus=0).remote(functools.partial(policy, "float32", 0), wire_dtype=torch.bfloat16)
    )
    workers = [worker_of(actors, functools.partial(policy, "bfloat16", i + 1)) for i in range(2)]
    names = {"w0": workers[0], "w1": workers[1]}
    with weightsync.WeightSync(trainer, names, transport="broadcast", delta=True, timeout_s=60) as ws:
        first = ws.sync(1)
        assert set(encodings(first).values()) == {"dense"} and first.sent_bytes > first.bytes
        for version in range(2, 6):
            get(trainer.call.remote(train_step, version, 1e-6))
            report = ws.sync(version, verify=version == 3)
            assert encodings(report) == {"w0": "delta", "w1": "delta"}, report.summary()
            assert report.sent_bytes < 0.5 * report.bytes, report.summary()
            assert "delta" in report.summary() and "sent" in report.summary()
            assert_same(trainer, workers)
        ws.verify()
        # A worker that leaves and a fresh one that joins: it holds nothing the base names.
        ws.remove_worker("w1")
        fresh = worker_of(actors, functools.partial(policy, "bfloat16", 9))
        ws.add_worker(fresh, "w2")
        get(trainer.call.remote(train_step, 6, 1e-6))
        joined = ws.sync(6)
        assert encodings(joined) == {"w0": "dense", "w2": "dense"}  # one group: dense for all
        get(trainer.call.remote(train_step, 7, 1e-6))
        assert encodings(ws.sync(7)) == {"w0": "delta", "w2": "delta"}
        assert_same(trainer, [workers[0], fresh])


def test_a_dirty_worker_never_gets_a_delta_and_keyframes_are_dense(actors: Any) -> None:
    trainer = actors.add(TrainerActor.options(num_cpus=0).remote(functools.partial(MixedModel, seed=0, big=600)))
    steady = worker_of(actors, functools.partial(MixedModel, seed=1, big=600))
    flaky = worker_of(actors, functools.partial(Loading, seed=2, big=600), sink="load_weights")
    workers = {"steady": steady, "flaky": flaky}
    transport = {"steady": "broadcast", "flaky": "broadcast"}
    with weightsync.WeightSync(
        trainer, workers, transport=transport, delta=True, delta_keyframe=4, buffer_bytes=1024, timeout_s=30
    ) as ws:
        get(trainer.call.remote(perturb, 1))
        ws.sync(1)
        get(trainer.call.remote(nudge, 2))
        assert encodings(ws.sync(2)) == {"steady": "delta", "flaky": "delta"}
        get(flaky.call.remote(arm, "raise", 1))
        get(trainer.call.remote(nudge, 3))
        with pytest.raises(weightsync.SyncError):
            ws.sync(3)
        assert ws.status()["flaky"] == (2, "dirty")
        report = ws.sync(3)  # the dirty worker holds a mix: dense, and so its whole group
        assert encodings(report) == {"steady": "dense", "flaky": "dense"}
        assert_workers_match(trainer, workers.values())
        get(trainer.call.remote(nudge, 4))
        assert set(encodings(ws.sync(4)).values()) == {"dense"}  # the 4th sync is a keyframe
        get(trainer.call.remote(nudge, 5))
        assert set(encodings(ws.sync(5)).values()) == {"delta"}
        assert_workers_match(trainer, workers.values())
        ws.verify()


def nudge(model: nn.Module, seed: int) -> None:
    """Run in the trainer: new random bits in about 2% of each tensor's elements."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, tensor in module_tensors(model):
            flat = tensor.view(-1)
            if flat.numel():
                picked = torch.rand(flat.numel(), generator=gen) < 0.02
                picked[0] = True
                fresh = torch.randint(0, 256, (flat.numel() * flat.element_size(),), dtype=torch.uint8, generator=gen)
                flat[picked] = fresh.view(flat.dtype)[picked] if flat.dtype != torch.bool else ~flat[picked]


def test_ipc_and_broadcast_workers_in_one_sync_each_get_deltas_bit_exact(actors: Any) -> None:
    """ipc carries deltas too: a module sink patches in place, a load_weights sink rebuilds
    from its own copy; each worker's sent_bytes are its transport's."""
    trainer = actors.add(
        TrainerActor.options(num_cpus=0).remote(functools.partial(policy, "float32", 0), wire_dtype=torch.bfloat16)
    )
    workers = {
        "shm-module": worker_of(actors, functools.partial(policy, "bfloat16", 1)),
        "shm-loader": worker_of(actors, functools.partial(loading_policy, 2), sink="load_weights"),
        "remote": worker_of(actors, functools.partial(policy, "bfloat16", 3)),
    }
    transport = {"shm-module": "ipc", "shm-loader": "ipc", "remote": "broadcast"}
    with weightsync.WeightSync(
        trainer, workers, transport=transport, delta=True, buffer_bytes=64 * 1024, timeout_s=60
    ) as ws:
        first = ws.sync(1)
        assert set(encodings(first).values()) == {"dense"}
        assert first.sent_bytes > first.bytes  # the header and every byte
        assert {w.sent_bytes for w in first.workers} == {first.sent_bytes}
        for version in range(2, 5):
            get(trainer.call.remote(train_step, version, 1e-6))
            report = ws.sync(version, verify=version == 3)
            assert set(encodings(report).values()) == {"delta"}, report.summary()
            sent = {w.name: w.sent_bytes for w in report.workers}
            assert report.sent_bytes == max(sent.values()) < report.bytes / 2, report.summary()
            assert sent["shm-module"] == sent["shm-loader"], sent  # one ipc transport, one stream
            assert_same(trainer, list(workers.values()))
        ws.verify()


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_a_staging_worker_in_a_delta_session_is_sent_dense_syncs_bit_exact(transport: str, actors: Any) -> None:
    """A stage is fresh every sync, so it holds no base a delta could patch: a staging worker
    says it holds nothing a delta applies to, and it (with the stream it shares) gets dense
    bytes every sync; a plain worker alone in another session gets deltas."""
    trainer = actors.add(TrainerActor.options(num_cpus=0).remote(functools.partial(MixedModel, seed=0, big=600)))
    staging = worker_of(actors, functools.partial(MixedModel, seed=1, big=600), stage="auto")
    plain = worker_of(actors, functools.partial(MixedModel, seed=2, big=600))
    both = {"staging": staging, "plain": plain}
    with weightsync.WeightSync(trainer, both, transport=transport, delta=True, buffer_bytes=1024, timeout_s=30) as ws:
        for version in range(1, 4):
            get(trainer.call.remote(nudge, version))
            report = ws.sync(version, verify=version == 2)
            assert encodings(report) == {"staging": "dense", "plain": "dense"}, report.summary()
            assert report.workers[0].stage is not None or report.workers[1].stage is not None
            assert_workers_match(trainer, both.values())
    with weightsync.WeightSync(trainer, {"plain": plain}, transport=transport, delta=True, timeout_s=30) as ws:
        ws.sync(4)
        get(trainer.call.remote(nudge, 5))
        assert encodings(ws.sync(5)) == {"plain": "delta"}
        assert_workers_match(trainer, [plain])


class _StagingSwitch(WorkerHost):
    """A load_weights worker whose staging its owner turns on and off between syncs."""

    def set_staged(self, staged: bool) -> None:
        self.weightsync_sink.set_staged(staged)


StagingSwitch: Any = ray.remote(_StagingSwitch)


def test_a_worker_that_starts_or_stops_staging_between_delta_syncs_never_patches_a_stage(actors: Any) -> None:
    """Staging turned on: the next delta is refused by that worker before any byte lands
    (named), and its syncs are dense from then on; turned off: one dense sync refills its
    copy of the wire bytes, then deltas again. Bit-exact throughout."""
    trainer = actors.add(TrainerActor.options(num_cpus=0).remote(functools.partial(MixedModel, seed=0, big=600)))
    worker = actors.add(
        StagingSwitch.options(num_cpus=0).remote(functools.partial(Loading, seed=2, big=600), sink="load_weights")
    )
    with weightsync.WeightSync(trainer, {"w": worker}, transport="broadcast", delta=True, buffer_bytes=1024) as ws:
        ws.sync(1)
        get(trainer.call.remote(nudge, 2))
        assert encodings(ws.sync(2)) == {"w": "delta"}
        get(worker.set_staged.remote(True))
        get(trainer.call.remote(nudge, 3))
        with pytest.raises(weightsync.SyncError) as refused:
            ws.sync(3)
        assert "w" in refused.value.culprits and ws.status()["w"] == (2, "committed"), str(refused.value)
        for version in (3, 4):
            report = ws.sync(version)
            assert encodings(report) == {"w": "dense"} and report.workers[0].stage is not None, report.summary()
            assert_workers_match(trainer, [worker])
            get(trainer.call.remote(nudge, version + 1))
        get(worker.set_staged.remote(False))
        assert encodings(ws.sync(5)) == {"w": "dense"}
        get(trainer.call.remote(nudge, 6))
        assert encodings(ws.sync(6)) == {"w": "delta"}
        assert_workers_match(trainer, [worker])
