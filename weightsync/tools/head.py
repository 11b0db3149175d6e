"""A local Ray head for job submission: started, found and stopped through Ray's own CLI.

``python -m weightsync cluster start`` runs ``ray start --head --block`` from this
environment (so the head's ``python`` is this venv's), with:

* everything on loopback: ``--node-ip-address=127.0.0.1``, the dashboard (the job server)
  on ``127.0.0.1``, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, and a free port for every
  listening service, so it never collides with another cluster on the machine;
* token authentication on: ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` pointing at
  a token generated here the way Ray generates one (``secrets.token_hex(32)``, 256 bits),
  kept in this head's own directory (mode 0600) instead of the per-user
  ``~/.ray/auth_token`` that every other cluster of the same user would share;
* its own ``--temp-dir`` inside that directory (sessions, logs, sockets).

``ray start --block`` is Ray's supervisor for one node: on SIGTERM it drains the node and
stops exactly the processes it started (and its children die with it if it is killed:
Ray's fate sharing). ``stop`` signals that one process, found by the pid recorded at
start and checked against its command line, never ``ray stop``, which would stop every
Ray cluster of every user on the machine.

Call order: :func:`start_head` -> (jobs: :mod:`weightsync.tools.jobs`) -> :func:`stop_head`.
The head's directory holds ``head.json`` (:class:`HeadInfo`), ``auth_token``, ``head.log``
(the output of ``ray start``) and ``ray/`` (the temp dir).
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from weightsync.tools.jobs import JobServer

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class HeadError(RuntimeError):
    """Starting, finding or stopping the local head failed; the message says what to do."""


@dataclass(frozen=True)
class HeadInfo:
    """What ``start`` recorded about a running head (``head.json``)."""

    directory: str
    pid: int
    gcs_address: str
    dashboard_url: str
    token_path: str
    temp_dir: str

    def __post_init__(self) -> None:
        if self.pid <= 0:
            raise ValueError(f"HeadInfo.pid must be a positive process id, got {self.pid}")
        for name in ("gcs_address", "dashboard_url", "token_path", "temp_dir"):
            if not getattr(self, name):
                raise ValueError(f"HeadInfo.{name} is empty; {self.directory}/head.json is damaged")
        if not self.dashboard_url.startswith("http://127.0.0.1:"):
            raise ValueError(f"HeadInfo.dashboard_url must be on 127.0.0.1, got {self.dashboard_url!r}")

    @property
    def job_server(self) -> JobServer:
        return JobServer(self.dashboard_url, Path(self.token_path).read_text().strip())

    def env(self) -> dict[str, str]:
        """What a plain ``ray job submit`` (or ``ray.init``) needs to reach this head."""
        return {"RAY_ADDRESS": self.dashboard_url, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path}


def default_directory() -> Path:
    """One head per checkout and user, in a short path (Ray's socket paths must stay short)."""
    env = os.environ.get("WEIGHTSYNC_HEAD_DIR")
    if env:
        return Path(env)
    digest = hashlib.sha1(str(PROJECT_ROOT).encode()).hexdigest()[:8]
    return Path("/tmp") / f"weightsync-head-{getpass.getuser()}-{digest}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def read_info(directory: Path) -> HeadInfo | None:
    path = directory / "head.json"
    if not path.exists():
        return None
    return HeadInfo(**json.loads(path.read_text()))


def head_running(info: HeadInfo) -> bool:
    """True while the recorded pid is alive and is this head's ``ray start`` (not a reused pid)."""
    try:
        stat = Path(f"/proc/{info.pid}/stat").read_text()
        cmdline = Path(f"/proc/{info.pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    if stat.rsplit(")", 1)[1].split()[0] == "Z":
        return False  # exited, not yet reaped
    return f"--temp-dir={info.temp_dir}".encode() in cmdline


def start_head(directory: Path, num_cpus: int | None = None, timeout_s: float = 180.0) -> HeadInfo:
    """Start a loopback head with token auth and the job server; return once jobs can be submitted."""
    existing = read_info(directory)
    if existing is not None and head_running(existing):
        raise HeadError(
            f"a head from this checkout is already running (pid {existing.pid}, {existing.dashboard_url}); "
            f"use it, or stop it first: bash scripts/run.sh cluster stop --dir {directory}"
        )
    ray_cli = Path(sys.executable).parent / "ray"
    if not ray_cli.exists():
        raise HeadError(f"{ray_cli} not found: install the cluster extra (bash scripts/run.sh cluster does)")
    try:
        import aiohttp  # noqa: F401 - the dashboard (and so the job server) needs it
    except ImportError as exc:
        raise HeadError(
            f"the Ray dashboard needs ray[default] ({exc}); install the cluster extra: bash scripts/run.sh cluster does"
        ) from exc
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    token_path = directory / "auth_token"
    token_path.touch(mode=0o600, exist_ok=True)
    token_path.chmod(0o600)
    token_path.write_text(secrets.token_hex(32))
    temp_dir = directory / "ray"
    port, dashboard_port = _free_port(), _free_port()
    command = [
        str(ray_cli),
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        "--include-dashboard=true",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        f"--ray-client-server-port={_free_port()}",
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}",
        f"--metrics-export-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
        f"--temp-dir={temp_dir}",
    ]
    if num_cpus is not None:
        command.append(f"--num-cpus={num_cpus}")
    env = dict(os.environ)
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(name, None)
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(token_path),
        GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"),
        # A job's `python` is found on the head's PATH: make it this environment's.
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    log_path = directory / "head.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    info = HeadInfo(
        directory=str(directory),
        pid=proc.pid,
        gcs_address=f"127.0.0.1:{port}",
        dashboard_url=f"http://127.0.0.1:{dashboard_port}",
        token_path=str(token_path),
        temp_dir=str(temp_dir),
    )
    (directory / "head.json").write_text(json.dumps(asdict(info), indent=2))
    deadline = time.monotonic() + timeout_s
    server = info.job_server
    while True:
        code = proc.poll()
        if code is not None:
            raise HeadError(
                f"`ray start --head` exited with code {code} before the job server came up:\n{_tail(log_path)}"
            )
        if server.reachable():
            return info
        if time.monotonic() > deadline:
            stop_head(directory, timeout_s=60)
            raise HeadError(
                f"the job server at {info.dashboard_url} did not answer within {timeout_s:.0f}s (head stopped); "
                f"raise --timeout on a slow machine. Last lines of {log_path}:\n{_tail(log_path)}"
            )
        time.sleep(0.5)


def stop_head(directory: Path, timeout_s: float = 60.0) -> str:
    """SIGTERM this head's ``ray start --block`` and wait until it exited; returns what happened."""
    info = read_info(directory)
    if info is None:
        return f"no head recorded in {directory}; nothing to stop"
    if not head_running(info):
        (directory / "head.json").unlink()
        return f"the head recorded in {directory} (pid {info.pid}) is not running; record removed"
    os.kill(info.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while head_running(info):
        if time.monotonic() > deadline:
            # Ray's fate sharing stops the node's processes when their supervisor dies.
            os.kill(info.pid, signal.SIGKILL)
            time.sleep(1.0)
            (directory / "head.json").unlink()
            return f"the head (pid {info.pid}) did not stop within {timeout_s:.0f}s of SIGTERM; killed it"
        time.sleep(0.2)
    (directory / "head.json").unlink()
    return f"stopped the head (pid {info.pid}, {info.dashboard_url})"


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
