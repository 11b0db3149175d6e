"""A ServerWorker's parts without a vLLM server: the key file, sealed calls and replies (replays
refused), the reply connections, and every failure of the HTTP client named, against real
sockets (nothing listening, a silent listener, and a small HTTP server answering as vLLM's
does for each misconfiguration). The real server: tests/test_vllm_server.py."""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

pytest.importorskip("cloudpickle", reason="cloudpickle comes with vLLM (the vllm extra)")

from weightsync import SettingsError, WeightSyncError
from weightsync.mechanisms.ports import free_port
from weightsync.vllm.client import ServerCallError, ServerClient
from weightsync.vllm.remote import RemoteLink, ServerInit, new_session, seal_call, seal_init
from weightsync.vllm.replies import ReplyListener, send_frame
from weightsync.vllm.sealing import KEY_FILE_ENV, SealError, read_key, seal, unseal


def write_key(path: Path, text: str | None = None, mode: int = 0o600) -> Path:
    path.write_text(text if text is not None else os.urandom(32).hex())
    path.chmod(mode)
    return path


@pytest.fixture
def key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = write_key(tmp_path / "server.key")
    monkeypatch.setenv(KEY_FILE_ENV, str(path))  # as the server's backend reads it
    return path


# --- the key and the seal --------------------------------------------------------------


def test_a_key_file_others_can_read_or_too_short_or_missing_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loose = write_key(tmp_path / "loose.key", mode=0o644)
    with pytest.raises(WeightSyncError, match=f"{loose}.*0644.*chmod 600"):
        read_key(loose)
    short = write_key(tmp_path / "short.key", "x" * 31)
    with pytest.raises(WeightSyncError, match=f"{short} holds 31 bytes"):
        read_key(short)
    link = tmp_path / "link.key"
    link.symlink_to(write_key(tmp_path / "real.key"))
    with pytest.raises(WeightSyncError, match=f"cannot open the key file {link}"):
        read_key(link)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    with pytest.raises(WeightSyncError, match=KEY_FILE_ENV):
        read_key(None)
    good = write_key(tmp_path / "good.key", "k" * 40 + "\n")
    assert read_key(good) == b"k" * 40


def test_a_sealed_message_opens_only_under_its_key_unaltered_and_as_its_kind() -> None:
    key, other = os.urandom(32), os.urandom(32)
    data = seal(key, {"kind": "call", "seq": 3}, b"payload")
    assert unseal(key, data, "call") == ({"kind": "call", "seq": 3}, b"payload")
    with pytest.raises(SealError, match=KEY_FILE_ENV):
        unseal(other, data, "call")
    altered = bytearray(data)
    altered[-40] ^= 1  # a byte of the body
    with pytest.raises(SealError, match="another key"):
        unseal(key, bytes(altered), "call")
    with pytest.raises(SealError, match="a sealed reply was expected, a sealed 'call' arrived"):
        unseal(key, data, "reply")
    with pytest.raises(SealError, match="not a weightsync sealed message"):
        unseal(key, b"\x80\x04pickle", "call")


# --- a session: init, hello, calls, replies ----------------------------------------------


def open_session(key: bytes, size: int = 1) -> tuple[list[RemoteLink], list[Any], str]:
    """``size`` ranks accept one sealed init and connect back to a listener here."""
    listener = ReplyListener("127.0.0.1")
    session = new_session()
    init = ServerInit(name="srv", session=session, reply_host="127.0.0.1", reply_port=listener.port, timeout_s=10.0)
    text = seal_init(key, init)
    links = []
    for rank in range(size):
        link = RemoteLink.accept(text)
        link.connect(rank, size, updating=rank == 1)
        links.append(link)
    try:
        lines = listener.accept(key, session, size, time.monotonic() + 10, "srv")
    finally:
        listener.close()
    return links, lines, session


