"""The bench's staged-engine cases: how long a sync holds a generating vLLM engine off.

With ``--vllm-staged`` (CPU, vLLM installed): per size, a Hugging Face Llama of about the
size's bytes in bf16 (``engine_tp.write_llama``) served by a ``VLLMWorker`` and by an
``AsyncVLLMWorker`` (TP=1), each fed by one trainer (fp32, bf16 on the wire) while it keeps
generating: a thread sends greedy requests to the engine back to back through every case.
Each engine syncs over ipc and over broadcast, loading as the bytes arrive (the default)
and staged (``stage_updates(True)``). Per case the row's time is the sync's wall time
(``SyncReport.seconds``) and its note the medians of what matters here:

* ``held``: generation held off (``SyncReport.held_off_s``), and its share of the sync;
* ``swap`` (staged): the swap itself, one load of the staged tensors through vLLM's
  ``load_weights`` inside its layerwise reload plus the end of the reload, and ``held``
  minus ``swap`` (pausing or blocking, the swap's RPC, the cache reset, the version);
* ``tokens``: tokens the engine generated while the transfer ran (``last_hold()``).
"""

from __future__ import annotations

import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

from weightsync.tools.bench.engine_tp import LLAMA_SHAPES, write_llama
from weightsync.tools.bench.report import Case
from weightsync.tools.bench.sharded import Timer

PROMPTS = ["the cat sat on the mat", "one two three red big", "a dog ran on the mat"]


class _LlamaTrainer:
    """The trainer's model (picklable): the checkpoint in fp32, nudged each step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self) -> torch.nn.Module:
        import transformers

        return transformers.LlamaForCausalLM.from_pretrained(self.path, dtype=torch.float32)


def _nudge(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


class _Generating:
    """Greedy requests to ``engine``, back to back, on a thread, until :meth:`stop`."""

    def __init__(self, bench: Timer, engine: Any, max_tokens: int) -> None:
        from vllm import SamplingParams

        self._stop = threading.Event()
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

        def run() -> None:
            while not self._stop.is_set():
                bench.get(engine.generate.remote(PROMPTS, params))

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self, bench: Timer) -> None:
        self._stop.set()
        self._thread.join(bench.timeout_s)


def engine_staged_cases(bench: Timer, size: str) -> None:
    """The staged and unstaged engine rows at ``size`` (see the module doc)."""
    import ray

    if size not in LLAMA_SHAPES:
        print(f"{size:>6} {'vllm staged cases':<34} skipped: no Llama shape for this size", flush=True)
        return
    try:
        from weightsync.vllm import AsyncVLLMWorker, VLLMWorker
    except ImportError as exc:
        print(f"{size:>6} {'vllm staged cases':<34} skipped: vLLM is not installed ({exc})", flush=True)
        return
    from weightsync.glue.actors import TrainerActor

    with tempfile.TemporaryDirectory(prefix="weightsync-bench-llama-") as tmp:
        path = str(write_llama(Path(tmp), size))
        trainer = TrainerActor.options(num_cpus=0).remote(_LlamaTrainer(path), wire_dtype=torch.bfloat16)
        try:
            for kind, actor in (("LLM", VLLMWorker), ("AsyncLLM", AsyncVLLMWorker)):
                options: dict[str, Any] = (
                    {"num_cpus": 0} if kind == "AsyncLLM" else {"num_cpus": 0, "max_concurrency": 3}
                )
                engine = actor.options(**options).remote(
                    model=path,
                    dtype="bfloat16",
                    enforce_eager=True,
                    max_model_len=128,
                    env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
                    name="vllm",
                    timeout_s=bench.timeout_s,
                )
                try:
                    bench.get(engine.pid.remote())
                    _engine_cases(bench, size, trainer, engine, kind)
                finally:
                    try:
                        bench.get(engine.shutdown.remote())
                    finally:
                        ray.kill(engine)
        finally:
            ray.kill(trainer)


def _engine_cases(bench: Timer, size: str, trainer: Any, engine: Any, kind: str) -> None:
    generating = _Generating(bench, engine, 16 if kind == "LLM" else 64)
    try:
        for staged in (False, True):
            bench.get(engine.stage_updates.remote(staged))
            for transport in ("ipc", "broadcast"):
                name = f"vllm {kind}, {transport}{', staged' if staged else ''}"
                _one_case(bench, size, trainer, engine, name, transport, staged)
    finally:
        generating.stop(bench)


def _one_case(bench: Timer, size: str, trainer: Any, engine: Any, name: str, transport: str, staged: bool) -> None:
    from weightsync.glue.coordinator import WeightSync

    ws = WeightSync(trainer, {"vllm": engine}, transport=transport, timeout_s=bench.timeout_s)
    try:
        built = ws.setup()
    except Exception as exc:  # noqa: BLE001 - reported, counted in the exit code; the rest go on
        bench.not_run(size, name, exc)
        return
    case = Case(size, name, built.total_bytes, built.agreed.buffer_bytes / 2**20, built.agreed.num_buffers)
    held: list[float] = []
    swaps: list[float] = []
    tokens: list[int] = []

    def one() -> float:
        version = bench.next_version()
        bench.get(trainer.call.remote(_nudge, version))
        report = ws.sync(version)
        case.send_times.append(report.send_seconds)
        held.append(report.held_off_s or 0.0)
        stage = report.workers[0].stage
        if stage is not None:
            swaps.append(stage.swap_s)
            tokens.append(stage.generated_tokens or 0)
        return report.seconds

    try:
        bench.timed(case, one, [trainer])
    finally:
        ws.close()
    case.note = _note(case, held[1:] or held, swaps[1:] or swaps, tokens[1:] or tokens)
    print(f"{'':>6} {'':<34} {case.note}", flush=True)


def _note(case: Case, held: list[float], swaps: list[float], tokens: list[int]) -> str:
    h = statistics.median(held)
    note = f"held {h * 1e3:.1f} ms ({h / case.median:.0%} of the sync)"
    if swaps:
        s = statistics.median(swaps)
        over = statistics.median(a - b for a, b in zip(held, swaps))
        note += f", swap {s * 1e3:.1f} ms (+{over * 1e3:.1f} ms), {statistics.median(tokens):.0f} tokens during the transfer"
    return note
