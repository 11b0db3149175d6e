"""A real Ray head with token auth and the job server, driven by the documented commands.

Every Ray call here happens in child processes (the head, the CLI, `ray job submit`): the
head is a cluster of its own, apart from this session's (tests/conftest.py). The job API is
reached over HTTP only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.listeners import is_loopback, listening
from weightsync.tools.head import WORKER_NICENESS, HeadInfo, read_info, stop_head
from weightsync.tools.jobs import JobServer
from weightsync.tools.private_files import write_file

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
RAY = str(Path(sys.executable).parent / "ray")


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def clean_env() -> dict[str, str]:
    """This test process's environment without any cluster address or token of its own."""
    drop = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "WEIGHTSYNC_HEAD_DIR")
    return {k: v for k, v in os.environ.items() if k not in drop}


def session_pids(sid: int) -> set[int]:
    """Processes in the session the head's `ray start` leads (everything the head started)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.add(int(entry))
    return found


@pytest.fixture(scope="module")
def head() -> Iterator[HeadInfo]:
    # A short path: Ray's socket paths under the temp dir must stay under 107 bytes.
    directory = Path(tempfile.mkdtemp(prefix="wsh-", dir="/tmp"))
    started = run(
        PY, "-m", "weightsync", "cluster", "start", "--dir", str(directory), "--num-cpus", "2", env=clean_env()
    )
    assert started.returncode == 0, started.stdout + started.stderr + (directory / "head.log").read_text()
    info = read_info(directory)
    assert info is not None
    try:
        yield info
    finally:
        if read_info(directory) is not None:
            stop_head(directory)  # a test failed before the stop test ran
        shutil.rmtree(directory, ignore_errors=True)


def test_head_is_on_loopback_and_refuses_requests_without_its_token(head: HeadInfo) -> None:
    assert head.dashboard_url.startswith("http://127.0.0.1:") and head.gcs_address.startswith("127.0.0.1:")
    found = listening(session_pids(head.pid))
    assert len(found) >= 3, found  # at least the GCS, the raylet and the job server
    wide = [(address, port) for address, port in found if not is_loopback(address)]
    assert not wide, f"the head listens beyond loopback: {wide}"
    assert oct(Path(head.token_path).stat().st_mode & 0o777) == "0o600"
    assert requests.get(f"{head.dashboard_url}/api/jobs/", timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer " + "0" * 64}
    assert requests.get(f"{head.dashboard_url}/api/jobs/", headers=wrong, timeout=30).status_code == 403
    token = Path(head.token_path).read_text().strip()
    ok = requests.get(f"{head.dashboard_url}/api/jobs/", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert ok.status_code == 200


def test_demo_submitted_as_a_job_succeeds_and_every_worker_is_bit_exact(head: HeadInfo) -> None:
    """The job's runtime env sets PYTHONPATH of its own, which Ray would refuse to merge with
    one the demo's ray.init passed too: the demo joins with the job's alone."""
    steps = 2
    own_env = json.dumps({"env_vars": {"PYTHONPATH": ".", "WEIGHTSYNC_JOB_MARK": "1"}})
    proc = run(
        PY, "-m", "weightsync", "cluster", "submit", "--dir", head.directory, "--timeout", "360",
        "--runtime-env-json", own_env,
        "--", "python", "-m", "weightsync", "demo", "--size", "1mb", "--steps", str(steps), "--workers", "2",
        env=clean_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    job_id = proc.stdout.split("submitted job ", 1)[1].split()[0]
    assert f"job {job_id}: SUCCEEDED" in proc.stdout
    client = head.job_server.client()
    assert str(client.get_job_status(job_id).value) == "SUCCEEDED"
    log = client.get_job_logs(job_id)
    assert f"demo passed: {steps} syncs to 2 worker(s)" in log
    assert log.count("  bit-exact\n") == steps
    assert "ray: joined" in log  # the job joined this head instead of starting a cluster


NICENESS = """
import os, ray
ray.init()
@ray.remote(num_cpus=0)
def niceness() -> int:
    return os.nice(0)
print("NICE", ray.get(niceness.remote(), timeout=120), os.nice(0))
"""


def test_a_jobs_actors_run_at_the_priority_of_the_machines_other_processes(head: HeadInfo) -> None:
    """Not Ray's niceness 15, which would starve them beside any busy process."""
    proc = run(
        PY, "-m", "weightsync", "cluster", "submit", "--dir", head.directory, "--timeout", "300",
        "--", "python", "-c", NICENESS,
        env=clean_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("NICE "))
    actor, driver = (int(n) for n in line.split()[1:])
    assert actor == os.nice(0) + WORKER_NICENESS and driver == os.nice(0), line