def test_each_rank_runs_a_call_once_answers_on_its_line_and_stale_replies_are_skipped(key_file: Path) -> None:
    key = read_key(key_file)
    links, lines, session = open_session(key, size=2)
    assert [line.hello.rank for line in lines] == [0, 1] and [line.hello.updating for line in lines] == [False, True]
    nonces = [line.hello.nonce for line in lines]
    first = seal_call(key, session, nonces, 1, b"call-1")
    assert [link.open_call(first) for link in links] == [b"call-1", b"call-1"]
    for rank, link in enumerate(links):
        link.reply(f"rank {rank} answers 1".encode())  # a reply its caller never read
    with pytest.raises(WeightSyncError, match="call 1 was refused: call 1 already ran"):
        links[0].open_call(first)  # replayed
    second = seal_call(key, session, nonces, 2, b"call-2")
    for rank, link in enumerate(links):
        assert link.open_call(second) == b"call-2"
        link.reply(f"rank {rank} answers 2".encode())
    deadline = time.monotonic() + 10
    assert [line.read(key, session, 2, deadline) for line in lines] == [b"rank 0 answers 2", b"rank 1 answers 2"]
    for link in links:
        link.close()
    assert not any(line.alive() for line in lines)  # the ranks closed: seen without a read
    for line in lines:
        line.close()


def test_a_call_of_another_session_or_key_is_refused_before_it_is_unpickled(key_file: Path) -> None:
    key = read_key(key_file)
    (link,), (line,), session = open_session(key)
    (other,), _, other_session = open_session(key)  # a second session: another nonce
    with pytest.raises(WeightSyncError, match="another session"):
        link.open_call(seal_call(key, other_session, [line.hello.nonce], 1, b"x"))
    with pytest.raises(WeightSyncError, match="another session"):
        link.open_call(seal_call(key, session, ["0" * 32], 1, b"x"))  # recorded before this nonce
    with pytest.raises(WeightSyncError, match=KEY_FILE_ENV):
        link.open_call(seal_call(os.urandom(32), session, [line.hello.nonce], 1, b"x"))
    with pytest.raises(WeightSyncError, match="refused a ServerWorker's init"):
        RemoteLink.accept(seal_init(os.urandom(32), link.init))
    for end in (link, other, line):
        end.close()


def test_a_stranger_on_the_reply_port_is_ignored_and_a_rank_that_never_connects_is_named(key_file: Path) -> None:
    key = read_key(key_file)
    listener = ReplyListener("127.0.0.1")
    session = new_session()
    init = ServerInit(name="srv", session=session, reply_host="127.0.0.1", reply_port=listener.port, timeout_s=5.0)
    stranger = socket.create_connection(("127.0.0.1", listener.port))
    send_frame(stranger, seal(os.urandom(32), {"kind": "hello", "session": session}))
    link = RemoteLink.accept(seal_init(key, init))
    link.connect(0, 2, updating=False)  # rank 0 of 2; rank 1 never comes
    try:
        with pytest.raises(WeightSyncError, match=r"TP rank\(s\) \[1\] of the server never connected back"):
            listener.accept(key, session, 2, time.monotonic() + 2, "srv")
    finally:
        listener.close()
        link.close()
        stranger.close()


# --- HTTP: every failure named -----------------------------------------------------------


