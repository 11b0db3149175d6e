"""The held-off bookkeeping of the vLLM engine actors, and how the report carries it
(no engine needed: tests/test_vllm.py and tests/test_vllm_async.py measure real holds)."""

from __future__ import annotations

import pytest

from weightsync.core.wire.messages import ReceiveResult
from weightsync.core.wire.outcome import Outcome, Status
from weightsync.core.wire.report import SyncReport, WorkerReport
from weightsync.vllm.hold import HoldRecord, SyncHold, with_held_off


def report(*held: float | None) -> SyncReport:
    workers = [
        WorkerReport(name=f"w{i}", transport="ipc", version=1, state="committed", seconds=0.5, held_off_s=h)
        for i, h in enumerate(held)
    ]
    return SyncReport(version=1, bytes=10, chunks=1, seconds=2.0, gbps=0.0, transports={"ipc": 1}, workers=workers)


def test_a_hold_opens_at_receive_and_ends_when_the_receiver_leaves_receiving() -> None:
    hold = SyncHold("keep")
    assert not hold.begins("ws_accept") and hold.begins("ws_receive")
    hold.start(in_flight=2)
    hold.paused()
    assert not hold.begins("ws_receive")  # one hold per sync
    assert not hold.ends("ws_receive", (0, "receiving"))  # broadcast: the commit follows
    assert hold.ends("ws_commit", (1, "committed"))
    seconds = hold.stop("committed")
    assert hold.last is not None and not hold.open
    assert (hold.last.seconds, hold.last.in_flight, hold.last.mode, hold.last.state) == (
        seconds,
        2,
        "keep",
        "committed",
    )
    assert 0 <= hold.last.pausing_s <= seconds
    assert not hold.ends("ws_commit", (1, "committed"))  # nothing open


@pytest.mark.parametrize("method,state", [("ws_receive", (0, "dirty")), ("ws_settle", (0, "receiving"))])
def test_a_failed_or_settled_sync_ends_the_hold(method: str, state: tuple[int, str]) -> None:
    hold = SyncHold("block")
    hold.start(in_flight=0)
    assert hold.ends(method, state)


def test_the_seconds_go_back_in_the_receive_result_only() -> None:
    result = ReceiveResult(worker="vllm", version=1, state="committed")
    got = with_held_off(Outcome(party="vllm", phase="receive", status=Status.OK, value=result), 0.25)
    assert got.value.held_off_s == 0.25 and got.value.worker == "vllm"
    assert with_held_off((1, "committed"), 0.25) == (1, "committed")


def test_the_report_shows_the_longest_hold_and_none_when_no_worker_says() -> None:
    assert report(None, None).held_off_s is None and "held off" not in report(None).summary()
    both = report(0.125, None, 0.5)
    assert both.held_off_s == 0.5
    assert "generation held off 500.0 ms of 2000.0 ms sync" in both.summary()
    assert [w["held_off_s"] for w in both.to_dict()["workers"]] == [0.125, None, 0.5]


def test_a_hold_record_refuses_negative_figures_by_name() -> None:
    with pytest.raises(ValueError, match="in_flight"):
        HoldRecord(seconds=0.1, pausing_s=0.0, in_flight=-1, mode="keep", state="committed")
    with pytest.raises(ValueError, match="pausing_s"):
        HoldRecord(seconds=0.1, pausing_s=0.2, in_flight=0, mode="keep", state="committed")
