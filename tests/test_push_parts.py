"""A push's answer built from its parties' own posts on the coordinator's reply board: the
trainer's send and each listening worker's answer, so ``WeightSync.sync`` returns without
waiting for the trainer to relay the workers' answers (weightsync/glue/push_parts.py)."""

from __future__ import annotations

import functools
import logging
import pickle
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import ray
import torch

from tests.helpers import MixedModel, perturb, state_of
from tests.test_ray_e2e import assert_workers_match, get
from weightsync import WeightReceiver, WeightSender, WeightSync
from weightsync.core import registry
from weightsync.core.local import open_local
from weightsync.core.wire import SyncCall, SyncSettings
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.messages import PushAnswer, PushResult, ReceiveResult, SendResult
from weightsync.core.wire.outcome import failed, ok
from weightsync.glue.actors import TrainerHost, WorkerHost
from weightsync.glue.push_parts import PushParts
from weightsync.glue.replies import ReplyRound, on_board
from weightsync.mechanisms.board import ReplyBoard
from weightsync.mechanisms.mailbox import Mailbox


# the call and the mailbox ----------------------------------------------------------------
def test_a_call_names_each_partys_slot_in_its_round_and_refuses_malformed_parts() -> None:
    call = SyncCall(seq=3, version=7, reply=(0, 9), parts=(("trainer", 1), ("w", 2)))
    assert call.part("trainer") == (1, 9) and call.part("w") == (2, 9)
    assert call.part("other") is None
    with pytest.raises(WeightSyncError, match="parts"):
        SyncCall(seq=0, version=1, reply=(0, 1), parts=(("w", -1),))
    with pytest.raises(WeightSyncError, match="parts"):
        SyncCall(seq=0, version=1, reply=(0, 1), parts=[("w", 1)])  # type: ignore[arg-type]
    with pytest.raises(WeightSyncError, match="reply"):
        SyncCall(seq=0, version=1, parts=(("w", 1),))  # no round to name the slot in


def test_a_mailbox_carries_the_workers_slot_with_the_call() -> None:
    mailbox = Mailbox.create()
    try:
        mailbox.post(SyncCall(seq=4, version=11, verify=True), (5, 23))
        posted = mailbox.posted()
        assert posted is not None
        assert (posted.seq, posted.version, posted.verify, posted.force, posted.reply) == (4, 11, True, False, (5, 23))
        mailbox.post(SyncCall(seq=5, version=12, force=True))
        posted = mailbox.posted()
        assert posted is not None and (posted.seq, posted.force, posted.reply) == (5, True, None)
    finally:
        mailbox.control.close()


# building the answer from the parts -------------------------------------------------------
@pytest.fixture
def round_() -> Iterator[ReplyRound]:
    board = ReplyBoard.create(8, 4096)
    yield ReplyRound(board, 3, frozenset({"trainer", "w0", "w1"}), None)
    board.close()


def _post(round_: ReplyRound, key: tuple[str, str], value: Any) -> None:
    slot = round_.slots[key]
    round_.board.post(slot, round_.tag, pickle.dumps((slot, round_.tag, value)))


def _answer(worker: str, version: int = 2) -> PushAnswer:
    result = ReceiveResult(worker=worker, version=version, state="committed")
    return PushAnswer(outcome=ok(worker, "receive", result), version=version, state="committed")


