"""A local Ray head for job submission: started, found and stopped through Ray's own CLI.

``python -m weightsync cluster start`` runs ``ray start --head --block`` from this
environment (so the head's ``python`` is this venv's), with:

* everything on loopback: ``--node-ip-address=127.0.0.1``, the dashboard (the job server)
  on ``127.0.0.1``, ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, and a free port for every
  listening service (:mod:`weightsync.mechanisms.ports`), so it never collides with another
  cluster on the machine;
* token authentication on: ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` pointing at
  a token generated here the way Ray generates one (``secrets.token_hex(32)``, 256 bits),
  kept in this head's own directory (mode 0600) instead of the per-user
  ``~/.ray/auth_token`` that every other cluster of the same user would share;
* its own ``--temp-dir`` inside that directory (sessions, logs, sockets);
* the jobs' actors at the niceness of the machine's other processes, not Ray's 15
  (:data:`WORKER_NICENESS`).

The directory and every file in it are private (:mod:`weightsync.tools.private_files`): made
fresh with modes 0700/0600, and a directory or file someone else could have made or can read
is refused by name, so another local user cannot pre-create the predictable default name
under ``/tmp`` to read the token, redirect ``head.log`` or rewrite ``head.json``. The token is
read only from ``auth_token`` inside the head's directory.

``ray start --block`` is Ray's supervisor for one node: on SIGTERM it drains the node and
stops exactly the processes it started (and its children die with it if it is killed:
Ray's fate sharing). ``stop`` signals that one process: the pid recorded at start, and only
while that pid is still the same process (its start time, recorded too), owned by this user
and running with this head's ``--temp-dir``; never ``ray stop``, which would stop every Ray
cluster of every user on the machine.

Call order: :func:`start_head` -> (jobs: :mod:`weightsync.tools.jobs`) -> :func:`stop_head`.
The head's directory holds ``head.json`` (:class:`HeadInfo`), ``auth_token``, ``head.log``
(the output of ``ray start``) and ``ray/`` (the temp dir).
"""

from __future__ import annotations

import errno
import getpass
import hashlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from weightsync.mechanisms.ports import free_ports
from weightsync.tools import private_files
from weightsync.tools.jobs import JobServer

