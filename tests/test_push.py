"""Push mode: direct workers listen, so a sync is one Ray call to the trainer, or none.

The same checks, state machine and failures-as-data as a Ray-called direct sync, with the
worker's side run by its listener thread (weightsync/transports/push/listener.py) and the trainer's by
weightsync/transports/push/pusher.py.
"""

from __future__ import annotations

import functools
import os
import signal
from typing import Any

import pytest
import ray
import torch

from tests.catalogue import kill_and_wait, stop_and_wait
from tests.helpers import MixedModel, perturb, state_of
from tests.test_ray_e2e import LoadingMixedModel, assert_workers_match, get
from weightsync import SettingsError, SetupError, Status, SyncError, WeightReceiver, WeightSender, WeightSync
from weightsync.core import registry
from weightsync.core.local import open_local
from weightsync.core.wire import PeerAborted, SyncCall, SyncSettings, TransferTimeout
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.messages import PushAnswer, PushResult, SendResult
from weightsync.core.wire.outcome import failed, ok
from weightsync.glue.actors import TrainerHost, WorkerHost
from weightsync.mechanisms.doorbell import Bell
from weightsync.mechanisms.mailbox import Mailbox
from weightsync.transports.push.messages import PushExport
from weightsync.transports.push.plugin import PUSH
from weightsync.transports.push.pusher import Pusher


class PushingTrainer(TrainerHost):
    def train_and_push(self, step: int, force: bool = False) -> PushResult:
        """One "training step" (new random weights) and the push, in one call."""
        perturb(self.model, seed=100 + step)
        return self.weightsync_push(version=step, force=force)

    def perturb(self, seed: int) -> None:
        perturb(self.model, seed=seed)


def parties(actors: Any, n: int = 2, sink: str = "module") -> tuple[Any, list[Any]]:
    trainer = actors.add(ray.remote(PushingTrainer).options(num_cpus=0).remote(functools.partial(MixedModel, seed=0)))
    workers = [
        actors.add(
            ray.remote(WorkerHost).options(num_cpus=0).remote(functools.partial(MixedModel, seed=i + 1), sink=sink)
        )
        for i in range(n)
    ]
    return trainer, workers


def test_push_syncs_are_bit_exact_from_the_coordinator_and_from_inside_the_trainer(actors: Any) -> None:
    trainer, workers = parties(actors)
    with WeightSync(trainer, workers, transport="direct", push=True, timeout_s=30) as ws:
        for step in range(3):
            get(trainer.perturb.remote(step))
            report = ws.sync(version=step, verify=step == 1)
            assert report.transports == {"direct": 2}
            assert_workers_match(trainer, workers)
            assert [get(w.version.remote()) for w in workers] == [(step, "committed")] * 2
        for step in range(3, 6):
            result = get(trainer.train_and_push.remote(step))
            assert result.ok and sorted(result.workers) == ["worker-0", "worker-1"]
            assert {a.version for a in result.workers.values()} == {step}
            assert_workers_match(trainer, workers)
        assert ws.status() == {"worker-0": (5, "committed"), "worker-1": (5, "committed")}
        ws.verify()
        # The coordinator's own sync after pushes from the trainer continues the sequence.
        get(trainer.perturb.remote(99))
        ws.sync(version=6)
        assert_workers_match(trainer, workers)


def test_a_refused_push_names_the_worker_and_the_next_sync_sets_up_again(actors: Any) -> None:
    trainer, workers = parties(actors)
    with WeightSync(trainer, workers, transport="direct", push=True, timeout_s=30) as ws:
        ws.sync(version=5)
        with pytest.raises(SyncError) as failure:
            get(trainer.train_and_push.remote(3))  # older than what the workers hold
        assert failure.value.culprits == ["worker-0", "worker-1"]
        assert all(failure.value.outcomes[w].error == "VersionError" for w in ("worker-0", "worker-1"))
        assert failure.value.held == {"worker-0": (5, "committed"), "worker-1": (5, "committed")}
        with pytest.raises(ray.exceptions.RayTaskError, match="setup"):
            get(trainer.train_and_push.remote(6))
        # The coordinator notices the failed session and sets up again by itself.
        get(trainer.perturb.remote(7))
        ws.sync(version=7)
        assert_workers_match(trainer, workers)
        assert ws.status() == {"worker-0": (7, "committed"), "worker-1": (7, "committed")}


def test_a_push_to_a_killed_worker_names_it_dead_and_the_others_go_on(actors: Any) -> None:
    trainer, workers = parties(actors)
    with WeightSync(trainer, workers, transport="direct", push=True, timeout_s=30) as ws:
        ws.sync(version=1)
        kill_and_wait(get(workers[1].pid.remote()))
        get(trainer.perturb.remote(2))
        with pytest.raises(SyncError) as failure:
            ws.sync(version=2)
        assert failure.value.dead == ["worker-1"]
        assert "worker-1" in failure.value.culprits
        assert failure.value.outcomes["worker-1"].status is Status.DEAD
        ws.sync(version=3)
        assert_workers_match(trainer, workers[:1])


