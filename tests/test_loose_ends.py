"""Messages and teardowns at the edges: a push racing a teardown, a session another
coordinator took over, a trainer rank blamed for its own change, dead workers dropped."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.catalogue import kill_and_wait
from tests.helpers import MixedModel, both_sides
from tests.test_push import parties
from tests.test_ray_e2e import assert_workers_match, get
from weightsync import SyncError, WeightSync
from weightsync.core import registry
from weightsync.core.local import open_local
from weightsync.core.receiver import WeightReceiver
from weightsync.core.sender import WeightSender
from weightsync.core.wire import SettingsError, SyncCall, SyncSettings, TensorSpec
from weightsync.core.wire.errors import PeerAborted, SessionTornDown
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import PushResult
from weightsync.glue.ranks import TrainerRanks
from weightsync.mechanisms.mailbox import Mailbox
from weightsync.transports.direct.handoff import ANNOUNCED
from weightsync.transports.push.messages import PushExport
from weightsync.transports.push.plugin import PUSH, pusher_of
from weightsync.transports.push.pusher import Pusher


def direct_pair(timeout_s: float = 60.0) -> tuple[WeightSender, WeightReceiver, Callable[[], None]]:
    """A trainer and one worker, set up over the direct transport in this process, and a
    check that the worker's weights are still the ones it started with."""
    sender = WeightSender(model=MixedModel(seed=0))
    manifest = sender.manifest(SyncSettings(timeout_s=timeout_s))
    worker_model = MixedModel(seed=1)
    before = {n: t.clone() for n, t in worker_model.state_dict().items()}
    receiver = WeightReceiver(worker_model, name="worker-0")
    receiver.accept(manifest, timeout_s=timeout_s)
    open_local(registry.get("direct"), sender, {"worker-0": receiver})

    def unwritten() -> None:
        for name, tensor in worker_model.state_dict().items():
            assert torch.equal(tensor, before[name]), f"{name} was written after the teardown"

    return sender, receiver, unwritten


@pytest.mark.parametrize("abort", [True, False], ids=["abort", "clean-close"])
@pytest.mark.parametrize("moment", ["before-start", "waiting-for-announcement"])
def test_a_teardown_during_a_push_answers_its_workers_torn_down_never_a_key_error(abort: bool, moment: str) -> None:
    """A reader holds the worker's gate, so the push waits for its announcement; a teardown
    on another thread (as a coordinator's, on a threaded trainer; a failed sync's abort or a
    plain close()) ends it then, not at its deadline: the send fails as torn down, the
    worker is answered with a typed error naming it and the teardown, and the mailboxes go
    only after the push. The teardown lands either after the push posted its call but
    before the send started (its abort words then carry the previous sync's epoch), or
    while the send waits for the worker. A push that waited out its deadline would fail
    as timed out."""
    sender, receiver, unwritten = direct_pair()
    pusher = Pusher(sender.session, "direct")
    pusher.attach([PUSH.action("worker", "listen")(receiver)])
    PUSH.action("worker", "seal")(receiver)
    sender.extras["pusher"] = pusher
    half = sender.halves["direct"]
    reached, torn = threading.Event(), threading.Event()
    if moment == "before-start":
        tear_down = half.tear_down

        def torn_down(by: str) -> None:
            tear_down(by)
            torn.set()

        half.tear_down = torn_down  # type: ignore[method-assign]

        def send(call: SyncCall) -> Any:
            reached.set()  # the call is posted and the worker rung: the send has not started
            assert torn.wait(30), "the teardown never came"
            return sender.send(call)
    else:
        half.on_write = lambda worker: reached.set()  # type: ignore[attr-defined]
        send = sender.send
    results: list[Any] = []

    def push() -> None:
        try:
            results.append(pusher.push(send, SyncCall(seq=0, version=1, targets={"direct": ("worker-0",)})))
        except Exception as exc:  # the test looks at it
            results.append(exc)

    try:
        with receiver.reading():
            thread = threading.Thread(target=push, daemon=True)
            thread.start()
            assert reached.wait(30), "the push never got that far"
            sender.close_transports(abort=abort, by="WeightSync test (close())")
            thread.join(30)
            assert not thread.is_alive()
        (result,) = results
        assert isinstance(result, PushResult), result
        assert result.sent.error == "SessionTornDown", result.sent
        assert "WeightSync test (close())" in result.sent.message and "worker-0" in result.sent.message
        answer = result.workers["worker-0"].outcome
        assert answer.error == "SessionTornDown" and "worker-0" in answer.message and "torn down" in answer.message
        with pytest.raises(SettingsError, match=r"torn down by WeightSync test \(close\(\)\)"):
            pusher_of(sender)
        receiver.close_transports(abort=True)  # the listener ends, having received nothing
        unwritten()
    finally:
        receiver.close_transports(abort=True)
        pusher.close()
        sender.close_transports(abort=True)


