"""The colocated control block: abort words that no side overwrites, waits that name who
failed or is late, and the timer slack a sleeping wait borrows and gives back."""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from weightsync.core.wire import PeerAborted, TransferTimeout, WeightSyncError
from weightsync.mechanisms import control as control_module
from weightsync.mechanisms import pace as pace_module
from weightsync.mechanisms import streams as streams_module
from weightsync.mechanisms.control import TRAINER, ControlBlock, worker_code
from weightsync.mechanisms.pace import FIRST_SPIN_S, NO_SPIN, Pace, spinning
from weightsync.mechanisms.shm import map_shm
from weightsync.mechanisms.streams import precise_sleeps, wait_for_event, wait_for_stream

NAMES = ["trainer", "w0", "w1"]
HANG_BOUND_S = 60.0  # only bounds a hang; a working wait returns at once


def never() -> bool:
    return False


def test_control_block_names_the_side_that_aborted_and_keeps_the_first_code(no_shm_leftovers: None) -> None:
    block = ControlBlock.create(2, tag="test", parties=3)
    try:
        block.abort(worker_code(1))
        block.abort(TRAINER)  # the first failure is the one named, the later one after it
        with pytest.raises(PeerAborted, match="w1 failed during the transfer \\(then trainer too\\)") as info:
            block.wait(never, time.monotonic() + 60, "trainer", lambda: "nothing", NAMES)
        assert info.value.blames == ("w1",)
        assert block.aborts == [worker_code(1), TRAINER]
    finally:
        block.close()


def test_two_sides_aborting_at_once_both_count_and_the_first_to_fail_is_named(
    monkeypatch: pytest.MonkeyPatch, no_shm_leftovers: None
) -> None:
    """w0 reads the clock, then w1 fails and records its abort whole before w0's words land
    (the interleaving a check-then-set of one shared word lost): every reader names w0."""
    block = ControlBlock.create(1, tag="test", parties=3)
    other = ControlBlock.attach(block._region.tensor, "w1", block.path)  # type: ignore[union-attr]
    clock = iter(range(100, 200))

    def w0_clock() -> int:
        stamp = next(clock)
        monkeypatch.setattr(control_module, "_clock", lambda: next(clock))
        other.abort(worker_code(1))  # lands in between, with a later stamp
        return stamp

    monkeypatch.setattr(control_module, "_clock", w0_clock)
    try:
        block.abort(worker_code(0))
        for reader in (block, other):
            assert reader.aborts == [worker_code(0), worker_code(1)]
            assert reader.aborted_by == worker_code(0)
        with pytest.raises(PeerAborted, match="w0 failed") as info:
            other.wait(never, time.monotonic() + 60, "trainer", lambda: "nothing", NAMES)
        assert info.value.blames == ("w0",)
    finally:
        block.close()


def _abort_in_child(block: ControlBlock, code: int, epoch: int) -> None:
    pid = os.fork()
    if pid == 0:  # another process, with its own mapping of the block
        status = 1
        try:
            mine = ControlBlock.attach(map_shm(block.handle()), f"party {code}", block.path)
            mine.epoch = epoch
            mine.abort(code)
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_aborts_from_other_processes_are_seen_per_sync_and_each_sides_first_stands(
    no_shm_leftovers: None,
) -> None:
    block = ControlBlock.create(1, tag="test", parties=3)
    try:
        block.epoch = 2
        _abort_in_child(block, TRAINER, epoch=1)  # an earlier sync's: stale
        assert block.aborts == [] and block.aborted_by == 0
        _abort_in_child(block, worker_code(1), epoch=2)
        _abort_in_child(block, TRAINER, epoch=2)  # replaces its stale abort, after w1
        _abort_in_child(block, worker_code(1), epoch=2)  # w1 again: its first failure stands
        assert block.aborts == [worker_code(1), TRAINER]
        block.epoch = 3
        assert block.aborted_by == 0  # the next sync starts clean
    finally:
        block.close()


def test_an_abort_code_outside_the_parties_and_a_foreign_block_are_refused(no_shm_leftovers: None) -> None:
    block = ControlBlock.create(1, tag="test", parties=2)
    try:
        with pytest.raises(WeightSyncError, match="abort code 3 is not one of its 2 parties"):
            block.abort(3)
        block.words[1] = 1 << 40  # a parties count the file cannot hold
        with pytest.raises(WeightSyncError, match="not weightsync's"):
            ControlBlock.attach(block._region.tensor, "w0", block.path)  # type: ignore[union-attr]
    finally:
        block.close()


