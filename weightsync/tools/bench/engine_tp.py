"""The bench's tensor-parallel engine cases: a sharded trainer into a vLLM engine of TP ranks.

With ``--vllm-tp N`` (CPU, vLLM installed): per size, a Hugging Face Llama of about the
size's bytes in bf16 is written to a temporary directory (``save_pretrained``, a word-level
tokenizer: nothing downloads), a ``VLLMWorker`` with ``tensor_parallel_size=N`` serves it,
and N FSDP2 ranks (gloo) of the same model, one per TP rank, sync into it through the real
product path, each way in turn:

* ``relay``: ``transport="ipc"``: TP rank 0 receives from the rank beside it and hands
  every tensor on to the other TP ranks over vLLM's TP group;
* ``rank-ipc``: each TP rank is fed by its own trainer rank, all at once, nothing relayed.

Both include vLLM's ``load_weights`` on every rank (and, in the relay, the hand-on): the
row's limit is one copy of the model's bytes, as for ``ipc``. The note gives the time
generation was held off (median). On one GPU the ranks could not sit on TP ranks' devices
of their own: CPU only.
"""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from weightsync.core.wire.settings import MIB
from weightsync.tools.bench.report import Case
from weightsync.tools.bench.sharded import Timer

#: (hidden size, layers) per bench size: about the size's bytes in bf16 (head_dim 32,
#: MLP twice the hidden size, 2 KV heads; vLLM's CPU attention needs head_dim >= 32).
LLAMA_SHAPES = {"1mb": (128, 3), "100mb": (1024, 6), "1gb": (2048, 14)}
WORDS = "<unk> <s> </s> the a cat dog sat on mat one two three red big ran".split()


def write_llama(path: Path, size: str) -> Path:
    """A word-level tokenizer and bf16 Llama weights of about ``size``, saved with ``save_pretrained``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)
    hidden, layers = LLAMA_SHAPES[size]
    config = transformers.LlamaConfig(
        vocab_size=len(WORDS),
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    model: Any = transformers.LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


class ShardedLlama:
    """One rank's model (picklable): the checkpoint in fp32, sharded with FSDP2 over gloo."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path, self.timeout_s = path, timeout_s

    def __call__(self) -> nn.Module:
        import torch.distributed as dist
        import transformers
        from torch.distributed.fsdp import fully_shard

        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        model = transformers.LlamaForCausalLM.from_pretrained(self.path, dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model


def engine_tp_cases(bench: Timer, size: str, copy_s: float | None) -> None:
    """The relay and rank-ipc rows at ``size`` (see the module doc); a case that cannot run
    is reported as skipped with its reason."""
    import ray

    tp = bench.args.vllm_tp
    label = f"vllm TP={tp} cases"
    if size not in LLAMA_SHAPES:
        print(f"{size:>6} {label:<34} skipped: no Llama shape for this size ({', '.join(LLAMA_SHAPES)})", flush=True)
        return
    try:
        from weightsync.vllm import VLLMWorker
    except ImportError as exc:
        print(f"{size:>6} {label:<34} skipped: vLLM is not installed ({exc})", flush=True)
        return
    from weightsync.glue.actors import trainer_ranks

    with tempfile.TemporaryDirectory(prefix="weightsync-bench-llama-") as tmp:
        path = str(write_llama(Path(tmp), size))
        env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
        if not torch.cuda.is_available():
            cores = sorted(os.sched_getaffinity(0))
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[k % len(cores)]) for k in range(tp))
        engine = VLLMWorker.options(num_cpus=0).remote(
            model=path,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=128,
            tensor_parallel_size=tp,
            env=env,
            name=f"vllm-tp{tp}",
            timeout_s=bench.timeout_s,
        )
        ranks = trainer_ranks(
            ShardedLlama(path, bench.timeout_s), tp, actor_options={"num_cpus": 0}, wire_dtype=torch.bfloat16
        )
        try:
            bench.get([engine.pid.remote(), *[r.pid.remote() for r in ranks]])
            for name, transport in (("relay", "ipc"), ("rank-ipc", "rank-ipc")):
                _one_case(bench, size, ranks, engine, f"vllm TP={tp}, {tp} ranks: {name}", transport, copy_s)
        finally:
            try:
                bench.get(engine.shutdown.remote())
            finally:
                for handle in [engine, *ranks]:
                    ray.kill(handle)


def _one_case(
    bench: Timer,
    size: str,
    ranks: list[Any],
    engine: Any,
    name: str,
    transport: str,
    limit: float | None,
) -> None:
    from weightsync.glue.coordinator import WeightSync

    ws = WeightSync(ranks, {"vllm": engine}, transport=transport, timeout_s=bench.timeout_s)
    try:
        built = ws.setup()
    except Exception as exc:  # noqa: BLE001 - reported, counted in the exit code; the rest go on
        bench.not_run(size, name, exc)
        return
    # The Llama's own bytes on the wire (about the size's; the limit is one copy of the size).
    case = Case(size, name, built.total_bytes, built.agreed.buffer_bytes / MIB, built.agreed.num_buffers, limit_s=limit)
    held: list[float] = []

    def one() -> float:
        report = ws.sync(bench.next_version())
        case.send_times.append(report.send_seconds)
        held.append(report.held_off_s or 0.0)
        return report.seconds

    try:
        bench.timed(case, one, [ranks[0]])
    finally:
        ws.close()
    case.note = f"generation held off {statistics.median(held[1:] or held) * 1e3:.1f} ms (median)"
    print(f"{'':>6} {'':<34} {case.note}", flush=True)