PROJECT_ROOT = Path(__file__).resolve().parent.parent
#: The niceness of the actors of a cluster this package starts (a head, or connect()'s),
#: relative to the driver. Ray's 15 starves them beside any busy process, past every
#: deadline of a sync (docs/troubleshooting.md, "Ray, networking, containers").
WORKER_NICENESS = 0
#: Seconds a start waits for the head's job server to answer (``ray start`` and the
#: dashboard take their time on a loaded machine).
START_TIMEOUT_S = 180.0
#: Seconds a stop waits for the head to exit after SIGTERM before it kills it.
STOP_TIMEOUT_S = 60.0


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
    #: The head process's start time (``/proc/<pid>/stat`` field 22, clock ticks since boot):
    #: tells this head from a later process that reuses its pid. 0 in a record written by an
    #: older weightsync, which is then judged by owner and command line only.
    start_time: int = 0

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
        return JobServer(self.dashboard_url, read_token(Path(self.token_path)))

    def env(self) -> dict[str, str]:
        """What a plain ``ray job submit`` needs to reach this head's job server. Not for
        ``ray.init``: RAY_ADDRESS is the job server's http address, which ray.init refuses
        (and :func:`weightsync.tools.cluster.connect` explains)."""
        return {"RAY_ADDRESS": self.dashboard_url, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": self.token_path}


def read_token(path: Path) -> str:
    """The token in ``path``, read only from a regular file of this user with mode 0600: a
    token is sent to a server, so a file anyone else could have written or swapped is refused."""
    data = private_files.read_file(path)
    if data is None:
        raise HeadError(f"token file {path} does not exist")
    return data.decode(errors="replace").strip()


def default_directory() -> Path:
    """One head per checkout and user, in a short path (Ray's socket paths must stay short)."""
    env = os.environ.get("WEIGHTSYNC_HEAD_DIR")
    if env:
        return Path(env)
    digest = hashlib.sha1(str(PROJECT_ROOT).encode()).hexdigest()[:8]
    return Path("/tmp") / f"weightsync-head-{_user()}-{digest}"


def _user() -> str:
    """The login name, or ``uid<N>`` for a user the system cannot name (a container run
    with an arbitrary uid has no passwd entry and no $USER)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # KeyError up to Python 3.12, OSError from 3.13
        return f"uid{os.getuid()}"


_DIR_HINT = " (--dir DIR, or WEIGHTSYNC_HEAD_DIR=DIR)"


def read_info(directory: Path) -> HeadInfo | None:
    """The head recorded in ``directory``; None when there is none. A directory or record that
    is not private to this user, or a damaged record, raises naming the file."""
    if not private_files.check_directory(directory, hint=_DIR_HINT):
        return None
    path = directory / "head.json"
    raw = private_files.read_file(path)
    if raw is None:
        return None
    try:
        info = HeadInfo(**json.loads(raw))
    except (ValueError, TypeError) as exc:  # bad JSON, missing or unknown fields, bad values
        raise HeadError(
            f"{path} is damaged ({exc}); remove it (rm {path}). If the head it recorded still runs, stop it by "
            f"hand: its `ray start` process has --temp-dir={os.path.abspath(directory)}/ray on its command line"
        ) from exc
    expected = os.path.join(os.path.abspath(directory), "auth_token")
    if info.token_path != expected:
        raise HeadError(
            f"{path} names the token file {info.token_path}, expected {expected}; the token is only ever read "
            f"from the head's own directory. Remove {path} and start the head again"
        )
    return info


def process_start_time(pid: int) -> int | None:
    """``pid``'s start time in clock ticks since boot (``/proc/<pid>/stat`` field 22); None
    when it has exited (or is a zombie)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    if fields[0] == "Z":
        return None  # exited, not yet reaped
    return int(fields[19])


def head_running(info: HeadInfo, uid: int | None = None) -> bool:
    """True while the recorded pid is this head's ``ray start``: the same process (start time),
    owned by ``uid`` (this user), with this head's ``--temp-dir`` on its command line. Any other
    process that now has that pid, or that merely names the temp dir, is not the head.

    A process that execs reads an empty command line for a moment after its parent's
    ``Popen`` returned (the kernel closes the pipe ``Popen`` waits on before it sets the new
    program's arguments; on a busy machine that moment lasts milliseconds): the recorded
    process, by its start time, with an empty command line is the head being started, so a
    start interrupted at once still stops its head."""
    uid = os.getuid() if uid is None else uid
    started = process_start_time(info.pid)
    try:
        owner = os.stat(f"/proc/{info.pid}").st_uid
        cmdline = Path(f"/proc/{info.pid}/cmdline").read_bytes().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return False
    if started is None or owner != uid:
        return False
    if info.start_time and started != info.start_time:
        return False  # the head exited and its pid was reused
    if info.start_time and not any(cmdline):
        return True  # the recorded process itself, still in its exec
    return f"--temp-dir={info.temp_dir}".encode() in cmdline


def signal_head(info: HeadInfo, signum: int) -> bool:
    """Send ``signum`` to the recorded head if :func:`head_running` says it is the head; False
    (nothing sent) otherwise. The check and the signal go through one pidfd, so a pid that is
    reused in between is never signalled."""
    try:
        pidfd = os.pidfd_open(info.pid)
    except ProcessLookupError:
        return False
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
        # A kernel without pidfds (before Linux 5.3): check, then signal by pid. The head's
        # start time is part of the check, so only a pid reused in between could be hit.
        if not head_running(info):
            return False
        try:
            os.kill(info.pid, signum)
        except ProcessLookupError:
            return False
        return True
    try:
        if not head_running(info):
            return False
        signal.pidfd_send_signal(pidfd, signum)
        return True
    except ProcessLookupError:
        return False  # exited after the check
    finally:
        os.close(pidfd)


def start_head(directory: Path, num_cpus: int | None = None, timeout_s: float = START_TIMEOUT_S) -> HeadInfo:
    """Start a loopback head with token auth and the job server; return once jobs can be submitted."""
    ray_cli = _ray_cli_to_start(directory)
    directory = Path(os.path.abspath(directory))
    private_files.make_directory(directory, hint=_DIR_HINT)
    token_path = directory / "auth_token"
    private_files.write_file(token_path, secrets.token_hex(32).encode())
    temp_dir = directory / "ray"
    ports = free_ports(2 + len(_MORE_PORTS))  # the GCS's, the dashboard's, then _MORE_PORTS
    command = _ray_start_command(ray_cli, ports, temp_dir, num_cpus)
    log_path = directory / "head.log"
    log = private_files.create_file(log_path)
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_head_environment(token_path),
            start_new_session=True,
        )
    finally:
        os.close(log)
    info = HeadInfo(
        directory=str(directory),
        pid=proc.pid,
        gcs_address=f"127.0.0.1:{ports[0]}",
        dashboard_url=f"http://127.0.0.1:{ports[1]}",
        token_path=str(token_path),
        temp_dir=str(temp_dir),
        start_time=process_start_time(proc.pid) or 0,
    )
    private_files.write_file(directory / "head.json", json.dumps(asdict(info), indent=2).encode())
    try:
        _wait_for_jobs(proc, info, log_path, timeout_s)
    except BaseException:
        # A failure or Ctrl-C while waiting: the head runs in a session of its own, so
        # nothing else would ever stop it.
        stop_head(directory)
        raise
    return info


