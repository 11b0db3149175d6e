"""The one-copy ``direct`` transport on the CPU (shared memory): the same code as on a GPU.

A sync is one call per side meeting on a control block: the worker announces (ready, or
stale when its tensors moved since the export), the trainer writes, the worker commits.
"""

from __future__ import annotations

import collections
import functools
import os
from typing import Any

import pytest
import ray
import torch
from torch import nn

from tests.helpers import MixedModel, assert_bit_equal, perturb, random_tensor, state_of
from tests.test_ray_e2e import assert_workers_match, get
from weightsync import Status, SyncError, WeightSync
from weightsync.core.sender import WeightSender
from weightsync.core.sinks import ModuleSink, module_tensors
from weightsync.core.tensor_paths import TensorPaths
from weightsync.core.wire import ManifestError, ModelChangedError, SyncSettings
from weightsync.glue.actors import TrainerHost, WorkerHost
from weightsync.mechanisms.pace import NO_SPIN


class Worker(WorkerHost):
    def direct_exports(self) -> int:
        return self._ws_receiver.half("direct").exports_made

    def move_storage(self, name: str, new_object: bool, seed: int) -> list[float]:
        """Give ``name`` new storage, as a reload would: ``p.data = ...`` or a new Parameter.
        Returns the old tensor's values, which no later sync may touch."""
        module_name, _, attr = name.rpartition(".")
        owner = self.model.get_submodule(module_name) if module_name else self.model
        old = getattr(owner, attr)
        self._old = old.data  # kept alive: a stale write would land here
        fresh = random_tensor(tuple(old.shape), old.dtype, seed)
        if new_object:
            setattr(owner, attr, nn.Parameter(fresh, requires_grad=old.requires_grad))
        else:
            old.data = fresh
        return self._old.float().flatten().tolist()

    def old_values(self) -> list[float]:
        return self._old.float().flatten().tolist()


def pair(actors: Any, n: int = 1, worker_cls: type = Worker) -> tuple[Any, list[Any]]:
    trainer = actors.add(ray.remote(TrainerHost).options(num_cpus=0).remote(functools.partial(MixedModel, seed=0)))
    workers = [
        actors.add(ray.remote(worker_cls).options(num_cpus=0).remote(functools.partial(MixedModel, seed=i + 1)))
        for i in range(n)
    ]
    return trainer, workers


@pytest.mark.parametrize("new_object", [False, True], ids=["data-assigned", "new-parameter"])
def test_a_worker_whose_tensor_moved_is_reexported_and_the_old_storage_never_written(
    new_object: bool, actors: Any
) -> None:
    trainer, (moving, steady) = pair(actors, 2)
    with WeightSync(trainer, {"moving": moving, "steady": steady}, transport="direct") as ws:
        get(trainer.call.remote(perturb, 1))
        ws.sync(1)
        old = get(moving.move_storage.remote("linear.weight", new_object, 77))
        get(trainer.call.remote(perturb, 2))
        report = ws.sync(2, verify=new_object)  # a verified sync re-exports the same way
        assert [w.version for w in report.workers] == [2, 2]
        assert get(moving.direct_exports.remote()) == 2
        assert get(steady.direct_exports.remote()) == 1
        assert get(moving.old_values.remote()) == old
        assert_workers_match(trainer, [moving, steady])
        get(trainer.call.remote(perturb, 3))
        ws.sync(3)
        assert get(moving.direct_exports.remote()) == 2
        assert_workers_match(trainer, [moving, steady])


class DiesBeforeAnnouncing(Worker):
    def ws_receive(self, call: Any) -> Any:
        if call.version == 2:
            os._exit(3)
        return super().ws_receive(call)


class DiesWhileWritten(Worker):
    def ws_receive(self, call: Any) -> Any:
        if call.version == 2:
            # Dies in its wait for the write, after announcing it is ready.
            self._ws_receiver.half("direct")._control.wait = lambda *args, **kwargs: os._exit(3)
        return super().ws_receive(call)


@pytest.mark.parametrize("doomed_cls", [DiesBeforeAnnouncing, DiesWhileWritten], ids=["before", "during-write"])
def test_a_worker_killed_during_a_direct_sync_is_named_and_the_trainer_goes_on(doomed_cls: type, actors: Any) -> None:
    trainer, (healthy,) = pair(actors, 1)
    doomed = actors.add(ray.remote(doomed_cls).options(num_cpus=0).remote(functools.partial(MixedModel, seed=5)))
    ws = WeightSync(trainer, {"healthy": healthy, "doomed": doomed}, transport="direct", timeout_s=60)
    ws.sync(1)
    get(trainer.call.remote(perturb, 2))
    with pytest.raises(SyncError) as info:
        ws.sync(2)
    assert info.value.dead == ["doomed"]
    assert info.value.outcomes["doomed"].status is Status.DEAD and info.value.culprits == ["doomed"]
    get(trainer.call.remote(perturb, 3))
    assert ws.sync(3).workers[0].version == 3
    assert_workers_match(trainer, [healthy])
    ws.close()


