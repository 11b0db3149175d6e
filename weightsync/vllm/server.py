"""``weightsync.vllm.ServerWorker``: a running vLLM server, fed through its RL routes, as a worker.

Many RL stacks start vLLM's OpenAI-compatible server and drive it over HTTP. Started with
``VLLM_SERVER_DEV_MODE=1`` (its RL routes), weightsync's backend
(``--weight-transfer-config '{"backend": "weightsync"}'``) and a key
(``WEIGHTSYNC_SERVER_KEY_FILE``), such a server is a worker like any other::

    server = ServerWorker.options(num_cpus=0).remote("http://127.0.0.1:8000", key_file=KEY)
    with WeightSync(trainer, {"server": server}) as ws:       # ipc on its host, else broadcast
        ray.get(trainer.call.remote(train_step), timeout=600)
        ws.sync(version=1)                                    # pauses, loads, resumes the server
    ray.get(server.version.remote(), timeout=60)              # "1", as the server reports it

Each coordinator call is the call an engine actor sends its workers (``weightsync.vllm.codec``),
sealed under the key (:mod:`weightsync.vllm.remote`) and posted to ``/update_weights``; each
TP rank of the server runs it in the weightsync backend and answers on a connection of its
own to this actor (:mod:`weightsync.vllm.replies`). So setup, transports, verify, versions
and failures are those of :class:`~weightsync.vllm.VLLMWorker`: rank 0 receives and relays
to the other TP ranks, or every rank is fed on its own (``rank-ipc``). The first call (or
:meth:`connect`) checks the server (RL routes, API key, backend, no pipeline or data parallelism),
asks ``/get_world_size`` how many ranks answer, and opens the session; a server that
restarted is connected again at the next call.

Around the load of a sync, generation is paused with ``/pause?mode=<pause_mode>`` and
resumed with ``/resume``; where the hold begins and ends is :class:`~weightsync.vllm.hold.SyncHold`'s
rule, as for the in-process actors. A newly committed version goes to the server with the
update's ``/finish_weight_update`` before generation resumes; :meth:`version` reads it back
(``/weight_info``). Every request is bounded by ``timeout_s``; each failure raises naming the
URL and what to set (:class:`~weightsync.vllm.client.ServerCallError`).

This actor needs neither vLLM nor a GPU where it runs (only :meth:`ranks` unpickles vLLM-side
records); the server needs weightsync installed, for its backend.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from weightsync import TensorSpec, WorkerState
from weightsync.core.wire.messages import EndpointInfo
from weightsync.core.wire.outcome import Outcome
from weightsync.core.wire.settings import DEFAULT_ENGINE_TIMEOUT_S
from weightsync.glue.actors import WORKER_PROTOCOL, forward_worker_protocol
from weightsync.vllm.checks import check_server, field, requests_in_flight
from weightsync.vllm.client import ServerCallError, ServerClient
from weightsync.vllm.codec import Call, Reply, decode_reply, encode_call, unwrap
from weightsync.vllm.hold import PAUSE_MODES, HoldRecord, SyncHold, check_pause_mode, with_held_off
from weightsync.vllm.parts import PartRouting, State, answer
from weightsync.vllm.rank_query import rank_of
from weightsync.vllm.remote import INIT_FIELD, ServerInit, new_session, seal_call, seal_init
from weightsync.vllm.replies import RankLine, ReplyError, ReplyListener
from weightsync.vllm.sealing import read_key

log = logging.getLogger("weightsync")
#: Calls after which a settled receiver may have loaded: vLLM's update session ends there.
LOADS = ("ws_receive", "ws_commit", "ws_settle", "ws_teardown")
_SLOW_PAUSE = "pause_mode='wait' waits for every request in flight; use 'keep' or raise timeout_s"


@dataclass(frozen=True, kw_only=True)
class ServerSession:
    """A ServerWorker's session with its server, as :meth:`ServerWorker.connect` reports it."""

    url: str
    #: The server's TP ranks, each answering on its own connection.
    world_size: int
    #: Each TP rank's process id on the server's host, by rank.
    pids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (isinstance(self.world_size, int) and self.world_size >= 1 and len(self.pids) == self.world_size):
            raise ValueError(f"a session has one pid per TP rank, got {self.world_size} rank(s), pids {self.pids}")


@dataclass
class _Link:
    lines: list[RankLine]
    session: str
    seq: int = 0
    #: Whether vLLM's update session (start ... finish) is open on the server.
    updating: bool = False

    @property
    def nonces(self) -> list[str]:
        return [line.hello.nonce for line in self.lines]