def test_a_workers_teardown_while_its_listener_waits_for_the_trainer_ends_that_sync_at_once() -> None:
    """The trainer stalls before writing (a hook holds it); the worker's listener announced
    and waits for the bytes. The worker's own teardown ends that wait then, not at its
    deadline: its answer says it was torn down, the trainer is told the worker abandoned
    the sync, and nothing is written into the worker."""
    sender, receiver, unwritten = direct_pair()
    pusher = Pusher(sender.session, "direct")
    pusher.attach([PUSH.action("worker", "listen")(receiver)])
    PUSH.action("worker", "seal")(receiver)
    control = receiver.active_half._ctl()  # type: ignore[union-attr]
    held = threading.Event()
    release = threading.Event()

    def stall(worker: str) -> None:
        held.set()
        release.wait(60)

    sender.halves["direct"].on_write = stall  # type: ignore[attr-defined]
    results: list[Any] = []

    def push() -> None:
        try:
            results.append(pusher.push(sender.send, SyncCall(seq=0, version=1, targets={"direct": ("worker-0",)})))
        except Exception as exc:  # the test looks at it
            results.append(exc)

    thread = threading.Thread(target=push, daemon=True)
    try:
        thread.start()
        assert held.wait(30), "the push never reached its write"
        deadline = time.monotonic() + 30
        while control[ANNOUNCED] != 1:  # the worker announced sync 0: it waits for the bytes
            assert time.monotonic() < deadline, "the worker never announced the push"
            time.sleep(0.005)
        receiver.close_transports(abort=True)
        release.set()
        thread.join(30)
        assert not thread.is_alive()
        (result,) = results
        assert isinstance(result, PushResult), result
        answer = result.workers["worker-0"].outcome
        assert answer.error == "SessionTornDown" and "worker-0's teardown" in answer.message, answer
        assert result.sent.error == "PeerAborted" and "worker-0" in result.sent.message, result.sent
        unwritten()
    finally:
        release.set()
        receiver.close_transports(abort=True)
        pusher.close()
        sender.close_transports(abort=True)


@pytest.mark.parametrize("side", ["trainer", "worker"])
def test_a_sync_starting_after_one_sides_teardown_fails_there_at_once_and_its_peer_too(side: str) -> None:
    """The teardown's abort words carry the previous sync's epoch; the next sync's start
    writes them again, so the torn-down side fails at once as torn down and its peer, which
    would otherwise wait for the other until its deadline, is told that side gave up."""
    sender, receiver, unwritten = direct_pair()
    call = SyncCall(seq=0, version=1, targets={"direct": ("worker-0",)})
    torn_down: Any
    if side == "trainer":
        torn_down, by, names = (
            sender.halves["direct"],
            "WeightSync test (close())",
            r"WeightSync test \(close\(\)\).*worker-0",
        )
        first, then, peer = sender.send, receiver.receive, "trainer"
    else:
        torn_down, by, names = receiver.active_half, "worker-0's teardown", "worker-0's teardown"
        first, then, peer = receiver.receive, sender.send, "worker-0"
    try:
        torn_down.tear_down(by)
        with pytest.raises(SessionTornDown, match=names):
            first(call)
        with pytest.raises(PeerAborted, match=peer):
            then(call)
        unwritten()
    finally:
        receiver.close_transports(abort=True)
        sender.close_transports(abort=True)