def test_a_frozen_listening_worker_is_named_timed_out(actors: Any) -> None:
    trainer, workers = parties(actors, n=1)
    pid = get(workers[0].pid.remote())
    with WeightSync(trainer, workers, transport="direct", push=True, timeout_s=3) as ws:
        ws.sync(version=1)
        stop_and_wait(pid)
        try:
            with pytest.raises(SyncError) as failure:
                ws.sync(version=2)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert failure.value.culprits == ["worker-0"]
        assert failure.value.outcomes["worker-0"].status is Status.TIMED_OUT
        ws.sync(version=3)
        assert_workers_match(trainer, workers)


def test_an_in_trainer_push_names_a_worker_whose_tensors_moved_and_sync_repairs_it(actors: Any) -> None:
    """A reload gave a worker's tensor new storage: the push writes nothing there and says
    so by name (never a silent success); the coordinator's sync exports it again."""
    from tests.test_direct import Worker as MovingWorker

    trainer = actors.add(ray.remote(PushingTrainer).options(num_cpus=0).remote(functools.partial(MixedModel, seed=0)))
    worker = actors.add(ray.remote(MovingWorker).options(num_cpus=0).remote(functools.partial(MixedModel, seed=1)))
    with WeightSync(trainer, [worker], transport="direct", push=True, timeout_s=30) as ws:
        ws.sync(version=1)
        name = next(n for n in ws.manifest.names if n.endswith("weight"))  # type: ignore[union-attr]
        old = get(worker.move_storage.remote(name, False, 7))
        with pytest.raises(SyncError) as failure:
            get(trainer.train_and_push.remote(2))
        assert failure.value.culprits == ["worker-0"] and name in str(failure.value)
        assert failure.value.held == {"worker-0": (1, "committed")}
        assert get(worker.old_values.remote()) == old  # the stale storage was never written
        ws.sync(version=3)
        assert_workers_match(trainer, [worker])


def test_push_mode_refuses_a_worker_that_cannot_take_direct_writes(actors: Any) -> None:
    trainer, workers = parties(actors, n=2)
    loader = actors.add(
        ray.remote(WorkerHost)
        .options(num_cpus=0)
        .remote(functools.partial(LoadingMixedModel, seed=5), sink="load_weights")
    )
    ws = WeightSync(trainer, {"fine": workers[0], "loader": loader}, push=True, timeout_s=30)
    with pytest.raises(SetupError) as failure:
        ws.setup()
    assert failure.value.culprits == ["loader"]
    assert "direct" in str(failure.value)
    ws.close()
    # The failed setup reached the trainer (its manifest) but opened no push session: a push
    # from inside the trainer says so, and not that a session "was torn down".
    with pytest.raises(ray.exceptions.RayTaskError) as pushed:
        get(trainer.train_and_push.remote(1))
    said = str(pushed.value.cause)
    assert isinstance(pushed.value.cause, SettingsError), said
    assert "no push-mode session is open" in said and "torn down" not in said, said


def test_a_push_result_reads_as_one_line() -> None:
    answers = {
        "w1": PushAnswer(outcome=ok("w1", "receive"), version=3, state="committed"),
        "w0": PushAnswer(
            outcome=failed("w0", "receive", WeightSyncError("w0: the bytes did not land")), version=2, state="dirty"
        ),
    }
    result = PushResult(version=3, sent=ok("trainer", "send", SendResult()), workers=answers, seconds=0.0125)
    assert result.summary() == (
        "push of version 3 FAILED in 12.5 ms to 2 worker(s) (w0 dirty@2, w1 committed@3); "
        "w0 (receive): WeightSyncError: w0: the bytes did not land"
    )
    assert repr(result) == f"PushResult({result.summary()})" and "Outcome(" not in repr(result)
    fine = PushResult(version=4, sent=ok("trainer", "send"), workers={"w1": answers["w1"]}, seconds=0.002)
    assert fine.summary() == "push of version 4 ok in 2.0 ms to 1 worker(s) (w1 committed@3)"
    skipped = PushResult(version=5, sent=ok("trainer", "send"), workers={}, setup_needed=True)
    assert "not run" in skipped.summary() and "setup()" in skipped.summary()


def test_push_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="push"):
        WeightSync(object(), [object()], push="yes")  # type: ignore[arg-type]