def test_a_job_with_a_bad_transport_ends_failed_with_the_error_in_its_log(head: HeadInfo) -> None:
    # The plain Ray CLI, with the exports `cluster env` prints (the README's second way).
    exports = run(PY, "-m", "weightsync", "cluster", "env", "--dir", head.directory, env=clean_env())
    assert exports.returncode == 0, exports.stderr
    env = clean_env()
    for line in exports.stdout.splitlines():
        name, value = line.removeprefix("export ").split("=", 1)
        env[name] = value.strip("'")
    assert env["RAY_ADDRESS"] == head.dashboard_url and env["RAY_AUTH_MODE"] == "token"
    job_id = f"ws-bad-transport-{os.getpid()}"
    proc = run(
        RAY, "job", "submit", "--submission-id", job_id, "--working-dir", ".",
        "--", "python", "-m", "weightsync", "demo", "--size", "1mb", "--transport", "bogus",
        env=env,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout + proc.stderr
    client = head.job_server.client()
    assert str(client.get_job_status(job_id).value) == "FAILED"
    log = client.get_job_logs(job_id)
    assert "--transport" in log and "bogus" in log


def test_stop_ends_every_process_of_this_head_and_only_this_head(head: HeadInfo) -> None:
    mine = session_pids(head.pid)
    assert head.pid in mine and len(mine) > 3  # gcs, raylet, dashboard, ... under `ray start --block`
    proc = run(PY, "-m", "weightsync", "cluster", "stop", "--dir", head.directory, env=clean_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "stopped the head" in proc.stdout
    deadline = time.monotonic() + 60
    left = mine
    while left and time.monotonic() < deadline:
        left = {pid for pid in left if Path(f"/proc/{pid}").exists() and pid in session_pids(head.pid)}
        time.sleep(0.2)
    assert not left, f"processes of the stopped head still running: {sorted(left)}"
    assert read_info(Path(head.directory)) is None
    # Stopped at once, not after Ray's drain of the node (which waits for every lease).
    log = (Path(head.directory) / "head.log").read_text()
    assert "received SIGTERM" not in log and "Draining" not in log, log[-2000:]
    again = run(PY, "-m", "weightsync", "cluster", "stop", "--dir", head.directory, env=clean_env(), timeout=60)
    assert again.returncode == 0 and "nothing to stop" in again.stdout


# --- without a head ------------------------------------------------------------------------


def test_submit_without_a_head_names_the_directory_and_the_start_command(tmp_path: Path) -> None:
    proc = run(PY, "-m", "weightsync", "cluster", "submit", "--dir", str(tmp_path), "--", "true", env=clean_env())
    assert proc.returncode == 2
    assert str(tmp_path) in proc.stderr and "cluster start" in proc.stderr


@pytest.mark.parametrize(
    ("field", "value"),
    [("pid", 0), ("dashboard_url", "http://10.1.2.3:8265"), ("token_path", "")],
)
def test_a_damaged_head_record_is_refused_naming_the_field(field: str, value: Any) -> None:
    good = {
        "directory": "/tmp/x",
        "pid": 123,
        "gcs_address": "127.0.0.1:1",
        "dashboard_url": "http://127.0.0.1:2",
        "token_path": "/tmp/x/auth_token",
        "temp_dir": "/tmp/x/ray",
    }
    HeadInfo(**good)
    with pytest.raises(ValueError, match=field):
        HeadInfo(**{**good, field: value})


def test_a_job_server_without_a_token_is_refused() -> None:
    with pytest.raises(ValueError, match="token"):
        JobServer("http://127.0.0.1:1", "")


def test_head_record_round_trips_through_head_json(tmp_path: Path) -> None:
    info = {
        "directory": str(tmp_path),
        "pid": 1,
        "gcs_address": "127.0.0.1:1",
        "dashboard_url": "http://127.0.0.1:2",
        "token_path": str(tmp_path / "auth_token"),
        "temp_dir": str(tmp_path / "ray"),
    }
    write_file(tmp_path / "head.json", json.dumps(info).encode())  # 0600, as `start` writes it
    assert read_info(tmp_path) == HeadInfo(**info)
