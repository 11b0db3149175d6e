"""The local head's directory and files are private, and `cluster stop` signals only its head.

No Ray here: every refusal happens before `ray start` would run, and the stop tests use a
decoy process in place of a head. Another user cannot be created in a test, so the owner
check is exercised by passing a uid that is not ours.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
import pytest

from weightsync.tools import private_files
from weightsync.tools.cli import build_parser
from weightsync.tools.head import (
    HeadError,
    HeadInfo,
    head_running,
    process_start_time,
    read_info,
    read_token,
    start_head,
    stop_head,
)
from weightsync.tools.jobs import JobServer
from weightsync.tools.private_files import UnsafePathError

ROOT = Path(__file__).resolve().parent.parent
OTHER_UID = os.getuid() + 4242


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "WEIGHTSYNC_HEAD_DIR"))}
    return subprocess.run(
        [sys.executable, "-m", "weightsync", "cluster", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def head_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "head"
    directory.mkdir(mode=0o700)
    return directory


def record(directory: Path, **changes: object) -> dict[str, object]:
    info: dict[str, object] = {
        "directory": str(directory),
        "pid": 1,
        "gcs_address": "127.0.0.1:1",
        "dashboard_url": "http://127.0.0.1:2",
        "token_path": str(directory / "auth_token"),
        "temp_dir": str(directory / "ray"),
        **changes,
    }
    private_files.write_file(directory / "head.json", json.dumps(info).encode())
    return info


# --- the directory ---------------------------------------------------------------------------


def test_a_precreated_world_writable_head_directory_is_refused_by_name(tmp_path: Path) -> None:
    squatted = tmp_path / "weightsync-head-squatted"
    squatted.mkdir()
    squatted.chmod(0o777)
    proc = cli("start", "--dir", str(squatted))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert str(squatted) in proc.stderr and "0777" in proc.stderr
    assert "WEIGHTSYNC_HEAD_DIR" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(os.listdir(squatted)) == []  # no token, log or record written into it


def test_a_head_directory_owned_by_another_user_is_refused(head_dir: Path) -> None:
    assert private_files.check_directory(head_dir) is True
    with pytest.raises(UnsafePathError, match=f"{head_dir}.*owned by uid"):
        private_files.check_directory(head_dir, uid=OTHER_UID)


def test_a_symlink_in_place_of_the_head_directory_is_refused(tmp_path: Path, head_dir: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(head_dir)
    with pytest.raises(UnsafePathError, match=f"{link} is a symlink"):
        private_files.make_directory(link)


def test_a_new_head_directory_and_its_files_are_owner_only(tmp_path: Path) -> None:
    directory = tmp_path / "fresh"
    private_files.make_directory(directory)
    private_files.write_file(directory / "auth_token", b"secret")
    assert oct(directory.stat().st_mode & 0o777) == "0o700"
    assert oct((directory / "auth_token").stat().st_mode & 0o777) == "0o600"


# --- files in it -----------------------------------------------------------------------------


def test_a_symlinked_head_log_is_refused_and_its_target_untouched(tmp_path: Path, head_dir: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    (head_dir / "head.log").symlink_to(victim)
    with pytest.raises(UnsafePathError, match=f"{head_dir / 'head.log'} is a symlink"):
        start_head(head_dir, timeout_s=1)
    assert victim.read_bytes() == b"precious"
    assert (head_dir / "head.log").is_symlink()


def test_a_directory_in_place_of_head_json_is_refused(head_dir: Path) -> None:
    (head_dir / "head.json").mkdir()
    with pytest.raises(UnsafePathError, match=f"{head_dir / 'head.json'} is a directory"):
        read_info(head_dir)
    proc = cli("submit", "--dir", str(head_dir), "--", "true")
    assert proc.returncode == 2 and str(head_dir / "head.json") in proc.stderr, proc.stderr


def test_a_head_record_others_could_write_is_refused(head_dir: Path) -> None:
    record(head_dir)
    (head_dir / "head.json").chmod(0o644)
    with pytest.raises(UnsafePathError, match="head.json has mode 0644"):
        read_info(head_dir)


def test_a_head_record_naming_a_token_outside_the_head_directory_is_refused(head_dir: Path) -> None:
    record(head_dir, token_path=str(Path.home() / ".ssh" / "id_rsa"))
    with pytest.raises(HeadError, match="id_rsa"):
        read_info(head_dir)


@pytest.mark.parametrize("content", ["{not json", '{"pid": 5}', "[]"])
def test_a_corrupt_head_record_is_an_error_naming_the_file(head_dir: Path, content: str) -> None:
    private_files.write_file(head_dir / "head.json", content.encode())
    with pytest.raises(HeadError, match=str(head_dir / "head.json")):
        read_info(head_dir)
    proc = cli("stop", "--dir", str(head_dir))
    assert proc.returncode == 2 and str(head_dir / "head.json") in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# --- the token -------------------------------------------------------------------------------


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A loopback socket that must never see a connection (where a token would be sent)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.setblocking(False)
        yield sock
        with pytest.raises(BlockingIOError):
            sock.accept()  # nobody connected


@pytest.mark.parametrize("how", ["group readable", "symlink", "other owner"])
def test_a_token_file_others_could_have_written_is_never_sent(
    tmp_path: Path, listener: socket.socket, how: str
) -> None:
    token = tmp_path / "token"
    token.write_text("f" * 64)
    token.chmod(0o640 if how == "group readable" else 0o600)
    if how == "other owner":
        with pytest.raises(UnsafePathError, match=f"{token} is owned by uid"):
            private_files.read_file(token, uid=OTHER_UID)
        return
    named = token
    if how == "symlink":
        named = tmp_path / "link"
        named.symlink_to(token)
    port = listener.getsockname()[1]
    proc = cli("submit", "--address", f"http://127.0.0.1:{port}", "--token-file", str(named), "--", "true")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert str(named) in proc.stderr and "Traceback" not in proc.stderr


def test_a_private_token_file_is_read(tmp_path: Path) -> None:
    token = tmp_path / "token"
    private_files.write_file(token, b"abc123\n")
    assert read_token(token) == "abc123"


# --- stop signals only the recorded head -----------------------------------------------------


@contextlib.contextmanager
def running_decoy(head_dir: Path, code: str = "") -> Iterator[subprocess.Popen[bytes]]:
    """A process of ours whose command line names the head's --temp-dir, as a head's does;
    given once it runs ``code`` (its arguments are set then: right after ``Popen`` returns,
    a loaded machine may not have set them yet), killed on leaving."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"{code}\nimport time\nprint('up', flush=True)\ntime.sleep(300)",
            f"--temp-dir={head_dir / 'ray'}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == b"up\n", f"the decoy exited with {proc.wait(timeout=30)}"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()