def test_a_reader_holding_the_gate_keeps_a_push_from_writing(tmp_path: Any) -> None:
    """In one process, no Ray: while code reading the weights holds the receiver's gate, a
    push cannot write; it times out naming the worker, and the weights stay as they were."""
    import threading
    import time

    from tests.helpers import state_of
    from weightsync.core import registry
    from weightsync.core.local import open_local
    from weightsync.core.receiver import WeightReceiver
    from weightsync.core.sender import WeightSender
    from weightsync.core.wire import SyncSettings
    from weightsync.core.wire.messages import SyncCall
    from weightsync.mechanisms.mailbox import ANSWERED

    trainer_model, worker_model = MixedModel(seed=0), MixedModel(seed=1)
    sender = WeightSender(model=trainer_model)
    manifest = sender.manifest(SyncSettings(timeout_s=1.0))
    receiver = WeightReceiver(worker_model, name="reader")
    receiver.accept(manifest, timeout_s=1.0)
    open_local(registry.get("direct"), sender, {"reader": receiver})
    pusher = Pusher(sender.session, "direct")
    pusher.attach([PUSH.action("worker", "listen")(receiver)])
    PUSH.action("worker", "seal")(receiver)
    before = {n: t.clone() for n, t in state_of(worker_model).items()}
    results: list[PushResult] = []
    try:
        with receiver.reading():
            thread = threading.Thread(
                target=lambda: results.append(
                    pusher.push(sender.send, SyncCall(seq=0, version=1, targets={"direct": ("reader",)}))
                )
            )
            thread.start()
            thread.join(30)
            assert not thread.is_alive()
            after = state_of(worker_model)
            assert all(torch.equal(after[n], before[n]) for n in before)
        (result,) = results
        assert not result.ok
        assert result.workers["reader"].outcome.status is Status.TIMED_OUT
        assert result.sent.blames == ("reader",)
        # Once the reader lets go, the late listener finds the sync abandoned and says so,
        # writing nothing (bounded wait for its answer in the mailbox).
        listener = receiver.listener
        assert listener is not None
        control = listener.mailbox.control
        deadline = time.monotonic() + 30
        while control[ANSWERED] != 1:
            assert time.monotonic() < deadline, "the listener never answered the abandoned sync"
            time.sleep(0.01)
        late = listener.mailbox.answer()
        assert late.outcome.error == "PeerAborted" and late.state == "committed"
    finally:
        receiver.close_transports(abort=True)
        pusher.close()
        sender.close_transports(abort=True)
    after = state_of(worker_model)
    assert all(torch.equal(after[n], before[n]) for n in before)
    assert receiver.status() == (None, "committed")


def test_a_ring_that_fails_withdraws_the_call_and_a_late_listener_writes_nothing(monkeypatch: Any) -> None:
    """A worker's ring times out (its listener stalled, its doorbell's queue full): the push
    answers it failed and withdraws the call, so a listener that wakes later finds nothing
    posted; one that had read the call already fails it at once, before touching the
    weights, instead of holding reads until its deadline and ending dirty."""
    trainer_model, worker_model = MixedModel(seed=0), MixedModel(seed=1)
    sender = WeightSender(model=trainer_model)
    manifest = sender.manifest(SyncSettings(timeout_s=30.0))
    receiver = WeightReceiver(worker_model, name="w")
    receiver.accept(manifest, timeout_s=30.0)
    open_local(registry.get("direct"), sender, {"w": receiver})
    # The worker's mailbox, with no listener thread: the test plays the listener.
    mailbox = Mailbox.create()
    export = PushExport(
        worker="w",
        mailbox=mailbox.handle(),
        doorbell="\0weightsync-nobody",
        doorbell_key=os.urandom(16),
        pid=os.getpid(),
    )
    push = registry.mode("push")
    push.action("trainer", "arm")(sender, (export,))

    def full(bell: Bell, deadline: float) -> bool:
        raise TransferTimeout(f"{bell.who}: its doorbell's queue stayed full until the deadline", blames=[bell.who])

    monkeypatch.setattr(Bell, "ring", full)
    before = {n: t.clone() for n, t in state_of(worker_model).items()}
    try:
        result = push.sync(sender, SyncCall(seq=0, version=1), "")
        unwoken = result.workers["w"].outcome
        assert not result.ok and unwoken.status is Status.TIMED_OUT and "doorbell" in unwoken.message
        assert mailbox.posted() is None, "the call the trainer gave up on is still posted"
        # A listener that read the call before it was withdrawn runs it: refused before any byte.
        with pytest.raises(PeerAborted):
            receiver.receive(SyncCall(seq=0, version=1))
        assert receiver.status() == (None, "committed")
        after = state_of(worker_model)
        assert all(torch.equal(after[n], before[n]) for n in before)
    finally:
        receiver.close_transports(abort=True)
        sender.close_transports(abort=True)
        mailbox.control.close()
