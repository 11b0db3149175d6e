"""The held-off bookkeeping of the vLLM engine actors, and how the report carries it
(no engine needed: tests/test_vllm.py and tests/test_vllm_async.py measure real holds).

The actors' own bookkeeping (which call ends a hold, when vLLM is told a version, what
waits for a coordinator call) is driven here through scripted answers in place of the
engine's workers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from weightsync.core.wire.messages import ReceiveResult
from weightsync.core.wire.outcome import Outcome, Status
from weightsync.core.wire.report import SyncReport, WorkerReport
from weightsync.vllm.codec import Reply, encode_reply
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
    seconds = hold.stop("committed", "ws_commit")
    assert hold.last is not None and not hold.open
    assert (hold.last.seconds, hold.last.in_flight, hold.last.mode, hold.last.state, hold.last.ended_by) == (
        seconds,
        2,
        "keep",
        "committed",
        "ws_commit",
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
        HoldRecord(seconds=0.1, pausing_s=0.0, in_flight=-1, mode="keep", state="committed", ended_by="ws_commit")
    with pytest.raises(ValueError, match="pausing_s"):
        HoldRecord(seconds=0.1, pausing_s=0.2, in_flight=0, mode="keep", state="committed", ended_by="ws_commit")
    with pytest.raises(ValueError, match="ended_by"):
        HoldRecord(seconds=0.1, pausing_s=0.0, in_flight=0, mode="keep", state="committed", ended_by="")


def _answers(*states: tuple[int | None, str]) -> Iterator[list[bytes]]:
    """One rank's answers to the next calls, each reporting the receiver's state after it."""
    for state in states:
        yield [encode_reply(Reply(ok=True, value=state, state=state))]


def _sync_worker(answers: Iterator[list[bytes]]) -> Any:
    pytest.importorskip("vllm")
    from weightsync.vllm.engine import EngineCallError, _VLLMWorker
    from weightsync.vllm.parts import PartRouting
    from weightsync.vllm.served import ServedAdapter
    from weightsync.vllm.staging import Stager

    worker: Any = object.__new__(_VLLMWorker)  # the actor's bookkeeping, without an engine
    worker.name, worker.timeout_s, worker.native, worker._broken, worker._version = "vllm", 30.0, False, None, None
    worker._staged, worker._swap_wanted, worker._stager = False, False, Stager("vllm", 30.0)
    worker._served = ServedAdapter("vllm")
    worker._lock = threading.Lock()
    worker._idle = threading.Condition(worker._lock)
    worker._hold = SyncHold("block")
    worker._routing = PartRouting(1)
    worker._served = ServedAdapter("vllm")

    def rpc(method: str, args: tuple[Any, ...] = (), kwargs: Any = None) -> list[Any]:
        answer = next(answers, None)
        if answer is None:
            worker._broken = "the engine died (scripted)"
            raise EngineCallError(f"vllm: {worker._broken}")
        return answer

    worker._rpc = rpc
    return worker


@pytest.mark.parametrize("ending", ["ws_settle", "ws_teardown"])
def test_a_failed_syncs_hold_ended_by_settle_or_teardown_is_recorded_with_how_it_ended(ending: str) -> None:
    """Broadcast: the hold spans receive and commit; the sync fails elsewhere and the
    coordinator settles (the engine answers dirty) or tears down (the engine is gone)."""
    answers = _answers((None, "receiving"), (None, "dirty"))
    worker = _sync_worker(answers if ending == "ws_settle" else _answers((None, "receiving")))
    worker.forward_weightsync("ws_receive")
    assert worker._hold.open and worker.last_hold() is None
    if ending == "ws_settle":
        assert worker.forward_weightsync("ws_settle") == (None, "dirty")
    else:
        with pytest.raises(Exception, match="died"):
            worker.forward_weightsync("ws_teardown")
    hold = worker.last_hold()
    assert not worker._hold.open and hold is not None and hold.seconds > 0
    assert (hold.ended_by, hold.state) == (ending, "dirty" if ending == "ws_settle" else "failed")


class _FakeAsyncLLM:
    """AsyncLLM's surface the actor uses; its workers answer from ``answers``."""

    errored = False

    def __init__(self, answers: Iterator[list[bytes]]) -> None:
        self.answers = answers
        self.versions: list[str] = []
        self.calls: list[str] = []
        self.gate: asyncio.Event | None = None  # when set, a collective_rpc waits for it

    async def collective_rpc(self, method: str, timeout: float, args: tuple[Any, ...], kwargs: Any = None) -> Any:
        self.calls.append("rpc")
        if self.gate is not None:
            await self.gate.wait()
        self.calls.append("rpc done")
        return next(self.answers)

    def get_num_unfinished_requests(self) -> int:
        return 0

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.calls.append("pause")

    async def resume_generation(self) -> None:
        self.calls.append("resume")

    async def update_weight_version(self, version: str) -> None:
        self.versions.append(version)

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.fixture
def socket_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """A folder of the test's own for the actor built here: the actor names its socket
    folder in its process's environment, here the test process's, which a Ray cluster
    started later in the session would hand to every engine actor."""
    from weightsync.vllm.sockets import ENV_VAR

    monkeypatch.setenv(ENV_VAR, str(tmp_path))