def test_control_block_times_out_blaming_the_late_party_and_notices_a_dead_peer(no_shm_leftovers: None) -> None:
    block = ControlBlock.create(1, tag="test", parties=1)
    try:
        with pytest.raises(TransferTimeout) as info:
            block.wait(never, time.monotonic() + 0.05, "trainer", lambda: "w0", ["trainer"], late=lambda: ["w0"])
        assert info.value.blames == ("w0",)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        with pytest.raises(PeerAborted, match=f"pid {pid}"):
            block.wait(never, time.monotonic() + 60, "trainer", lambda: "w0", ["trainer"], peer_pid=lambda: pid)
    finally:
        block.close()


LINUX = sys.platform.startswith("linux")
_SET, _GET = 29, 30  # PR_SET_TIMERSLACK, PR_GET_TIMERSLACK


@pytest.mark.skipif(not LINUX, reason="timer slack is Linux's")
def test_a_gpu_transports_sleeping_wait_shortens_its_threads_timer_slack_while_it_waits(
    no_shm_leftovers: None,
) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    slack: dict[str, int] = {}

    def waiter() -> None:
        libc.prctl(_SET, 50_000, 0, 0, 0)  # Linux's default, whatever was inherited
        slack["before"] = libc.prctl(_GET, 0, 0, 0, 0)
        block = ControlBlock.create(1, tag="test", parties=1)
        block.precise = True  # as the GPU transports set it

        def late() -> list[str]:  # called at the deadline, still inside the wait
            slack["waiting"] = libc.prctl(_GET, 0, 0, 0, 0)
            return ["w0"]

        try:
            with pytest.raises(TransferTimeout):  # long enough to leave the spinning and sleep
                block.wait(never, time.monotonic() + 0.05, "trainer", lambda: "w0", ["trainer"], late=late)
        finally:
            block.close()
        slack["after"] = libc.prctl(_GET, 0, 0, 0, 0)

    mine = libc.prctl(_GET, 0, 0, 0, 0)
    thread = threading.Thread(target=waiter)
    thread.start()
    thread.join(30)
    assert slack == {"before": 50_000, "waiting": 1, "after": 50_000}
    assert libc.prctl(_GET, 0, 0, 0, 0) == mine, "another thread's slack must not change"
    cpu = ControlBlock.create(1, tag="test", parties=1)  # a CPU transport's block leaves the slack alone
    try:
        libc.prctl(_SET, 50_000, 0, 0, 0)
        seen: list[int] = []
        with pytest.raises(TransferTimeout):
            cpu.wait(
                never,
                time.monotonic() + 0.05,
                "trainer",
                lambda: "w0",
                ["trainer"],
                late=lambda: seen.append(libc.prctl(_GET, 0, 0, 0, 0)) or [],
            )
        assert seen == [50_000] and libc.prctl(_GET, 0, 0, 0, 0) == 50_000
    finally:
        libc.prctl(_SET, mine, 0, 0, 0)
        cpu.close()


@pytest.mark.skipif(not LINUX, reason="timer slack is Linux's")
def test_precise_sleeps_nest_and_restore_the_slack_even_when_the_block_raises() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    mine = libc.prctl(_GET, 0, 0, 0, 0)
    try:
        libc.prctl(_SET, 70_000, 0, 0, 0)
        with pytest.raises(KeyboardInterrupt):
            with precise_sleeps():
                with precise_sleeps():
                    assert libc.prctl(_GET, 0, 0, 0, 0) == 1
                assert libc.prctl(_GET, 0, 0, 0, 0) == 1, "an inner block must leave the outer one's slack"
                raise KeyboardInterrupt
        assert libc.prctl(_GET, 0, 0, 0, 0) == 70_000
    finally:
        libc.prctl(_SET, mine, 0, 0, 0)