class TrainerDiesInSend(TrainerHost):
    def ws_send(self, *args: Any) -> Any:
        os._exit(3)


def test_a_trainer_killed_before_writing_leaves_workers_dirty_at_their_old_version_quickly(actors: Any) -> None:
    trainer = actors.add(
        ray.remote(TrainerDiesInSend).options(num_cpus=0).remote(functools.partial(MixedModel, seed=0))
    )
    (worker,) = pair(actors, 1)[1]
    # A long timeout: the worker must notice the trainer's process ended, not time out.
    ws = WeightSync(trainer, [worker], transport="direct", timeout_s=600)
    ws.setup()
    held = get(worker.call.remote(state_of))
    with pytest.raises(SyncError) as info:
        ws.sync(1)
    assert info.value.outcomes["trainer"].status is Status.DEAD
    assert info.value.culprits == ["trainer"]
    assert info.value.outcomes["worker-0"].error == "PeerAborted"  # saw the process end, no deadline
    assert get(worker.version.remote()) == (None, "dirty")
    now = get(worker.call.remote(state_of))
    for name in held:
        assert_bit_equal(now[name], held[name], name)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        self.again = self.block  # the same submodule twice
        self.head = nn.Linear(4, 11, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("steps", torch.tensor(3))
        self.register_buffer("cache", torch.zeros(2), persistent=False)
        self.block[1].register_buffer("scale", torch.ones(4))


def test_tensor_paths_notice_every_replaced_link_and_nothing_else() -> None:
    model = Tied()
    names = [n for n, _ in module_tensors(model)]
    paths = TensorPaths(model, names)
    assert [id(t) for t in paths.tensors] == [id(t) for _, t in module_tensors(model)]
    assert paths.unchanged()
    model.block[0].weight.data = torch.randn(4, 4)  # same object, new storage: callers check pointers
    model.cache = torch.ones(2)  # non-persistent: never synced
    assert TensorPaths(model, names).unchanged() and paths.unchanged()
    changes = [
        lambda m: setattr(m.block[0], "weight", nn.Parameter(torch.randn(4, 4))),
        lambda m: setattr(m.head, "weight", nn.Parameter(torch.randn(11, 4))),  # untied
        lambda m: m.block.__setitem__(1, nn.LayerNorm(4)),
        lambda m: setattr(m, "steps", torch.tensor(4)),
        lambda m: setattr(m, "again", nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))),
    ]
    for i, change in enumerate(changes):
        model = Tied()
        paths = TensorPaths(model, [n for n, _ in module_tensors(model)])
        change(model)
        assert not paths.unchanged(), f"change {i} went unnoticed"


def test_tensor_paths_look_up_a_table_of_another_mapping_type_through_its_own_get() -> None:
    """A table set by hand to a mapping that is not a dict is checked as well."""
    model = Tied()
    model.block[0]._parameters = collections.UserDict(model.block[0]._parameters)  # type: ignore[assignment]
    paths = TensorPaths(model, [n for n, _ in module_tensors(model)])
    assert paths.unchanged()
    model.block[0].weight = nn.Parameter(torch.randn(4, 4))
    assert not paths.unchanged()


@pytest.mark.parametrize("buffer,persistent", [("steps", False), ("cache", True)], ids=["made-transient", "made-kept"])
def test_a_buffer_whose_persistence_flips_is_noticed_by_the_cached_paths(buffer: str, persistent: bool) -> None:
    """``register_buffer`` on a registered name with the other ``persistent`` keeps every
    table's objects and counts: the cached paths must still send the sender and the sink
    back to the full check, which refuses the changed model by name."""
    model = Tied()
    paths = TensorPaths(model, [n for n, _ in module_tensors(model)])
    sender = WeightSender(model)
    manifest = sender.manifest(SyncSettings(buffer_bytes=4096))
    sender.checked_sources()  # the full check, which the next ones skip while nothing changed
    sink = ModuleSink(Tied())
    sink.destinations(manifest)
    for module in (model, sink.module):
        module.register_buffer(buffer, getattr(module, buffer), persistent=persistent)
    assert not paths.unchanged()
    change = "removed" if not persistent else "added"
    with pytest.raises(ModelChangedError, match=f"{buffer} {change}"):
        sender.checked_sources()
    if not persistent:
        with pytest.raises(ModelChangedError, match=f"no longer in the model: {buffer}"):
            sink.destinations(manifest)
    else:  # a worker may hold more than the manifest: it takes the sync, its tensors walked again
        sink.destinations(manifest)
        assert buffer in sink._by_name


