"""LoRA syncs (``lora=True``) into module workers holding the same PEFT model.

The policy is the library's tiny transformer wrapped by PEFT (``get_peft_model``). Every
party builds its base model from another seed, so a worker whose base weights are still its
own after a sync shows that no base tensor travelled, while its adapter equals the trainer's
bit for bit. One trainer and one worker per transport for the module (their start costs
the PEFT import each); the refusals run in this process, on the endpoints themselves.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import ray
import torch
from torch import nn

peft = pytest.importorskip("peft", reason="PEFT is not installed (the test extra installs it)")

from tests.conftest import RAY_TIMEOUT, ActorPool  # noqa: E402
from tests.helpers import assert_bit_equal  # noqa: E402
from weightsync import TrainerActor, WeightReceiver, WeightSender, WeightSync, WorkerActor  # noqa: E402
from weightsync.core.lora.sink import AdapterSink  # noqa: E402
from weightsync.core.lora.source import send_adapter  # noqa: E402
from weightsync.core.sharded import ShardedSender  # noqa: E402
from weightsync.core.wire import ManifestError, ModelChangedError, SettingsError, SetupError, SyncSettings  # noqa: E402
from weightsync.core.wire.adapter import AdapterConfig  # noqa: E402
from weightsync.tools.models import PolicyFactory, train_step  # noqa: E402

TARGETS = ("qkv", "out", "gate_up", "down")


def peft_policy(
    seed: int, r: int = 4, alpha: float = 8.0, targets: tuple[str, ...] = TARGETS, **lora: Any
) -> nn.Module:
    """The 1mb policy (base weights from ``seed``) with a LoRA adapter on ``targets``; lora_B
    starts random (PEFT starts it at zero), so the adapter is not a no-op before training."""
    model = peft.get_peft_model(
        PolicyFactory("1mb", seed=seed)(),
        peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **lora),
    )
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter as PEFT saves it, copied."""
    return {n: t.clone() for n, t in peft.get_peft_model_state_dict(model, save_embedding_layers=False).items()}