def test_a_push_on_a_session_without_push_mode_or_torn_down_says_which() -> None:
    sender = WeightSender(model=MixedModel(seed=0))
    sender.manifest(SyncSettings(), owner="WeightSync bbbb")
    assert not PUSH.armed(sender)  # type: ignore[misc]
    with pytest.raises(SettingsError, match="without push=True"):
        pusher_of(sender)
    mailbox = Mailbox.create()
    try:
        export = PushExport(
            worker="w", mailbox=mailbox.handle(), doorbell="\0weightsync-nobody", doorbell_key=bytes(16), pid=1
        )
        PUSH.action("trainer", "arm")(sender, (export,))
        assert PUSH.armed(sender)  # type: ignore[misc]
        sender.close_transports(by="WeightSync bbbb (close())")
        assert not PUSH.armed(sender)  # type: ignore[misc]
        with pytest.raises(SettingsError, match="torn down by WeightSync bbbb \\(close\\(\\)\\)"):
            pusher_of(sender)
    finally:
        mailbox.control.close()


def test_a_changed_rank_0_is_blamed_not_the_ranks_that_agree() -> None:
    names = ["trainer-rank-0", "trainer-rank-1", "trainer-rank-2"]
    ranks = TrainerRanks([object(), object(), object()])
    same = [TensorSpec(name="w", shape=(4,), dtype="float32")]
    changed = [*same, TensorSpec(name="extra", shape=(3,), dtype="float32")]
    build = lambda specs: Manifest.build(specs, buffer_bytes=1024, num_buffers=2)  # noqa: E731
    blamed = ranks.disagreeing(dict(zip(names, [build(changed), build(same), build(same)])))
    assert sorted(blamed) == ["trainer-rank-0"]
    assert "extra" in blamed["trainer-rank-0"].message
    assert sorted(ranks.disagreeing(dict(zip(names, [build(same), build(changed), build(same)])))) == ["trainer-rank-1"]
    # Two ranks: nobody can tell which one changed; both are named.
    two = TrainerRanks([object(), object()])
    both = two.disagreeing(dict(zip(names, [build(changed), build(same)])))
    assert sorted(both) == names[:2] and all("extra" in o.message for o in both.values())


def test_workers_found_dead_are_dropped_and_the_next_sync_goes_on(actors: Any) -> None:
    """Found dead by an in-trainer push, or dead between two syncs: the next sync names the
    worker, says it was dropped, and the one after runs without it (never every sync)."""
    trainer, workers = parties(actors, n=3)
    with WeightSync(trainer, workers, transport="direct", push=True, timeout_s=20) as ws:
        ws.sync(version=1)
        kill_and_wait(get(workers[2].pid.remote()))
        with pytest.raises(Exception, match="worker-2") as pushed:
            get(trainer.train_and_push.remote(2))
        assert "next WeightSync.sync() or setup() drops" in str(pushed.value)
        with pytest.raises(Exception, match="dropped dead worker\\(s\\) worker-2"):
            ws.sync(version=3)
        ws.sync(version=4)
        assert sorted(ws.workers) == ["worker-0", "worker-1"]
        kill_and_wait(get(workers[1].pid.remote()))  # dead between syncs
        with pytest.raises(SyncError, match="dropped dead worker\\(s\\) worker-1") as between:
            ws.sync(version=5)
        assert between.value.dead == ["worker-1"]
        ws.sync(version=6)
        assert sorted(ws.workers) == ["worker-0"]
        assert_workers_match(trainer, workers[:1])
        # Another WeightSync (without push) takes worker-0 over: this one's push session on the
        # trainer stays, its next push finds worker-0's listener gone and names it, and the
        # sync after sets worker-0 up again.
        other = WeightSync(trainer, {"w0": workers[0]}, transport="direct", timeout_s=20)
        other.setup()
        with pytest.raises(SyncError) as taken:
            ws.sync(version=7)
        assert taken.value.culprits == ["worker-0"], str(taken.value)
        other.close()
        ws.sync(version=8)
        assert_workers_match(trainer, workers[:1])