def test_sender_sees_a_replaced_parameter_and_refuses_a_reshaped_one() -> None:
    model = MixedModel(seed=0)
    sender = WeightSender(model)
    manifest = sender.manifest(SyncSettings(buffer_bytes=4096))
    first = sender.sources()
    fresh = nn.Parameter(random_tensor(tuple(model.linear.weight.shape), model.linear.weight.dtype, 9))
    model.linear.weight = fresh
    second = sender.sources()
    index = manifest.names.index("linear.weight")
    assert second[index].data_ptr() == fresh.data_ptr() != first[index].data_ptr()
    model.linear.weight.data = random_tensor((3, 3), model.linear.weight.dtype, 10)
    with pytest.raises(ManifestError, match=r"linear.weight is now \[3, 3\]"):
        sender.sources()
    model.linear.weight = nn.Parameter(random_tensor((3, 3), model.linear.weight.dtype, 11))
    with pytest.raises(ManifestError, match=r"linear.weight is now \[3, 3\]"):
        sender.sources()


def test_sender_keeps_its_copy_key_until_a_tensor_gets_new_storage() -> None:
    model = MixedModel(seed=0)
    sender = WeightSender(model)
    manifest = sender.manifest(SyncSettings(buffer_bytes=4096))
    index = manifest.names.index("linear.weight")
    full = sender.checked_sources()  # the full check, which names every tensor
    first, key = full.tensors, full.key
    again = sender.checked_sources()
    tensors, same = again.tensors, again.key
    assert same is key  # nothing moved: a copy plan keyed on it is reused by identity
    assert [t.data_ptr() for t in tensors] == [t.data_ptr() for t in first]
    assert tensors[index] is model.linear.weight  # the parameter itself, copied under no_grad
    model.linear.weight.data = random_tensor(tuple(model.linear.weight.shape), model.linear.weight.dtype, 12)
    moved = sender.checked_sources().key
    assert moved is not key and moved != key
    assert moved[index][0] == model.linear.weight.data_ptr() != key[index][0]
    assert [t.requires_grad for t in sender.sources()] == [False] * len(manifest.specs)


def test_direct_sync_of_a_large_model_is_bit_exact_after_training_steps(actors: Any) -> None:
    from weightsync.tools.models import PolicyFactory, train_step

    trainer = actors.add(ray.remote(TrainerHost).options(num_cpus=0).remote(PolicyFactory("1mb", 0)))
    worker = actors.add(ray.remote(Worker).options(num_cpus=0).remote(PolicyFactory("1mb", 1)))
    with WeightSync(trainer, [worker], transport="direct") as ws:
        for step in range(1, 4):
            get(trainer.call.remote(train_step, step))
            report = ws.sync(step)
            assert report.send_seconds > 0
            assert report.chunks == len(ws.manifest.chunks)  # type: ignore[union-attr]  # as the demo header says
            expected, got = get(trainer.call.remote(state_of)), get(worker.call.remote(state_of))
            for name in expected:
                assert_bit_equal(got[name], expected[name], name)


class MiswritingTrainer(TrainerHost):
    """Fault injection for the test: flip one bit in each worker's first tensor right after
    the next direct copy, before the trainer reports it written."""

    def miswrite_next(self) -> None:
        writer = self._ws().half("direct")
        assert writer is not None
        original = writer._streams.drain

        def drain(deadline: float, what: str, own: bool = False, spin: tuple[float, float] = NO_SPIN) -> None:
            original(deadline, what, own, spin)
            for mapped in writer._mapped.values():
                first = next(d for d in mapped.destinations if d is not None)
                first.reshape(-1).view(torch.uint8)[0] ^= 1
            writer._streams.drain = original  # type: ignore[method-assign]

        writer._streams.drain = drain  # type: ignore[method-assign]


def test_direct_verify_catches_a_bad_write_names_the_tensor_and_the_next_sync_repairs(actors: Any) -> None:
    trainer = actors.add(
        ray.remote(MiswritingTrainer).options(num_cpus=0).remote(functools.partial(MixedModel, seed=0))
    )
    (worker,) = pair(actors, 1)[1]
    ws = WeightSync(trainer, [worker], transport="direct", verify=True, timeout_s=60)
    assert ws.sync(1).verified
    get(trainer.miswrite_next.remote())
    get(trainer.call.remote(perturb, 2))
    with pytest.raises(SyncError) as info:
        ws.sync(2)
    assert info.value.culprits == ["worker-0"]
    outcome = info.value.outcomes["worker-0"]
    assert outcome.error == "ChecksumMismatch" and ws.manifest.names[0] in outcome.message  # type: ignore[union-attr]
    assert info.value.held["worker-0"] == (1, "dirty")
    get(trainer.call.remote(perturb, 3))
    assert ws.sync(3).verified
    assert_workers_match(trainer, [worker])
    ws.close()