def _ray_cli_to_start(directory: Path) -> Path:
    """This environment's ``ray`` command, once nothing stands in the way of a new head:
    no head of this checkout running, the job server's packages installed."""
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
    return ray_cli


#: The listeners of a head beyond the GCS and the dashboard, each given a port of its own.
_MORE_PORTS = (
    "ray-client-server-port",
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "metrics-export-port",
    "runtime-env-agent-port",
)


def _ray_start_command(ray_cli: Path, ports: list[int], temp_dir: Path, num_cpus: int | None) -> list[str]:
    """``ray start --head`` with everything on 127.0.0.1, on ``ports``: the GCS's, the
    dashboard's, then one for each of :data:`_MORE_PORTS`."""
    port, dashboard_port, *more = ports
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
        *(f"--{flag}={p}" for flag, p in zip(_MORE_PORTS, more, strict=True)),
        f"--temp-dir={temp_dir}",
    ]
    if num_cpus is not None:
        command.append(f"--num-cpus={num_cpus}")
    return command


def _head_environment(token_path: Path) -> dict[str, str]:
    """The head's environment: loopback, token auth from ``token_path``, this venv's python,
    no drain of the node when it is stopped."""
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
    # On SIGTERM `ray start --block` first drains its node, for up to 30 s by default, until
    # every worker lease is returned (for Serve replicas to move elsewhere). A head of this
    # checkout has no other node to move work to: `stop` ends it at once, and a lease still
    # held (a job's actor, a worker being started) no longer keeps it alive for 30 s.
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    # The jobs' actors at the priority of the machine's other processes (WORKER_NICENESS).
    env.setdefault("RAY_worker_niceness", str(WORKER_NICENESS))
    return env


def _wait_for_jobs(proc: subprocess.Popen[bytes], info: HeadInfo, log_path: Path, timeout_s: float) -> None:
    """Until the head's job server answers; raises if the head exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    server = info.job_server
    while not server.reachable():
        code = proc.poll()
        if code is not None:
            raise HeadError(
                f"`ray start --head` exited with code {code} before the job server came up:\n{_tail(log_path)}"
            )
        if time.monotonic() > deadline:
            raise HeadError(
                f"the job server at {info.dashboard_url} did not answer within {timeout_s:.0f}s (head stopped); "
                f"raise --timeout on a slow machine. Last lines of {log_path}:\n{_tail(log_path)}"
            )
        time.sleep(0.5)


def stop_head(directory: Path, timeout_s: float = STOP_TIMEOUT_S) -> str:
    """SIGTERM this head's ``ray start --block`` and wait until it exited; returns what happened."""
    info = read_info(directory)
    if info is None:
        return f"no head recorded in {directory}; nothing to stop"
    if not signal_head(info, signal.SIGTERM):
        _forget(directory, info)
        return f"the head recorded in {directory} (pid {info.pid}) is not running; record removed"
    deadline = time.monotonic() + timeout_s
    while head_running(info):
        if time.monotonic() > deadline:
            # Ray's fate sharing stops the node's processes when their supervisor dies.
            signal_head(info, signal.SIGKILL)
            time.sleep(1.0)
            _forget(directory, info)
            return f"the head (pid {info.pid}) did not stop within {timeout_s:.0f}s of SIGTERM; killed it"
        time.sleep(0.2)
    _forget(directory, info)
    return f"stopped the head (pid {info.pid}, {info.dashboard_url})"


def _forget(directory: Path, info: HeadInfo) -> None:
    """Remove a stopped head's record and its token (read_info checked it lies in ``directory``)."""
    (directory / "head.json").unlink(missing_ok=True)
    Path(info.token_path).unlink(missing_ok=True)


def _tail(path: Path, lines: int = 20) -> str:
    data = private_files.read_file(path)
    if data is None:
        return "(no log)"
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])
