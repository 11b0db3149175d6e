"""weightsync with the models and engines RLHF teams run: Hugging Face transformers causal
LMs (built from a config, nothing downloaded) and the inference-engine ``load_weights``
convention through a stand-in engine (the real vLLM tests are in tests/test_vllm*.py).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import ray
import torch
from torch import nn

from examples.hf_transformers import small_config
from tests.conftest import RAY_TIMEOUT
from tests.engine_standin import EngineLlama
from tests.helpers import assert_bit_equal, state_of
from tests.test_ray_e2e import get
from weightsync import TrainerActor, WeightSync, WorkerActor
from weightsync.core.sinks import module_tensors
from weightsync.glue.actors import WORKER_PROTOCOL, forward_worker_protocol

transformers = pytest.importorskip("transformers")

FAMILIES = ("llama", "qwen2", "gpt2")


def hf_config(family: str) -> Any:
    """A tiny tied causal LM config of ``family`` (the example's builder, smaller)."""
    return small_config(family, vocab=96, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48, positions=64)


def hf_model(family: str, seed: int, dtype: str) -> nn.Module:
    """A small causal LM of ``family`` with seeded random weights (never zeros)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family))
    with torch.no_grad():
        for _, tensor in module_tensors(model):
            if tensor.dtype.is_floating_point:
                tensor.normal_(0, 0.05)
    return model.to(getattr(torch, dtype))


def hf_train_step(model: nn.Module, step: int) -> float:
    """One SGD step on a next-token loss (runs in the trainer actor)."""
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 96, (2, 12), generator=gen)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.05 * p.grad
                p.grad = None
    return float(loss)


def tie_report(model: nn.Module) -> tuple[bool, bool]:
    """(output embedding is the input embedding object, same storage)."""
    out, inp = model.get_output_embeddings().weight, model.get_input_embeddings().weight  # type: ignore[operator]
    return out is inp, out.data_ptr() == inp.data_ptr()


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_causal_lm_fp32_master_weights_reach_bf16_workers_over_every_transport(family: str, actors: Any) -> None:
    trainer = actors.add(
        TrainerActor.options(num_cpus=0).remote(
            functools.partial(hf_model, family, 0, "float32"), wire_dtype=torch.bfloat16
        )
    )
    workers = {
        t: actors.add(WorkerActor.options(num_cpus=0).remote(functools.partial(hf_model, family, i + 1, "bfloat16")))
        for i, t in enumerate(("direct", "ipc", "broadcast"))
    }
    with WeightSync(trainer, workers, transport={t: t for t in workers}, buffer_bytes=64 * 1024) as ws:
        manifest = ws.setup()
        embed = next(n for n in manifest.names if "embed" in n or n.endswith("wte.weight"))
        assert not any("lm_head" in n for n in manifest.names), "the tied head must travel once, as the embedding"
        assert all(s.dtype == "bfloat16" for s in manifest.specs if s.name == embed)
        for version in (1, 2):
            loss = get(trainer.call.remote(hf_train_step, version))
            assert loss == loss  # a real loss, not NaN
            report = ws.sync(version)
            assert report.bytes == manifest.total_bytes
            expected = {n: t.to(torch.bfloat16) for n, t in get(trainer.call.remote(state_of)).items()}
            for transport, worker in workers.items():
                got = get(worker.call.remote(state_of))
                assert got.keys() == expected.keys(), transport
                for name in expected:
                    assert_bit_equal(got[name], expected[name], f"{transport}:{name}")
                assert get(worker.call.remote(tie_report)) == (True, True), transport


def engine_llama(seed: int) -> EngineLlama:
    torch.manual_seed(seed)
    engine = EngineLlama.like(hf_config("llama"))
    with torch.no_grad():
        for p in engine.parameters():
            p.normal_(0, 0.05)
    return engine.to(torch.bfloat16)


def checkpoint_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return model.as_checkpoint()  # type: ignore[operator, no-any-return]


@pytest.mark.parametrize("transport", ["ipc", "broadcast"])
def test_engine_style_load_weights_fuses_qkv_and_gate_up_from_hf_names(transport: str, actors: Any) -> None:
    trainer = actors.add(
        TrainerActor.options(num_cpus=0).remote(
            functools.partial(hf_model, "llama", 0, "float32"), wire_dtype=torch.bfloat16
        )
    )
    engine = actors.add(WorkerActor.options(num_cpus=0).remote(functools.partial(engine_llama, 7), sink="load_weights"))
    # Small buffers: the embedding and the MLP weights are split across chunks.
    with WeightSync(trainer, {"engine": engine}, transport=transport, buffer_bytes=2048) as ws:
        get(trainer.call.remote(hf_train_step, 1))
        ws.sync(1)
        expected = {n: t.to(torch.bfloat16) for n, t in get(trainer.call.remote(state_of)).items()}
        got = get(engine.call.remote(checkpoint_of))
        assert set(got) == set(expected) - {"lm_head.weight"}
        for name in got:
            assert_bit_equal(got[name], expected[name], name)
        loaded = get(engine.call.remote(lambda m: list(m.loaded)))
        assert "model.layers.0.self_attn.k_proj.weight" in loaded
        assert ws.status() == {"engine": (1, "committed")}


def test_forward_worker_protocol_covers_the_whole_protocol_and_refuses_a_class_without_forwarder() -> None:
    assert {"ws_accept", "ws_receive", "ws_commit", "ws_settle", "ws_status"} <= set(WORKER_PROTOCOL)

    @forward_worker_protocol
    class Forwarder:
        def forward_weightsync(self, method: str, *args: Any, **kwargs: Any) -> Any:
            return method, args, kwargs

    assert all(callable(getattr(Forwarder, m)) for m in WORKER_PROTOCOL)
    assert Forwarder().ws_accept("manifest", name="w") == ("ws_accept", ("manifest",), {"name": "w"})

    class NoForwarder:
        pass

    with pytest.raises(TypeError, match="needs a forward_weightsync"):
        forward_worker_protocol(NoForwarder)


def test_hf_example_trains_syncs_and_checks_every_worker(ray_session: None, no_shm_leftovers: None) -> None:
    from examples.hf_transformers import run

    started = run("qwen2", workers=2, steps=2, transport="auto")  # raises on a differing or untied tensor
    assert len(started) == 3
    for handle in started:
        # ray.kill is asynchronous: a call sent just after it may still be served.
        deadline = time.monotonic() + RAY_TIMEOUT
        while True:
            try:
                get(handle.pid.remote())
            except ray.exceptions.RayActorError:
                break
            assert time.monotonic() < deadline, "an actor the example started is still alive"
            time.sleep(0.05)