def test_the_answer_is_built_once_every_part_came_and_carries_them(round_: ReplyRound) -> None:
    pushed = round_.call(("trainer", "push"), SyncCall(seq=0, version=2))  # the trainer's own slot first
    parts = PushParts.ask(round_, "trainer", ["w0", "w1"], version=2)
    assert parts is not None
    call = parts.call(pushed)
    assert dict(call.parts) == {"trainer": 1, "w0": 2, "w1": 3} and call.reply == (0, 3)
    sent = ok("trainer", "send", SendResult(seconds=0.5, sent_bytes={"direct": 64}))
    _post(round_, ("trainer", "sent"), sent)
    _post(round_, ("w0", "pushed"), _answer("w0"))
    assert parts.answer() is None  # w1's answer is still missing
    _post(round_, ("w1", "pushed"), _answer("w1"))
    built = parts.answer()
    assert built is not None and built.ok and (built.party, built.phase) == ("trainer", "push")
    result = built.value
    assert isinstance(result, PushResult) and result.ok and result.version == 2
    assert result.sent == sent and result.workers == {"w0": _answer("w0"), "w1": _answer("w1")}


@pytest.mark.parametrize("which", ["a worker", "the send", "too big"])
def test_a_failed_or_unreadable_part_leaves_the_answer_to_the_trainer(round_: ReplyRound, which: str) -> None:
    parts = PushParts.ask(round_, "trainer", ["w0", "w1"], version=2)
    assert parts is not None
    sent = ok("trainer", "send", SendResult())
    if which == "the send":
        sent = failed("trainer", "send", RuntimeError("the copy failed"))
    _post(round_, ("trainer", "sent"), sent)
    worker = _answer("w0")
    if which == "a worker":
        worker = PushAnswer(outcome=failed("w0", "receive", RuntimeError("refused")), version=1, state="committed")
    _post(round_, ("w0", "pushed"), worker)
    if which == "too big":
        round_.board.post(round_.slots[("w1", "pushed")], round_.tag, None)  # did not fit its slot
    else:
        _post(round_, ("w1", "pushed"), _answer("w1"))
    assert parts.answer() is None
    _post(round_, ("w1", "pushed"), _answer("w1"))  # a later post changes nothing: declined for good
    assert parts.answer() is None


def test_no_parts_when_a_party_does_not_answer_on_the_board(round_: ReplyRound) -> None:
    assert PushParts.ask(round_, "trainer", ["w0", "far"], version=1) is None
    assert PushParts.ask(round_, "trainer", [], version=1) is None


# the parties' posts, in one process --------------------------------------------------------
@dataclass
class LocalPush:
    """A trainer and one listening direct worker set up in this process, no Ray."""

    trainer_model: MixedModel
    worker_model: MixedModel
    sender: WeightSender
    receiver: WeightReceiver

    def push(self, call: SyncCall) -> PushResult:
        perturb(self.trainer_model, seed=100 + call.version)  # bits neither model held
        result = registry.mode("push").sync(self.sender, call, "")
        theirs = state_of(self.worker_model)
        for name, tensor in state_of(self.trainer_model).items():
            assert torch.equal(tensor, theirs[name]), name
        return result


@pytest.fixture
def local_push() -> Iterator[LocalPush]:
    trainer_model, worker_model = MixedModel(seed=0), MixedModel(seed=1)
    sender = WeightSender(model=trainer_model)
    manifest = sender.manifest(SyncSettings(timeout_s=30.0))
    receiver = WeightReceiver(worker_model, name="w")
    receiver.accept(manifest, timeout_s=30.0)
    try:
        open_local(registry.get("direct"), sender, {"w": receiver})
        open_local(registry.mode("push"), sender, {"w": receiver})
        yield LocalPush(trainer_model, worker_model, sender, receiver)
    finally:
        receiver.close_transports(abort=True)
        sender.close_transports(abort=True)


@pytest.mark.parametrize("verify", [False, True])
def test_the_trainer_and_a_listener_leave_their_parts_in_the_slots_the_call_names(
    local_push: LocalPush, verify: bool
) -> None:
    told: dict[str, tuple[SyncCall, Any]] = {}
    local_push.sender.answer_early = lambda call, value: told.__setitem__("trainer", (call, value))
    local_push.receiver.answer_early = lambda call, value: told.__setitem__("w", (call, value))
    result = local_push.push(SyncCall(seq=0, version=1, verify=verify, reply=(0, 4), parts=(("trainer", 1), ("w", 2))))
    assert result.ok
    trainer_call, sent = told["trainer"]
    assert trainer_call.reply == (1, 4) and sent == result.sent
    worker_call, answer = told["w"]
    assert worker_call.reply == (2, 4) and isinstance(answer, PushAnswer)
    assert answer.outcome.ok and (answer.version, answer.state) == (1, "committed")
    assert answer.outcome.value == result.workers["w"].outcome.value