class Looks:
    """A predicate that turns true at its ``n``-th look."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.looks = 0

    def __call__(self) -> bool:
        self.looks += 1
        return self.looks >= self.n


class Clock:
    """A module's ``time``: a clock that moves ``step`` seconds at each reading, and sleeps
    recorded (as the reading they began at) and skipped, so the waits run without real time."""

    def __init__(self, step: float) -> None:
        self.now = 1000.0
        self.step = step
        self.slept: list[float] = []

    def monotonic(self) -> float:
        self.now += self.step
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(self.now)


@pytest.mark.parametrize(
    ("precise", "window", "sleeps"),
    [(True, (0.0, float("inf")), False), (True, NO_SPIN, True), (False, (0.0, float("inf")), True)],
)
def test_a_gpu_wait_looks_without_sleeping_inside_its_spin_window_and_only_there(
    precise: bool, window: tuple[float, float], sleeps: bool, monkeypatch: pytest.MonkeyPatch, no_shm_leftovers: None
) -> None:
    clock = Clock(1e-6)  # the 2500 looks span 2.5 ms, past the first spin
    monkeypatch.setattr(control_module, "time", clock)
    block = ControlBlock.create(1, tag="test", parties=1)
    block.precise = precise  # a CPU transport's block never spins: its peer needs the cores
    try:
        block.wait(Looks(2500), clock.now + HANG_BOUND_S, "w0", lambda: "trainer", ["trainer"], spin=window)
    finally:
        block.close()
    assert bool(clock.slept) is sleeps, len(clock.slept)


def test_a_stream_wait_polls_without_sleeping_inside_its_spin_window(monkeypatch: pytest.MonkeyPatch) -> None:
    for window, sleeps in [((0.0, float("inf")), False), (NO_SPIN, True)]:
        clock = Clock(1e-6)
        monkeypatch.setattr(streams_module, "time", clock)
        stream: Any = SimpleNamespace(query=Looks(2500))  # a stream whose work ends at its 2500th look
        wait_for_stream(stream, clock.now + HANG_BOUND_S, "copies into w0 timed out", own=True, spin=window)
        assert bool(clock.slept) is sleeps, len(clock.slept)


@pytest.mark.parametrize("step", [1e-6, 50e-6], ids=["fast-looks", "slow-looks"])
def test_every_wait_spins_for_its_first_spin_time_however_long_a_look_takes(
    step: float, monkeypatch: pytest.MonkeyPatch, no_shm_leftovers: None
) -> None:
    # A spinning look holds the thread's GIL: the spin is bounded in time, not in looks, so
    # a costly look (a control block's, a busy host's) does not hold other threads off longer.
    expected_looks = round(FIRST_SPIN_S / step)
    clock = Clock(step)
    monkeypatch.setattr(control_module, "time", clock)
    block = ControlBlock.create(1, tag="test", parties=1)
    block.precise = True
    looks = Looks(4 * expected_looks + 10)
    began = clock.now
    try:
        block.wait(looks, clock.now + HANG_BOUND_S, "w0", lambda: "trainer", ["trainer"], spin=NO_SPIN)
    finally:
        block.close()
    first_sleep = clock.slept[0]
    assert FIRST_SPIN_S <= first_sleep - began <= FIRST_SPIN_S + 2 * step, first_sleep - began
    for kind in ("stream", "event"):
        clock = Clock(step)
        monkeypatch.setattr(streams_module, "time", clock)
        began = clock.now
        work: Any = SimpleNamespace(query=Looks(4 * expected_looks + 10))
        if kind == "event":
            wait_for_event(work, clock.now + HANG_BOUND_S, "copies timed out")
        else:
            wait_for_stream(work, clock.now + HANG_BOUND_S, "copies timed out", own=True)
        assert FIRST_SPIN_S <= clock.slept[0] - began <= FIRST_SPIN_S + 2 * step, (kind, clock.slept[0] - began)


def test_a_pace_opens_its_window_around_when_the_last_wait_says_the_next_one_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pace = Pace()
    assert pace.window(100.0) == NO_SPIN  # nothing to expect before a first wait

    def ended_at(now: float) -> None:
        monkeypatch.setattr(pace_module, "time", SimpleNamespace(monotonic=lambda: now))

    ended_at(100.011)
    pace.record(100.0)  # an 11 ms wait: a window of 2% of it on either side, and 1 ms late
    start, end = pace.window(200.0)
    assert spinning((start, end), 200.011)  # when the next one is due
    assert not spinning((start, end), 200.0105) and not spinning((start, end), 200.0125)
    assert start - 200.0 == pytest.approx(0.011 - 0.00022, abs=1e-9)
    assert end - start == pytest.approx(2 * 0.00022 + 0.001, abs=1e-9)
    for waited, lead in [(1.0, 0.002), (0.001, 0.0001)]:  # the lead stays within 0.1-2 ms
        ended_at(100.0 + waited)
        pace.record(100.0)
        start, end = pace.window(0.0)
        assert start == pytest.approx(waited - lead, abs=1e-9), waited
        assert end == pytest.approx(waited + lead + 0.001, abs=1e-9), waited