def base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the model outside the adapter, copied."""
    return {n: t.detach().clone() for n, t in model.state_dict().items() if "lora_" not in n}


def get(ref: Any) -> Any:
    return ray.get(ref, timeout=RAY_TIMEOUT)


# --- module workers through Ray, every transport -------------------------------------------


@pytest.fixture(scope="module")
def parties(pool: ActorPool) -> Iterator[tuple[Any, dict[str, Any]]]:
    trainer = pool.add(TrainerActor.options(num_cpus=0).remote(functools.partial(peft_policy, 0)))
    workers = {
        t: pool.add(WorkerActor.options(num_cpus=0).remote(functools.partial(peft_policy, i + 1)))
        for i, t in enumerate(("direct", "ipc", "broadcast"))
    }
    yield trainer, workers


def test_two_trained_syncs_give_every_module_worker_the_adapter_bit_exact_and_leave_its_base(
    parties: tuple[Any, dict[str, Any]], no_shm_leftovers: None
) -> None:
    trainer, workers = parties
    bases = {t: get(w.call.remote(base_state)) for t, w in workers.items()}
    trainer_base = get(trainer.call.remote(base_state))
    model_bytes = sum(t.numel() * t.element_size() for t in trainer_base.values())
    with WeightSync(trainer, workers, transport={t: t for t in workers}, lora=True, timeout_s=60) as ws:
        assert ws.manifest is not None and ws.manifest.adapter is not None and ws.manifest.adapter.r == 4
        for version in (1, 2):
            before = get(trainer.call.remote(adapter_state))
            assert get(trainer.call.remote(train_step, version)) > 0
            expected = get(trainer.call.remote(adapter_state))
            assert any(not torch.equal(before[n], expected[n]) for n in expected), "training moved the adapter"
            report = ws.sync(version, verify=version == 2)
            adapter_bytes = sum(t.numel() * t.element_size() for t in expected.values())
            assert report.sent_bytes == report.bytes == adapter_bytes < model_bytes / 10
            assert report.adapter.startswith("LoRA r=4 alpha=8") and "LoRA r=4" in report.summary()
            assert {w.state for w in report.workers} == {"committed"}
            for transport, worker in workers.items():
                got = get(worker.call.remote(adapter_state))
                assert got.keys() == expected.keys(), transport
                for name in expected:
                    assert_bit_equal(got[name], expected[name], f"{transport}: {name}")
                base = get(worker.call.remote(base_state))
                for name, tensor in bases[transport].items():
                    assert torch.equal(base[name], tensor), f"{transport}: base tensor {name} was written"
                assert not torch.equal(
                    base["base_model.model.embed.weight"], trainer_base["base_model.model.embed.weight"]
                )
        assert ws.verify()


def test_a_worker_whose_adapter_differs_is_refused_at_setup_by_name_and_field(
    parties: tuple[Any, dict[str, Any]], pool: ActorPool
) -> None:
    trainer, _ = parties
    other = pool.add(WorkerActor.options(num_cpus=0).remote(functools.partial(peft_policy, 1, alpha=16.0)))
    with pytest.raises(SetupError, match=r"(?s)odd-one.*lora_alpha: 8\.0 on the trainer, 16\.0 on odd-one") as info:
        WeightSync(trainer, {"odd-one": other}, transport="ipc", lora=True, timeout_s=60).setup()
    assert info.value.culprits == ["odd-one"]


# --- the endpoints, in this process --------------------------------------------------------


def trainer_manifest(model: nn.Module, **settings: Any) -> Any:
    sender = WeightSender(model=model)
    send_adapter(sender, True)
    return sender, sender.manifest(SyncSettings(lora=True, **settings))


def test_the_manifest_lists_only_the_adapter_under_peft_checkpoint_names() -> None:
    model = peft_policy(0)
    _, manifest = trainer_manifest(model)
    assert list(manifest.names) == list(adapter_state(model))
    assert all(".lora_A.weight" in n or ".lora_B.weight" in n for n in manifest.names)
    assert manifest.adapter == AdapterConfig.of_peft(model.peft_config["default"])
    assert manifest.adapter.target_modules == tuple(sorted(TARGETS))
    again = pickle.loads(pickle.dumps(manifest))
    again.validate()
    assert again.adapter == manifest.adapter


@pytest.mark.parametrize(
    ("worker", "field"),
    [
        (functools.partial(peft_policy, 1, r=8), "r: 4 on the trainer, 8 on w"),
        (functools.partial(peft_policy, 1, use_rslora=True), "use_rslora: False on the trainer, True on w"),
        (functools.partial(peft_policy, 1, targets=("qkv", "out")), "target_modules:"),
        (functools.partial(peft_policy, 1, use_dora=True), "use_dora:"),
        (functools.partial(peft_policy, 1, modules_to_save=["norm"]), "modules_to_save:"),
        (functools.partial(PolicyFactory("1mb", seed=1)), "w holds a TinyPolicy, not a PEFT model"),
    ],
)
def test_each_difference_in_meaning_is_refused_naming_the_worker_and_the_field(worker: Any, field: str) -> None:
    _, manifest = trainer_manifest(peft_policy(0))
    receiver = WeightReceiver(worker(), name="w")
    with pytest.raises(ManifestError, match=field):
        receiver.accept(manifest)


def test_dropout_and_the_adapter_name_do_not_matter_and_a_module_worker_takes_the_adapter() -> None:
    _, manifest = trainer_manifest(peft_policy(0))
    worker = peft.get_peft_model(
        PolicyFactory("1mb", seed=1)(),
        peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), lora_dropout=0.3),
        adapter_name="policy",
    )
    receiver = WeightReceiver(worker, name="w")
    assert receiver.accept(manifest) == ()
    assert isinstance(receiver.sink, AdapterSink) and receiver.sink.adapter.name == "policy"
    full = WeightSender(model=worker).manifest(SyncSettings())  # a whole-model session again
    receiver.accept(full)
    assert receiver.sink is receiver.model_sink


def test_the_trainer_refuses_a_model_without_one_active_lora_adapter_naming_itself() -> None:
    sender = WeightSender(model=PolicyFactory("1mb", seed=0)(), name="trainer")
    with pytest.raises(SettingsError, match="trainer: a LoRA sync needs a PEFT model"):
        send_adapter(sender, True)
    model = peft_policy(0)
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["qkv"]))
    model.base_model.set_adapter(["default", "second"])
    with pytest.raises(SettingsError, match=r"2 active \(\['default', 'second'\]\)"):
        send_adapter(WeightSender(model=model), True)
    send_adapter(WeightSender(model=model), False)  # lora=False leaves a sender alone
    with pytest.raises(SettingsError, match="trainer-rank-0: lora=True is not supported for a sharded"):
        send_adapter(ShardedSender(model=peft_policy(0), name="trainer-rank-0"), True)


def test_a_config_changed_after_setup_stops_the_next_sync_naming_the_field() -> None:
    model = peft_policy(0)
    sender, _ = trainer_manifest(model)
    assert len(sender.checked_sources().tensors) == len(adapter_state(model))
    model.peft_config["default"].lora_alpha = 32
    with pytest.raises(ModelChangedError, match="lora_alpha: 8.0 on the trainer, 32.0"):
        sender.checked_sources()


def test_adapter_configs_refuse_bad_values_naming_the_field() -> None:
    good = AdapterConfig(r=4, lora_alpha=8, target_modules=("q",))
    for field, value in (("r", 0), ("lora_alpha", float("nan")), ("use_dora", 1), ("rank_pattern", (("q", 0),))):
        with pytest.raises(ManifestError, match=field):
            replace(good, **{field: value})
    with pytest.raises(ManifestError, match="LoRA adapters only"):
        replace(good, peft_type="IA3")