@pytest.fixture
def decoy(head_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    with running_decoy(head_dir) as proc:
        yield proc


# The decoy's own arguments overwritten with zeros: its command line then reads empty, as a
# process's does between exec's point of no return and its new arguments (proc(5): fields 48
# and 49 of /proc/<pid>/stat are where the arguments lie).
BLANK_ARGUMENTS = """
import ctypes
fields = open('/proc/self/stat').read().rsplit(')', 1)[1].split()
start, end = int(fields[45]), int(fields[46])
ctypes.memset(start, 0, end - start)
"""


def test_the_recorded_process_whose_command_line_reads_empty_is_the_head_being_started(head_dir: Path) -> None:
    with running_decoy(head_dir, BLANK_ARGUMENTS) as proc:
        assert Path(f"/proc/{proc.pid}/cmdline").read_bytes().strip(b"\0") == b"", "the decoy's arguments still read"
        started = process_start_time(proc.pid)
        assert started is not None
        info = HeadInfo(**record(head_dir, pid=proc.pid, start_time=started))  # type: ignore[arg-type]
        assert head_running(info) is True
        # Not the recorded process (its pid reused), or a record without a start time: never the head.
        assert head_running(HeadInfo(**{**asdict(info), "start_time": started + 1})) is False
        assert head_running(HeadInfo(**{**asdict(info), "start_time": 0})) is False
        assert stop_head(head_dir, timeout_s=30).startswith("stopped the head")
        assert proc.wait(timeout=30) == -15


@pytest.fixture
def signals(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every signal sent through os.kill or a pidfd from here on, as (how, signal); still sent."""
    sent: list[tuple[str, int]] = []
    kill, pidfd_send = os.kill, signal.pidfd_send_signal

    def by_pid(pid: int, signum: int) -> None:
        sent.append((f"pid {pid}", signum))
        kill(pid, signum)

    def by_pidfd(pidfd: int, signum: int, *rest: Any) -> None:
        sent.append(("pidfd", signum))
        pidfd_send(pidfd, signum, *rest)

    monkeypatch.setattr(os, "kill", by_pid)
    monkeypatch.setattr(signal, "pidfd_send_signal", by_pidfd)
    return sent


def test_stop_leaves_a_process_that_reuses_the_heads_pid_alone(
    head_dir: Path, decoy: subprocess.Popen[bytes], signals: list[tuple[str, int]]
) -> None:
    started = process_start_time(decoy.pid)
    assert started is not None
    record(head_dir, pid=decoy.pid, start_time=started + 1)  # the head died, its pid was reused
    assert "is not running; record removed" in stop_head(head_dir, timeout_s=5)
    assert signals == [], f"stop signalled a process that is not the recorded head: {signals}"
    assert read_info(head_dir) is None


def test_a_process_of_another_user_is_never_the_head(head_dir: Path, decoy: subprocess.Popen[bytes]) -> None:
    started = process_start_time(decoy.pid)
    assert started is not None
    info = HeadInfo(**record(head_dir, pid=decoy.pid, start_time=started))  # type: ignore[arg-type]
    assert head_running(info) is True
    assert head_running(info, uid=OTHER_UID) is False
    other_dir = HeadInfo(**{**record(head_dir, pid=decoy.pid, start_time=started), "temp_dir": "/tmp/elsewhere"})  # type: ignore[arg-type]
    assert head_running(other_dir) is False


def test_stop_signals_the_recorded_head_and_forgets_its_record_and_token(
    head_dir: Path, decoy: subprocess.Popen[bytes]
) -> None:
    record(head_dir, pid=decoy.pid, start_time=process_start_time(decoy.pid))
    private_files.write_file(head_dir / "auth_token", b"secret")
    assert stop_head(head_dir, timeout_s=30).startswith("stopped the head")
    assert decoy.wait(timeout=30) == -15  # SIGTERM
    assert read_info(head_dir) is None
    assert not (head_dir / "auth_token").exists(), "the stopped head's token was left behind"


@pytest.mark.parametrize("command", ["env", "submit"])
def test_env_and_submit_refuse_a_recorded_head_that_is_not_running(
    head_dir: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    record(head_dir)  # pid 1: not this user's head
    argv = ["cluster", command, "--dir", str(head_dir)] + (["--", "true"] if command == "submit" else [])
    args = build_parser().parse_args(argv)
    assert args.func(args) == 2
    out = capsys.readouterr()
    assert "not running" in out.err and str(head_dir) in out.err and "cluster start" in out.err, out.err
    assert "RAY_ADDRESS" not in out.out  # nothing to eval for a dead head


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A head directory with a path short enough for Ray's socket names (pytest's are not)."""
    parent = Path(tempfile.mkdtemp(prefix="wsh-"))
    try:
        yield parent / "head"
    finally:
        shutil.rmtree(parent)


def test_a_start_interrupted_while_it_waits_stops_its_head(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while start waits for the job server (here: as it first answers): the head,
    in a session of its own, is stopped with every process of its node, not left running."""
    directory = short_dir
    real_reachable = JobServer.reachable
    pids: list[int] = []

    def interrupted(self: JobServer) -> bool:
        if not real_reachable(self):
            return False
        info = read_info(directory)
        assert info is not None and head_running(info)
        pids.extend([info.pid, *(p.pid for p in psutil.Process(info.pid).children(recursive=True))])
        raise KeyboardInterrupt

    monkeypatch.setattr(JobServer, "reachable", interrupted)
    with pytest.raises(KeyboardInterrupt):
        start_head(directory, timeout_s=300)
    assert len(pids) > 1, "the head had started no processes"
    _, alive = psutil.wait_procs([p for p in map(_process, pids) if p is not None], timeout=60)
    running = [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not running, f"the interrupted start left processes of its head running: {running}"
    assert read_info(directory) is None and not (directory / "auth_token").exists()


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


@pytest.mark.parametrize("reused", [False, True], ids=["the-head", "pid-reused"])
def test_stop_works_on_a_kernel_without_pidfds(
    head_dir: Path,
    decoy: subprocess.Popen[bytes],
    monkeypatch: pytest.MonkeyPatch,
    reused: bool,
    signals: list[tuple[str, int]],
) -> None:
    def no_pidfds(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    started = process_start_time(decoy.pid)
    assert started is not None
    record(head_dir, pid=decoy.pid, start_time=started + 1 if reused else started)
    said = stop_head(head_dir, timeout_s=30)
    if reused:
        assert "is not running" in said and signals == [], signals
    else:
        assert said.startswith("stopped the head") and decoy.wait(timeout=30) == -15
