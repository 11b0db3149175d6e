"""Shared-memory regions: their names, whose they are, what a handle may name, and cleanup."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT
from weightsync.core.transport.shm import ShmRegion, leftover_segments
from weightsync.core.wire.shm_names import SCOPE_ENV, SegmentName, current_scope

HOLD = (
    "import sys; from weightsync.core.transport.shm import ShmRegion; "
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