class Answers(http.server.BaseHTTPRequestHandler):
    """Answers each route as the server under test is told to; records the headers seen."""

    routes: ClassVar[dict[str, tuple[int, Any]]] = {}
    seen: ClassVar[list[dict[str, str]]] = []

    def _answer(self) -> None:
        route = self.path.split("?", 1)[0]
        type(self).seen.append(dict(self.headers))
        status, body = self.routes.get(route, (404, {"detail": "Not Found"}))
        text = isinstance(body, str)  # Prometheus text, as /metrics answers
        data = body.encode() if text else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[tuple[str, type[Answers]]]:
    handler = type("Handler", (Answers,), {"routes": {}, "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_plain_http_to_another_host_is_refused_unless_asked_for() -> None:
    with pytest.raises(SettingsError, match="allow_insecure_http=True"):
        ServerClient("http://192.0.2.10:8000")
    assert ServerClient("http://192.0.2.10:8000", allow_insecure_http=True).url == "http://192.0.2.10:8000"
    assert ServerClient("https://192.0.2.10:8000").secure and ServerClient("http://localhost:8000").loopback
    with pytest.raises(SettingsError, match="url must be"):
        ServerClient("ftp://127.0.0.1:8000")


def test_nothing_listening_and_a_silent_server_are_named_with_the_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerCallError, match=f"{url} .*refused the connection: is the vLLM server running") as err:
        ServerClient(url).get("/get_world_size")
    assert err.value.status is None and err.value.route == "/get_world_size"
    with socket.socket() as silent:  # accepts (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(ServerCallError, match=f"{url} .*gave no answer within 0.5s") as err:
            ServerClient(url, timeout_s=0.5).post("/update_weights", {"update_info": {}}, timeout_s=0.5)
    assert err.value.status is None


def test_http_errors_say_the_url_and_what_to_set(http_server: tuple[str, type[Answers]]) -> None:
    url, answers = http_server
    client = ServerClient(url, api_key="sk-test")
    with pytest.raises(ServerCallError, match=f"{url} answered /get_world_size with HTTP 404.*VLLM_SERVER_DEV_MODE=1"):
        client.get("/get_world_size")  # a server without its RL routes answers 404, as FastAPI does
    assert answers.seen[-1]["Authorization"] == "Bearer sk-test"  # vLLM's scheme
    answers.routes["/v1/models"] = (401, {"error": "Unauthorized"})
    with pytest.raises(ServerCallError, match="HTTP 401.*pass api_key=") as err:
        client.get("/v1/models")
    assert err.value.status == 401
    failure = {"error": {"message": "Worker failed with error 'boom'", "type": "InternalServerError", "code": 500}}
    answers.routes["/update_weights"] = (500, failure)
    with pytest.raises(ServerCallError, match=f"{url} answered /update_weights with HTTP 500.*'boom'") as err:
        client.post("/update_weights", {"update_info": {"call": "x"}})
    assert err.value.status == 500


def test_a_server_without_the_weightsync_backend_or_with_pipeline_stages_is_refused_by_name(
    http_server: tuple[str, type[Answers]], key_file: Path
) -> None:
    from weightsync.vllm.server import _ServerWorker

    url, answers = http_server
    worker = _ServerWorker(url, key_file=str(key_file), timeout_s=5.0)
    answers.routes["/get_world_size"] = (200, {"world_size": 1})
    answers.routes["/v1/models"] = (200, {"data": [{"id": "m"}]})
    parallel = {"pipeline_parallel_size": 1, "data_parallel_size": 1}
    config = {"weight_transfer_config": {"backend": "nccl"}, "parallel_config": parallel}
    answers.routes["/server_info"] = (200, {"vllm_config": config})
    with pytest.raises(ServerCallError, match=f"{url} runs weight-transfer backend 'nccl'.*--weight-transfer-config"):
        worker.connect()
    config["weight_transfer_config"] = None
    with pytest.raises(ServerCallError, match="backend None"):
        worker.connect()
    config["weight_transfer_config"] = {"backend": "weightsync"}
    parallel["pipeline_parallel_size"] = 2
    with pytest.raises(ServerCallError, match="pipeline_parallel_size.*tensor parallel ranks only"):
        worker.connect()


def test_requests_in_flight_are_the_servers_running_and_waiting_gauges(http_server: tuple[str, type[Answers]]) -> None:
    from weightsync.vllm.checks import requests_in_flight

    url, answers = http_server
    answers.routes["/metrics"] = (
        200,
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 1.0\n',
    )
    assert requests_in_flight(ServerClient(url)) == 6