def test_an_abort_of_a_failed_sync_does_not_fail_the_next_one_in_the_session() -> None:
    """A direct session goes on after a refused sync (its counters follow the sync's seq):
    the abort word that sync left is stale for the next one, which moves every byte."""
    trainer, worker = MixedModel(seed=0), MixedModel(seed=1)
    sender = WeightSender(model=trainer)
    manifest = sender.manifest(SyncSettings(timeout_s=20.0))
    receiver = WeightReceiver(worker, name="w")
    receiver.accept(manifest, timeout_s=20.0)
    open_local(registry.get("direct"), sender, {"w": receiver})

    try:
        assert not isinstance(both_sides(sender, receiver, SyncCall(seq=0, version=5))[1], Exception)
        # Older than what the worker holds: refused, and the trainer aborted.
        sent, got = both_sides(sender, receiver, SyncCall(seq=1, version=3))
        assert type(got).__name__ == "VersionError" and type(sent).__name__ == "PeerAborted"
        sent, got = both_sides(sender, receiver, SyncCall(seq=2, version=6))
        assert not isinstance(sent, Exception) and not isinstance(got, Exception), (sent, got)
        assert receiver.status() == (6, "committed")
        from tests.helpers import assert_bit_equal
        from weightsync.core.sinks import module_tensors

        want = dict(module_tensors(trainer))
        for name, tensor in module_tensors(worker):
            assert_bit_equal(tensor, want[name], name)
    finally:
        receiver.close_transports()
        sender.close_transports()


class _Half:
    def __init__(self, kind: str, fails: bool) -> None:
        self.kind, self.fails, self.aborted = kind, fails, False

    def abort(self) -> None:
        self.aborted = True
        if self.fails:
            raise OSError(f"{self.kind}: the control block is gone")


def test_an_abort_that_fails_neither_masks_the_cause_nor_skips_the_other_halves() -> None:
    from weightsync.core.halves import abort_each

    halves = [_Half("ipc", True), _Half("direct", False)]
    cause = TimeoutError("worker-3 did not answer")
    abort_each(halves, cause)  # the cause stays the error its caller raises
    assert all(h.aborted for h in halves)
    if sys.version_info >= (3, 11):
        assert any("ipc" in note for note in cause.__notes__)
    halves = [_Half("ipc", True), _Half("direct", False)]
    with pytest.raises(OSError, match="ipc"):
        abort_each(halves, None)  # no cause: the abort's own failure is the error
    assert all(h.aborted for h in halves)


class _Interrupted(_Half):
    def abort(self) -> None:
        self.aborted = True
        raise KeyboardInterrupt


def test_an_interrupt_in_one_halfs_abort_lets_the_others_abort_then_propagates() -> None:
    from weightsync.core.halves import abort_each

    halves = [_Interrupted("ipc", False), _Half("gloo", True), _Half("direct", False)]
    cause = TimeoutError("worker-3 did not answer")
    with pytest.raises(KeyboardInterrupt) as info:
        abort_each(halves, cause)
    assert all(h.aborted for h in halves)
    assert info.value.__context__ is cause  # what was failing stays in the traceback
    halves = [_Interrupted("ipc", False), _Half("direct", True)]
    with pytest.raises(KeyboardInterrupt):  # the interrupt wins over an abort's own error
        abort_each(halves, None)
    assert all(h.aborted for h in halves)


def test_a_worker_whose_abort_is_interrupted_midway_through_a_sync_is_still_marked_dirty() -> None:
    """The receive fails after bytes began to land; the abort that tells the trainer is
    interrupted: the interrupt propagates, and the worker says its weights are a mix."""
    sender = WeightSender(model=MixedModel(seed=0))
    manifest = sender.manifest(SyncSettings(timeout_s=20.0))
    receiver = WeightReceiver(MixedModel(seed=1), name="w")
    receiver.accept(manifest, timeout_s=20.0)
    open_local(registry.get("direct"), sender, {"w": receiver})
    half: Any = receiver.active_half
    real_abort = half.abort

    def receive(sink: Any, call: SyncCall, begin: Any) -> Any:
        begin()  # the worker's tensors are being written from here
        raise RuntimeError("the transfer broke midway")

    def abort() -> None:
        real_abort()
        raise KeyboardInterrupt

    half.receive, half.abort = receive, abort
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            receiver.receive(SyncCall(seq=0, version=1))
        assert "midway" in str(info.value.__context__)
        assert receiver.status() == (None, "dirty")
        assert half._control.aborted_by == half._code  # the trainer was told before the interrupt
    finally:
        half.abort = real_abort
        receiver.close_transports()
        sender.close_transports()