class Heard(logging.Handler):
    """Sets :attr:`event` once a record whose message contains ``text`` is logged, from any thread."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.event.set()


def test_a_part_that_cannot_be_left_is_logged_and_the_push_answers_as_before(
    local_push: LocalPush, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(call: SyncCall, value: Any) -> None:
        raise OSError(f"the board of slot {call.reply} is gone")

    local_push.sender.answer_early = local_push.receiver.answer_early = broken
    # The listener's thread leaves its part after its answer, which the push may already have
    # read: the test waits (bounded) for the listener's warning, not for the push.
    listener_warned = Heard("could not leave its answer")
    logging.getLogger("weightsync").addHandler(listener_warned)
    try:
        with caplog.at_level(logging.WARNING, logger="weightsync"):
            result = local_push.push(SyncCall(seq=0, version=3, reply=(0, 1), parts=(("trainer", 1), ("w", 2))))
            listener_warned.event.wait(timeout=30)
    finally:
        logging.getLogger("weightsync").removeHandler(listener_warned)
    assert result.ok and result.workers["w"].version == 3
    warned = [r.getMessage() for r in caplog.records]
    assert any("w could not leave its answer to sync 0 early" in m and "gone" in m for m in warned), warned
    assert any("could not leave its send's outcome early" in m for m in warned), warned


# through Ray ------------------------------------------------------------------------------
class HoldsItsPushAnswer(TrainerHost):
    """A trainer whose push call, once it pushed, keeps its own answer until the test
    releases that version: a coordinator that returned meanwhile read the parts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cond = threading.Condition()
        self._released: set[int] = set()
        self._holding: list[int] = []

    @on_board
    def ws_push(self, call: SyncCall, owner: str = "") -> Any:
        with self._cond:
            self._holding.append(call.version)
        try:
            out = super().ws_push(call, owner)
            with self._cond:  # bounded: a coordinator waiting for this answer fails the test
                self._cond.wait_for(lambda: call.version in self._released, timeout=20)
        finally:
            with self._cond:
                self._holding.remove(call.version)
                self._cond.notify_all()
        return out

    def held(self) -> list[int]:
        """The versions whose push call has not returned."""
        with self._cond:
            return list(self._holding)

    def release(self, version: int) -> None:
        """Let the push of ``version`` return, and wait until it did."""
        with self._cond:
            self._released.add(version)
            self._cond.notify_all()
            self._cond.wait_for(lambda: version not in self._holding, timeout=20)


def test_sync_returns_from_the_parts_while_the_trainer_still_holds_its_answer(actors: Any) -> None:
    trainer = actors.add(
        ray.remote(HoldsItsPushAnswer)
        .options(num_cpus=0, max_concurrency=2)
        .remote(functools.partial(MixedModel, seed=0))
    )
    workers = [
        actors.add(ray.remote(WorkerHost).options(num_cpus=0).remote(functools.partial(MixedModel, seed=i + 1)))
        for i in range(2)
    ]
    with WeightSync(trainer, workers, transport="direct", push=True, timeout_s=60) as ws:
        for version in (1, 2):
            get(trainer.call.remote(perturb, version))
            report = ws.sync(version)
            assert [w.version for w in report.workers] == [version, version]
            assert get(trainer.held.remote()) == [version], "sync() waited for the trainer's own answer"
            assert_workers_match(trainer, workers)
            get(trainer.release.remote(version))
            assert get(trainer.held.remote()) == []