def _async_worker(llm: _FakeAsyncLLM) -> Any:
    pytest.importorskip("vllm")
    from weightsync.vllm.async_engine import _AsyncVLLMWorker

    worker = _AsyncVLLMWorker(name="vllm", timeout_s=30.0, check_model=False)
    worker._llm = llm
    return worker


def test_the_async_actor_tells_vllm_a_version_only_when_a_commit_changed_it(socket_folder: None) -> None:
    llm = _FakeAsyncLLM(_answers((1, "committed"), (1, "committed"), (1, "committed"), (2, "committed")))

    async def drive() -> None:
        worker = _async_worker(llm)
        await worker.forward_weightsync("ws_receive")  # ipc: commits version 1
        await worker.forward_weightsync("ws_checksums")  # answers committed, version unchanged
        await worker.forward_weightsync("ws_settle")
        await worker.forward_weightsync("ws_receive")  # version 2
        assert (await worker.last_hold()).ended_by == "ws_receive"

    asyncio.run(drive())
    assert llm.versions == ["1", "2"]


def test_the_async_actors_shutdown_waits_for_the_coordinator_call_in_progress(socket_folder: None) -> None:
    llm = _FakeAsyncLLM(_answers((1, "committed")))

    async def drive() -> None:
        worker = _async_worker(llm)
        llm.gate = asyncio.Event()
        call = asyncio.create_task(worker.forward_weightsync("ws_receive"))
        for _ in range(100):  # yield until the call is inside the engine
            if "rpc" in llm.calls:
                break
            await asyncio.sleep(0)
        assert llm.calls == ["pause", "rpc"]
        stop = asyncio.create_task(worker.shutdown())
        for _ in range(20):
            await asyncio.sleep(0)  # let the shutdown run as far as it can
        assert "shutdown" not in llm.calls
        llm.gate.set()
        assert await call == (1, "committed")
        await stop

    asyncio.run(drive())
    assert llm.calls == ["pause", "rpc", "rpc done", "resume", "shutdown"]


def test_an_unusable_async_engine_still_ends_and_records_an_open_hold(socket_folder: None) -> None:
    llm = _FakeAsyncLLM(_answers((None, "receiving")))

    async def drive() -> Any:
        worker = _async_worker(llm)
        await worker.forward_weightsync("ws_receive")  # broadcast: the hold stays open
        worker._broken = "the engine died (scripted)"
        with pytest.raises(Exception, match="unusable"):
            await worker.forward_weightsync("ws_teardown")
        return await worker.last_hold()

    hold = asyncio.run(drive())
    assert hold is not None and (hold.ended_by, hold.state) == ("ws_teardown", "failed")