@forward_worker_protocol
class _ServerWorker:
    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        *,
        name: str = "vllm-server",
        timeout_s: float = DEFAULT_ENGINE_TIMEOUT_S,
        pause_mode: str = "keep",
        key_file: str | None = None,
        allow_insecure_http: bool = False,
        ca_file: str | None = None,
        reply_host: str | None = None,
        expected_specs: Sequence[TensorSpec] | None = None,
        check_model: bool = True,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        self.name = name
        self.client = ServerClient(url, api_key, timeout_s, allow_insecure_http, ca_file)
        self.url = self.client.url
        self.timeout_s = float(timeout_s)
        self._key = read_key(key_file, who=f"{name} ({self.url})")
        self._hold = SyncHold(check_pause_mode(pause_mode))
        self._reply_host = reply_host
        self._specs = tuple(expected_specs) if expected_specs is not None else None
        self._check_model = bool(check_model)
        self._link: _Link | None = None
        self._routing = PartRouting(1)
        self._version: int | None = None  # the version last given to the server
        self._lock = threading.Lock()

    # the session --------------------------------------------------------------------------
    def connect(self) -> ServerSession:
        """Check the server and open the session now (the first call does it otherwise)."""
        with self._lock:
            link = self._connected()
            return ServerSession(url=self.url, world_size=len(link.lines), pids=tuple(x.hello.pid for x in link.lines))

    def _connected(self) -> _Link:
        """The live session, or a new one (none yet, or the server closed the last one)."""
        if self._link is not None and all(line.alive() for line in self._link.lines):
            return self._link
        self._drop_link()
        self._link = self._open_link()
        return self._link

    def _open_link(self) -> _Link:
        size = check_server(self.client)
        host = self._reply_host or ("127.0.0.1" if self.client.loopback else ray.util.get_node_ip_address())
        listener = ReplyListener(host)
        try:
            session = new_session()
            init = ServerInit(
                name=self.name,
                session=session,
                reply_host=host,
                reply_port=listener.port,
                timeout_s=self.timeout_s,
                expected_specs=self._specs,
                check_model=self._check_model,
            )
            info = {"init_info": {INIT_FIELD: seal_init(self._key, init)}}
            self.client.post("/init_weight_transfer_engine", info, timeout_s=self.timeout_s + 5.0)
            lines = listener.accept(self._key, session, size, time.monotonic() + self.timeout_s, self.name)
        finally:
            listener.close()
        link = _Link(lines, session)
        if any(line.hello.updating for line in lines):  # left open by an earlier session
            self._finish(link, None)
        self._routing = PartRouting(size)
        self._version = None  # a restarted server holds none: the next commit gives it its version
        log.info("weightsync: %s: connected to %s, %d TP rank(s)", self.name, self.url, size)
        return link

    def _drop_link(self) -> None:
        link, self._link = self._link, None
        for line in link.lines if link is not None else ():
            line.close()

    # one call -----------------------------------------------------------------------------
    def _call(self, link: _Link, what: str, payload: bytes) -> list[Reply]:
        """Post ``payload`` (an encoded Call) to every rank and read each rank's reply."""
        self._open_update(link)
        link.seq += 1
        text = seal_call(self._key, link.session, link.nonces, link.seq, payload)
        try:
            self.client.post("/update_weights", {"update_info": {"call": text}}, timeout_s=self.timeout_s + 5.0)
            deadline = time.monotonic() + self.timeout_s
            raw = [line.read(self._key, link.session, link.seq, deadline) for line in link.lines]
        except ServerCallError as exc:
            if exc.status is None:
                self._drop_link()  # no answer: what the server holds is unknown
            link.updating = False  # vLLM ends its update session when an update fails
            raise
        except ReplyError:
            self._drop_link()
            raise
        replies = [decode_reply(r, self._rank_name(i), what) for i, r in enumerate(raw)]
        for i, reply in enumerate(replies):
            unwrap(reply, self._rank_name(i), what)
        return replies

    def _open_update(self, link: _Link) -> None:
        """Open vLLM's update session unless it is open (every call runs inside one)."""
        if not link.updating:
            self._post("/start_weight_update")
            link.updating = True

    def _post(self, route: str, body: dict[str, Any] | None = None, query: dict[str, str] | None = None) -> None:
        self.client.post(route, body, query, timeout_s=self.timeout_s + 5.0)

    def _rank_name(self, rank: int) -> str:
        return f"{self.name} (TP rank {rank} of {self.url})"

    def _finish(self, link: _Link, version: int | None) -> None:
        """End vLLM's update session (the reload is finalized) and give it ``version``."""
        body = {"weight_version": str(version)} if version is not None else None
        try:
            self._post("/finish_weight_update", body)
        except ServerCallError as exc:
            if exc.status is not None:
                # vLLM keeps its session open when the backend's finish raised; the reload is
                # closed by then, so a second finish only ends the session.
                self._post("/finish_weight_update")
            link.updating = False
            raise
        link.updating = False

    # the coordinator's protocol -------------------------------------------------------------
    def forward_weightsync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            try:
                link = self._connected()  # inside: a server that is gone still ends an open hold
                self._open_update(link)  # before a pause: one round trip less while generation waits
                every = self._routing.every_rank(method, args)
                payload = encode_call(Call(method, args, kwargs, every_rank=every))
                if self._hold.begins(method):
                    self._hold.start(in_flight=requests_in_flight(self.client))
                    self._pause()
                    self._hold.paused()
                try:
                    replies = self._call(link, method, payload)
                finally:
                    self._routing.forwarded(method, every)
                value, state = answer(method, replies, every, self.name)
                self._after(link, method, state)
            except BaseException:
                self._resume_after_failure(method)
                raise
            if method == "ws_describe":
                value = self._located(value, link)
            if self._hold.ends(method, state):
                value = with_held_off(value, self._resume(state[1] if state is not None else "unknown", method))
            return value

    def _after(self, link: _Link, method: str, state: State | None) -> None:
        """Once a call that may have loaded leaves the receiver settled, end vLLM's update
        session, with the version when it is newly committed."""
        if state is None or state[1] == WorkerState.RECEIVING.value or method not in LOADS or not link.updating:
            return
        version, name = state
        new = name == WorkerState.COMMITTED.value and version is not None and version != self._version
        self._finish(link, version if new else None)
        if new:
            self._version = version

    def _located(self, value: Any, link: _Link) -> Any:
        """The server's description as the Ray side reaches it. Through a loopback URL the
        server shares this actor's host, so its Ray node; otherwise each rank is where its
        reply connection came from (a name the server resolves for itself may not be)."""
        if not isinstance(value, Outcome) or not isinstance(value.value, EndpointInfo):
            return value
        here = self.client.loopback
        node_id = ray.get_runtime_context().get_node_id() if here else ""
        node_ip = ray.util.get_node_ip_address() if here else ""

        def moved(info: EndpointInfo, line: RankLine) -> EndpointInfo:
            return dataclasses.replace(info, node_id=node_id, node_ip=node_ip or line.peer)

        info = value.value
        parts = tuple(moved(p, link.lines[k]) for k, p in enumerate(info.parts))
        return dataclasses.replace(value, value=dataclasses.replace(moved(info, link.lines[0]), parts=parts))

    # pause and resume -------------------------------------------------------------------------
    def _pause(self) -> None:
        query = {"mode": self._hold.mode, "clear_cache": "true"}
        try:
            self._post("/pause", query=query)
        except ServerCallError as exc:
            if exc.status is None and self._hold.mode == "wait":
                raise ServerCallError(f"{exc} ({_SLOW_PAUSE})", exc.url, exc.route) from exc
            raise

    def _resume(self, state: str, method: str) -> float:
        """Resume generation if a hold is open, recorded as ended by ``method``; its seconds."""
        if not self._hold.open:
            return 0.0
        try:
            self._post("/resume")
        finally:
            seconds = self._hold.stop(state, method)
        return seconds

    def _resume_after_failure(self, method: str) -> None:
        try:
            self._resume("failed", method)
        except Exception as exc:  # noqa: BLE001 - logged; the call's own error is the one raised
            log.warning(
                "weightsync: %s: resuming generation on %s after a failed %s: %s", self.name, self.url, method, exc
            )

    # for users --------------------------------------------------------------------------------
    def version(self) -> str:
        """The weight version the server reports (``/weight_info``; "default" before any sync)."""
        return str(field(self.client, "/weight_info", "weight_version"))

    def weight_version(self) -> str:
        """The same as :meth:`version` (the name the engine actors use)."""
        return self.version()

    def set_pause_mode(self, mode: str) -> None:
        """How the next syncs treat requests in flight: "keep", "wait" or "abort" (docs/vllm.md)."""
        self._hold.mode = check_pause_mode(mode)

    def last_hold(self) -> HoldRecord | None:
        """The last sync's pause of the server's generation (None before the first sync)."""
        return self._hold.last

    def ranks(self) -> list[Any]:
        """Each TP rank's ``RankInfo`` (pid, device, tensors loaded, version, state); unpickling
        it needs vLLM where this actor runs."""
        with self._lock:
            link = self._connected()
            return [r.value for r in self._call(link, "ranks", encode_call(Call(rank_of)))]

    def close(self) -> None:
        """End the session: the server's backend closes its transports and reply connections.
        The server keeps serving; a later call connects again."""
        with self._lock:
            link = self._link
            if link is None:
                return
            try:
                if link.updating:
                    self._finish(link, None)
                self._post("/shutdown_weight_transfer_engine")
            finally:
                self._drop_link()

    def pid(self) -> int:
        return os.getpid()


# The coordinator's calls run one at a time in a group of their own, so version() and
# last_hold() answer while a sync is in flight.
for _method in WORKER_PROTOCOL:
    setattr(_ServerWorker, _method, ray.method(concurrency_group="weightsync")(getattr(_ServerWorker, _method)))
#: ``ServerWorker.remote(url, api_key=None, key_file=..., ...)``; typed Any as Ray's stubs do
#: not follow ``.options(...).remote(...)``.
ServerWorker: Any = ray.remote(concurrency_groups={"weightsync": 1}, max_concurrency=2)(_ServerWorker)  # type: ignore[call-overload]

__all__ = ["LOADS", "PAUSE_MODES", "ServerSession", "ServerWorker"]
