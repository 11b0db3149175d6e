"""Casts on load: a load_weights worker may hold another floating dtype than the wire's.

The handshake accepts the difference for a sink that casts (it records each tensor's cast,
and every SyncReport counts them per worker, lossy ones named in the summary); a module
sink or a direct worker, which take the wire's bytes as they are, is refused naming the
tensor, the worker and the settings to change. The real vLLM engine is in test_vllm_casts.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import pytest
import ray
import torch
from torch import nn

from tests import fsdp_model as fm
from tests.conftest import RAY_TIMEOUT, ActorPool
from tests.helpers import assert_bit_equal
from weightsync import CastCount, LoadWeightsSink, TensorCast, TrainerActor, WeightReceiver, WeightSync, WorkerActor
from weightsync.core.sinks import module_tensors
from weightsync.core.wire import Manifest, ManifestError, SetupError, TensorSpec
from weightsync.core.wire.casts import count_casts, loss
from weightsync.glue.actors import WorkerHost

SHAPE = {"vocab": 40, "dim": 16, "blocks": 2}
F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16


def get(ref: Any) -> Any:
    return ray.get(ref, timeout=RAY_TIMEOUT)


def specs(dtypes: dict[str, torch.dtype]) -> list[TensorSpec]:
    return [TensorSpec.of(name, torch.empty(3, 2, dtype=dtype, device="meta")) for name, dtype in dtypes.items()]


@pytest.mark.parametrize(
    ("wire", "held", "loses"),
    [
        (BF16, F32, None),
        (F16, F32, None),
        (F32, F64, None),
        (F32, BF16, "precision"),
        (F16, BF16, "precision"),
        (F32, F16, "range"),
        (BF16, F16, "range"),
        (F64, F32, "range"),
    ],
)
def test_what_a_cast_loses(wire: torch.dtype, held: torch.dtype, loses: str | None) -> None:
    assert loss(wire, held) == loses
    info = torch.finfo(wire)
    # The wire's extremes and its finest step above 1: all held exactly, or not, as said.
    sent = torch.tensor([info.max, -info.max, info.tiny, 1 + info.eps], dtype=torch.float64).to(wire)
    back = sent.to(held).to(wire)
    assert torch.equal(back, sent) == (loses is None)
    if loses == "range":  # an extreme overflows or underflows
        assert bool((back[:3].isinf() | (back[:3] == 0)).any())


def test_a_sink_that_casts_is_accepted_and_each_cast_recorded() -> None:
    manifest = Manifest.build(specs({"a": BF16, "b": BF16, "ids": torch.int64, "c": F32}))
    local = specs({"a": F32, "b": F16, "ids": torch.int64, "c": F32})
    casts = manifest.check_against(local, "engine", may_cast=True)
    assert casts == (
        TensorCast(name="a", wire="bfloat16", held="float32"),
        TensorCast(name="b", wire="bfloat16", held="float16"),
    )
    assert [c.loses for c in casts] == [None, "range"]
    assert count_casts(casts) == (
        CastCount(wire="bfloat16", held="float32", tensors=1, loses=None, first="a"),
        CastCount(wire="bfloat16", held="float16", tensors=1, loses="range", first="b"),
    )
    assert manifest.check_against(specs({"a": BF16, "b": BF16, "ids": torch.int64, "c": F32}), may_cast=True) == ()


@pytest.mark.parametrize("held", [torch.int32, torch.float8_e4m3fn])
def test_a_sink_that_casts_still_refuses_ints_and_fp8_naming_the_fix(held: torch.dtype) -> None:
    manifest = Manifest.build(specs({"a": torch.int64 if held == torch.int32 else BF16, "b": BF16}))
    with pytest.raises(ManifestError) as refused:
        manifest.check_against(specs({"a": held, "b": F32}), "engine", may_cast=True)
    text = str(refused.value)
    assert "a: dtype" in text and "engine" in text and "(1 problem(s))" in text  # b's cast is accepted
    assert "float32 held" not in text  # the fix names only the refused dtypes
    assert "wire_dtype" in text and "float16" in text  # what casts are possible
    with pytest.raises(ManifestError, match="no cast"):
        TensorCast(name="a", wire="bfloat16", held=str(held).removeprefix("torch."))


def test_a_module_sink_is_refused_naming_tensor_worker_and_both_settings() -> None:
    model = fm.plain_lm(0, F32, **SHAPE)
    manifest = Manifest.build([TensorSpec.of(n, t, BF16) for n, t in module_tensors(model)])
    receiver = WeightReceiver(model, name="worker-0")
    with pytest.raises(ManifestError) as refused:
        receiver.accept(manifest)
    text = str(refused.value)
    assert "worker-0" in text and "head.weight: dtype bfloat16 on the trainer, float32 on worker-0" in text
    assert "wire_dtype=torch.float32" in text and "dtype='bfloat16'" in text and "cannot cast" in text
    assert receiver.manifest is None  # no session was started


def test_a_load_weights_receiver_returns_and_keeps_its_casts() -> None:
    model = fm.plain_lm(0, F16, **SHAPE)
    held = dict(module_tensors(model))
    sink = LoadWeightsSink(lambda items: None, expected_specs=[TensorSpec.of(n, t) for n, t in held.items()])
    manifest = Manifest.build([TensorSpec.of(n, t, BF16) for n, t in held.items()])
    receiver = WeightReceiver(sink, name="lw")
    casts = receiver.accept(manifest)
    assert receiver.casts == casts and {c.name for c in casts} == set(held)
    assert count_casts(casts) == (
        CastCount(wire="bfloat16", held="float16", tensors=len(held), loses="range", first=manifest.names[0]),
    )


class _LoadingHost(WorkerHost):
    """A worker whose sink is ``load_weights`` (copy_ by name: casts), expecting its own tensors."""

    def __init__(self, model_factory: Any) -> None:
        super().__init__(model_factory)
        mine = module_tensors(self.model)
        self.weightsync_sink = LoadWeightsSink(self._load, expected_specs=[TensorSpec.of(n, t) for n, t in mine])

    def _load(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        held = dict(module_tensors(self.model))
        for name, tensor in items:
            held[name].copy_(tensor)


LoadingWorker: Any = ray.remote(_LoadingHost)


def inflate(model: nn.Module, count: int) -> str:
    """Run in the trainer: set ``count`` values of its first tensor beyond fp16's range (but
    within bf16's), keeping the old ones for :func:`deflate`; returns the tensor's name."""
    name, tensor = module_tensors(model)[0]
    with torch.no_grad():
        flat = tensor.view(-1)
        model._inflated = flat[:count].clone()  # type: ignore[assignment]
        flat[:count] = torch.tensor([1e6, -3e5, 7e4][:count], dtype=flat.dtype)
    return name


def deflate(model: nn.Module) -> None:
    kept: torch.Tensor = model._inflated  # type: ignore[assignment]
    with torch.no_grad():
        module_tensors(model)[0][1].view(-1)[: kept.numel()] = kept


def _trainer_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in module_tensors(model)}


@pytest.mark.parametrize("wire", [None, BF16])
def test_a_load_weights_worker_in_fp16_takes_the_wire_cast_and_the_report_lists_it(
    wire: torch.dtype | None, actors: ActorPool
) -> None:
    trainer = actors.add(
        TrainerActor.options(num_cpus=0).remote(partial(fm.plain_lm, 1, F32, **SHAPE), wire_dtype=wire)
    )
    fp16 = actors.add(LoadingWorker.options(num_cpus=0).remote(partial(fm.plain_lm, 2, F16, **SHAPE)))
    with WeightSync(trainer, {"fp16": fp16}, transport="ipc", timeout_s=60) as ws:
        manifest = ws.setup()
        names = manifest.names
        wire_name = "float32" if wire is None else "bfloat16"
        assert ws.casts() == {"fp16": tuple(TensorCast(name=n, wire=wire_name, held="float16") for n in names)}
        report = ws.sync(1, verify=True)
        (worker,) = report.workers
        assert worker.casts == (
            CastCount(wire=wire_name, held="float16", tensors=len(names), loses="range", first=names[0]),
        )
        assert report.to_dict()["workers"][0]["casts"][0]["loses"] == "range"
        assert f"fp16 {len(names)} tensor(s) {wire_name}->float16, loses range" in report.summary()
        assert worker.overflows == {} and "inf on load" not in report.summary()
        # Values beyond fp16's range in one tensor: each sync counts those its cast made inf,
        # in a verified (chained commit) and a plain (commit in the receive) sync alike.
        name = get(trainer.call.remote(inflate, 3))
        for version, verify in ((2, True), (3, False)):
            report = ws.sync(version, verify=verify)
            assert report.workers[0].overflows == {name: 3}, report.workers[0]
            assert report.to_dict()["workers"][0]["overflows"] == {name: 3}
            line = f"values that became inf on load: fp16: 3 value(s) in 1 tensor(s) (first {name}: 3)"
            assert line in report.summary(), report.summary()
    sent = get(trainer.call.remote(_trainer_state))
    held = get(fp16.call.remote(_trainer_state))
    for name, tensor in sent.items():
        want = (tensor if wire is None else tensor.to(wire)).to(F16)
        assert_bit_equal(held[name], want, name)


@pytest.mark.parametrize("transport", ["ipc", "direct"])
def test_a_module_sink_worker_holding_another_dtype_fails_setup_by_name(transport: str, actors: ActorPool) -> None:
    trainer = actors.add(
        TrainerActor.options(num_cpus=0).remote(partial(fm.plain_lm, 1, F32, **SHAPE), wire_dtype=BF16)
    )
    worker = actors.add(WorkerActor.options(num_cpus=0).remote(partial(fm.plain_lm, 2, F32, **SHAPE)))
    before = get(worker.call.remote(_trainer_state))
    ws = WeightSync(trainer, {"w32": worker}, transport=transport, timeout_s=60)
    with pytest.raises(SetupError) as refused:
        ws.setup()
    assert refused.value.culprits == ["w32"]
    text = str(refused.value)
    assert "head.weight: dtype bfloat16 on the trainer, float32 on w32" in text and "wire_dtype" in text
    after = get(worker.call.remote(_trainer_state))
    assert all(torch.equal(after[n], t) for n, t in before.items())
