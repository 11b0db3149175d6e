"""A Hugging Face causal LM trained in fp32 and served in bf16, synced after every step.

    .venv/bin/python examples/hf_transformers.py                # Llama-style, CPU, 2 workers
    .venv/bin/python examples/hf_transformers.py --family qwen2 --transport broadcast
    .venv/bin/python examples/hf_transformers.py --device cuda  # colocated on one GPU: direct

The model is built from a config (nothing is downloaded; swap in ``from_pretrained`` on a
machine that has the checkpoint). What it shows:

* fp32 master weights leave the trainer as bf16 (``wire_dtype``): the cast happens inside
  the one copy into the wire buffer (or, over ``direct``, into the worker's parameters);
* the tied output embedding travels once, as the input embedding, and stays tied on the
  workers (``lm_head.weight`` is the same tensor as ``embed_tokens.weight`` there);
* each worker is checked bit for bit against the trainer's weights cast to bf16.

Needs transformers (the ``hf`` extra): ``.venv/bin/python -m pip install -e ".[hf]"`` (the test
set-up, ``bash scripts/run.sh test``, installs it too).
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import ray
import torch
from torch import nn

import weightsync
from weightsync.tools.cluster import connect_with_gpus

FAMILIES = ("llama", "qwen2", "gpt2")


def small_config(
    family: str,
    vocab: int = 512,
    hidden: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 352,
    positions: int = 256,
) -> Any:
    """A small model of ``family`` (a few MB by default) with its embeddings tied, as many
    small LMs ship."""
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=layers,
            n_head=heads,
            n_positions=positions,
            tie_word_embeddings=True,
        )
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    return config_cls(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=positions,
        tie_word_embeddings=True,
    )


def build(family: str, seed: int, dtype: str) -> nn.Module:
    """The model factory each actor calls (picklable through functools.partial)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(small_config(family))
    return model.to(getattr(torch, dtype))


def sgd_step(model: nn.Module, step: int, lr: float = 0.05) -> float:
    """One next-token SGD step on a random batch; runs inside the trainer actor."""
    vocab = model.config.vocab_size  # type: ignore[union-attr]
    device = next(model.parameters()).device
    tokens = torch.randint(0, vocab, (4, 32), generator=torch.Generator().manual_seed(step)).to(device)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= lr * p.grad
                p.grad = None
    return float(loss)


def bf16_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.bfloat16).cpu() for n, t in model.state_dict().items()}


def embeddings_tied(model: nn.Module) -> bool:
    out, inp = model.get_output_embeddings().weight, model.get_input_embeddings().weight  # type: ignore[operator]
    return bool(out is inp)


def run(
    family: str = "llama", workers: int = 2, steps: int = 3, transport: str = "auto", device: str = "cpu"
) -> list[Any]:
    """Train and sync ``steps`` times; raises AssertionError on any mismatch. Ray must be up.

    Returns the actors it started, already killed."""
    gpu = 0.5 if device == "cuda" else 0
    trainer = weightsync.TrainerActor.options(num_cpus=0, num_gpus=gpu).remote(
        functools.partial(build, family, 0, "float32"), device=device, wire_dtype=torch.bfloat16
    )
    actors = [
        weightsync.WorkerActor.options(num_cpus=0, num_gpus=gpu / max(workers, 1)).remote(
            functools.partial(build, family, i + 1, "bfloat16"), device=device
        )
        for i in range(workers)
    ]
    try:
        with weightsync.WeightSync(trainer, actors, transport=transport, timeout_s=120) as ws:
            manifest = ws.setup()
            print(f"{family}: {len(manifest.specs)} tensors, {manifest.total_bytes / 1e6:.1f} MB on the wire (bf16)")
            assert not any(n.startswith("lm_head") for n in manifest.names), "the tied head travels once"
            for step in range(1, steps + 1):
                loss = ray.get(trainer.call.remote(sgd_step, step), timeout=120)
                report = ws.sync(version=step)
                expected = ray.get(trainer.call.remote(bf16_state), timeout=120)
                for name, worker in ws.workers.items():
                    got = ray.get(worker.call.remote(bf16_state), timeout=120)
                    assert got.keys() == expected.keys(), f"{name}: different tensor names"
                    for key in expected:
                        assert torch.equal(got[key], expected[key]), f"{name}: {key} differs after step {step}"
                    assert ray.get(worker.call.remote(embeddings_tied), timeout=120), f"{name}: embeddings untied"
                print(f"step {step}: loss {loss:.3f}; {report.summary()}; every worker bit-exact, still tied")
    finally:
        for actor in [trainer, *actors]:
            ray.kill(actor)
    return [trainer, *actors]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--family", choices=FAMILIES, default="llama", help="the transformers model family")
    parser.add_argument("--workers", type=int, default=2, help="inference workers (bf16)")
    parser.add_argument("--steps", type=int, default=3, help="training steps, each followed by a sync and a check")
    parser.add_argument(
        "--transport", choices=["auto", "direct", "ipc", "broadcast"], default="auto", help="how every worker is synced"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the trainer and workers run")
    args = parser.parse_args()
    problem = connect_with_gpus(1 if args.device == "cuda" else 0, "examples/hf_transformers.py --device cuda")
    if problem:
        print(problem, flush=True)
        return 2
    run(args.family, args.workers, args.steps, args.transport, args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
