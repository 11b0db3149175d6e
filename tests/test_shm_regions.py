"""Shared-memory regions: their names, whose they are, what a handle may name, and cleanup."""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from weightsync.compat.packed_ipc import CPU_HANDLE_KEY, packed_ipc_consumer
from weightsync.core.wire.errors import ForeignPath, SettingsError
from weightsync.core.wire.messages import ShmHandle
from weightsync.core.wire.shm_names import SCOPE_ENV, SHM_DIR, SegmentName, current_scope
from weightsync.mechanisms.regions import RegionImporter
from weightsync.mechanisms.shm import ShmRegion, leftover_segments, map_shm

HOLD = (
    "import sys; from weightsync.mechanisms.shm import ShmRegion; "
    "r = ShmRegion(4096); print(r.path, flush=True); sys.stdin.readline(); r.close()"
)


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def _holding(env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """A child process holding a fresh region; returns it and the region's path."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    return child, child.stdout.readline().strip()


def _release(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.write("\n")
    child.stdin.flush()
    assert child.wait(timeout=120) == 0


def test_leak_checks_see_this_sessions_regions_and_not_another_processs(no_shm_leftovers: None) -> None:
    ours, ours_path = _holding(_env())
    theirs, theirs_path = _holding(_env(**{SCOPE_ENV: "someoneelse"}))
    try:
        own = leftover_segments(scope=current_scope())
        assert os.path.basename(ours_path) in own, "a child's region inherits this session's scope"
        assert os.path.basename(theirs_path) not in own, "another scope's region counted as this session's"
        assert os.path.basename(theirs_path) in leftover_segments()
        parsed = SegmentName.parse(os.path.basename(theirs_path))
        assert parsed is not None and parsed.scope == "someoneelse" and parsed.pid == theirs.pid
    finally:
        _release(ours)
        _release(theirs)


def test_a_region_name_carries_pid_namespace_scope_and_tag() -> None:
    region = ShmRegion(64, tag="probe")
    try:
        parsed = SegmentName.parse(os.path.basename(region.path))
        assert parsed is not None
        assert (parsed.pid, parsed.scope, parsed.tag) == (os.getpid(), current_scope(), "probe")
        assert parsed.pidns == os.stat("/proc/self/ns/pid").st_ino
        assert parsed.session == region.session
    finally:
        region.close()


# --- what a handle may name ---------------------------------------------------------------

VALID = f"/dev/shm/weightsync-1-1-0-{'ab' * 8}-slots"
FOREIGN = [
    "/etc/passwd",
    "/dev/shm/../etc/passwd",
    "/dev/shm/weightsync-evil",
    "/dev/shm/sub/" + VALID.rsplit("/", 1)[1],
    "/tmp/" + VALID.rsplit("/", 1)[1],
    VALID + "/..",
    "",
]


def forged(path: str, nbytes: int = 16) -> ShmHandle:
    """A handle as an unpickled one arrives: built without running its own checks."""
    handle = object.__new__(ShmHandle)
    for name, value in (("path", path), ("nbytes", nbytes), ("hostname", socket.gethostname()), ("session", "s")):
        object.__setattr__(handle, name, value)
    return handle


@pytest.mark.parametrize("path", FOREIGN)
def test_a_handle_naming_anything_but_a_weightsync_region_is_refused_by_path(path: str) -> None:
    with pytest.raises(ForeignPath) as info:
        ShmHandle(path=path, nbytes=16, hostname=socket.gethostname(), session="s")
    assert repr(path) in str(info.value)
    with pytest.raises(ForeignPath, match=re.escape(repr(path))):
        map_shm(forged(path))
    assert ShmHandle(path=VALID, nbytes=16, hostname="h", session="s").path == VALID


def test_a_forged_direct_export_or_packed_handle_never_reads_or_writes_the_named_file(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret bytes, 32 of them.......!")
    # The trainer maps a direct worker's region through a RegionImporter; a packed IPC
    # consumer maps the producer's buffer: both refuse before opening anything.
    with pytest.raises(ForeignPath, match=re.escape(str(victim))):
        RegionImporter("trainer->worker-0").map(forged(str(victim), 32))
    with pytest.raises(ForeignPath, match=re.escape(str(victim))):
        packed_ipc_consumer({CPU_HANDLE_KEY: forged(str(victim), 32)}, ["t"], [[8]], ["float32"], [32], 0)
    # A link in /dev/shm with a region's name is refused too, not followed.
    name = SegmentName.fresh("evil")
    link = os.path.join(SHM_DIR, str(name))
    os.symlink(victim, link)
    try:
        with pytest.raises(ForeignPath, match="symbolic link"):
            map_shm(forged(link, 32))
    finally:
        os.unlink(link)
    assert victim.read_bytes() == b"secret bytes, 32 of them.......!"
    # Something with a region's name that is not a regular file (a FIFO here; another
    # user's file the same way) is refused as foreign, naming it.
    fifo = os.path.join(SHM_DIR, str(SegmentName.fresh("evil")))
    os.mkfifo(fifo, 0o600)
    try:
        with pytest.raises(ForeignPath, match=re.escape(fifo)):
            map_shm(forged(fifo, 32))
    finally:
        os.unlink(fifo)


# --- who sweeps what --------------------------------------------------------------------

KILLED = (
    "import os, signal; from weightsync.mechanisms.shm import ShmRegion; "
    "r = ShmRegion(1 << 16); print(r.path, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
)


def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def test_the_next_region_of_the_same_process_sweeps_a_killed_peers_region(no_shm_leftovers: None) -> None:
    ShmRegion(64, tag="first").close()  # this process has made a region (and swept) already
    died = subprocess.run([sys.executable, "-c", KILLED], cwd=ROOT, env=_env(), capture_output=True, text=True)
    assert died.returncode == -signal.SIGKILL, died.stderr
    left = died.stdout.strip()
    assert os.path.exists(left), "the killed process's region should be there until a sweep"
    try:
        ShmRegion(64, tag="next").close()
        assert not os.path.exists(left), f"{left}: a dead creator's region survived the next set-up"
    finally:
        if os.path.exists(left):
            os.unlink(left)


def test_a_region_of_another_pid_namespace_is_never_swept(no_shm_leftovers: None) -> None:
    dead = _dead_pid()
    ours = SegmentName.fresh("x")
    elsewhere = replace(ours, pid=dead, pidns=ours.pidns + 1, session="1" * 16)
    here = replace(ours, pid=dead, session="2" * 16)
    paths = [os.path.join(SHM_DIR, str(n)) for n in (elsewhere, here)]
    for path in paths:
        with open(path, "wb") as fh:
            fh.write(b"\0" * 64)
    try:
        ShmRegion(64, tag="sweep").close()
        assert os.path.exists(paths[0]), "a region of another pid namespace was deleted (its creator may be alive)"
        assert not os.path.exists(paths[1]), "a dead creator's region of this namespace was not removed"
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


# --- sizes and failures while creating ----------------------------------------------------------


@pytest.mark.parametrize("nbytes", [2**62, -1])
def test_an_impossible_size_is_refused_before_any_file_exists(nbytes: int, no_shm_leftovers: None) -> None:
    before = set(leftover_segments(scope=current_scope()))
    with pytest.raises(SettingsError, match=str(nbytes)):
        ShmRegion(nbytes, tag="huge")
    assert set(leftover_segments(scope=current_scope())) == before


def test_a_failure_after_the_file_is_created_removes_it(
    monkeypatch: pytest.MonkeyPatch, no_shm_leftovers: None
) -> None:
    before = set(leftover_segments(scope=current_scope()))

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOMEM, "mapping refused")

    monkeypatch.setattr(torch, "from_file", refuse)
    with pytest.raises(OSError, match="mapping refused"):
        ShmRegion(4096, tag="fails")
    monkeypatch.undo()
    assert set(leftover_segments(scope=current_scope())) == before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="zombies are read from Linux's /proc")
def test_a_killed_process_not_yet_reaped_is_dead_to_the_liveness_check() -> None:
    """A killed Ray actor stays a zombie until the raylet reaps it; the peers watching its
    pid must see it dead then, not once it is reaped (or at their deadline)."""
    from weightsync.mechanisms.shm import pid_alive

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert pid_alive(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # it exited; still a zombie, not reaped
        assert not pid_alive(proc.pid), f"pid {proc.pid}, killed and not yet reaped, read as alive"
    finally:
        proc.kill()
        proc.wait(30)
    assert not pid_alive(proc.pid)
    assert pid_alive(os.getpid())
