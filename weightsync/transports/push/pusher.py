"""Push mode's trainer side: start a direct sync without a Ray call to any worker.

A colocated direct sync is one copy of the model plus, with a Ray call per party, about a
millisecond of Ray starting and returning the calls. In push mode the direct workers
listen (:mod:`weightsync.transports.push.listener`), so a sync is one call into the trainer (from
``WeightSync.sync``), or none at all: ``TrainerMixin.weightsync_push(version)`` syncs from
inside the trainer's own method, for a loop that trains and pushes in one call. Per push::

    Pusher.push(send, call)
      post the call in every listening worker's mailbox, ring each doorbell
      send(call)                  the direct half: wait for each announcement, copy, "written"
      tell(call, sent)            when the call names this party a part (``SyncCall.parts``):
                                  the coordinator builds the answer from the parts' posts
      collect each worker's PushAnswer (its outcome, version and state), by the deadline
    -> PushResult                 failures as data, as from Ray calls

The trainer names a worker whose process ended as dead and one that never answered as
timed out, exactly as the coordinator does for Ray calls, so blame and settling work the
same way; a worker whose listener is gone (its doorbell refuses, its mailbox says it
stopped) is answered at once, not at the deadline. A failing side aborts its own transport;
after a failed push this pusher answers ``setup_needed`` until ``WeightSync.setup()``
(``WeightSync.sync`` does that itself).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from weightsync.core.wire.errors import SessionTornDown, TransferTimeout, WeightSyncError
from weightsync.core.wire.messages import PushAnswer, PushResult, SendResult, SyncCall
from weightsync.core.wire.outcome import Outcome, Status, failed, ok
from weightsync.core.wire.session import Session
from weightsync.mechanisms.doorbell import Bell
from weightsync.mechanisms.mailbox import ANSWERED, Mailbox
from weightsync.mechanisms.regions import RegionImporter
from weightsync.mechanisms.shm import pid_alive
from weightsync.transports.push.messages import PushExport

log = logging.getLogger("weightsync")


@dataclass
class _Box:
    export: PushExport
    mailbox: Mailbox
    importer: RegionImporter
    bell: Bell


class Pusher:
    """The trainer's mailboxes of the listening workers, and the push sequence."""

    def __init__(self, session: Session, kind: str) -> None:
        self.deadlines = session.deadlines
        self.name = session.party
        self.kind = kind  # the transport whose halves a push drives
        self._boxes: dict[str, _Box] = {}
        self.seq = 0
        self.broken = False
        # A push holds the lock; a teardown from another thread sets ``closing`` (the push
        # stops waiting for answers) and releases the mailboxes only once the push ended.
        self._lock = threading.RLock()
        self.closing = False

    @property
    def workers(self) -> tuple[str, ...]:
        return tuple(self._boxes)

    def attach(self, exports: Sequence[PushExport]) -> None:
        for export in exports:
            self.forget(export.worker)
            importer = RegionImporter(f"{self.name}->{export.worker} mailbox")
            mailbox = Mailbox.attach(importer.map(export.mailbox), self.name, export.mailbox.path)
            bell = Bell(export.doorbell, export.doorbell_key, export.worker)
            self._boxes[export.worker] = _Box(export, mailbox, importer, bell)

    def push(
        self,
        send: Callable[[SyncCall], SendResult],
        call: SyncCall,
        abandon: Callable[[str, int], None] | None = None,
        tell: Callable[[SyncCall, Outcome], None] | None = None,
    ) -> PushResult:
        """Run one sync of the listening workers ``call.to(kind)`` (all of them when none are
        named; its seq is this pusher's); failures come back as data. ``abandon(worker, seq)``
        (the transport's) tells a worker's half that this side gives up on it in sync ``seq``
        before writing anything: a listener that read a call withdrawn from its mailbox then
        fails it at once, before touching the weights. ``tell(call, sent)`` leaves the send's
        outcome in the slot ``call.reply`` names, when ``call.parts`` gives this party one."""
        with self._lock:
            if self.closing:
                raise SessionTornDown(
                    f"{self.name}: push of version {call.version} to {list(call.to(self.kind) or self.workers)}: "
                    "the push session was torn down (close(), a new setup, a failed sync or remove_worker()) "
                    "before this push started; run WeightSync.setup() from the driver"
                )
            return self._push(send, call, abandon, tell)

    def _push(
        self,
        send: Callable[[SyncCall], SendResult],
        call: SyncCall,
        abandon: Callable[[str, int], None] | None,
        tell: Callable[[SyncCall, Outcome], None] | None,
    ) -> PushResult:
        start = time.perf_counter()
        deadline = self.deadlines.follower(time.monotonic())
        if self.broken:
            return PushResult(
                version=call.version, sent=ok(self.name, "send", SendResult()), workers={}, setup_needed=True
            )
        targets = call.to(self.kind) or self.workers
        unknown = [w for w in targets if w not in self._boxes]
        if unknown or not targets:
            raise WeightSyncError(
                f"{self.name}: push to {list(targets)}, listening workers are {list(self._boxes)}; "
                f"push mode needs every worker on the {self.kind} transport (run setup() after adding one)"
            )
        call = replace(call, seq=self.seq, targets={self.kind: targets})
        self.seq += 1
        answers: dict[str, PushAnswer] = {}
        for worker in targets:
            box = self._boxes[worker]
            if not box.mailbox.stopped:
                replaced = box.mailbox.post(call, call.part(worker))
                try:
                    if box.bell.ring(deadline):
                        continue
                except TransferTimeout as exc:
                    # Nobody woke it: the call is taken back, so its listener, once it runs
                    # again, finds no sync to hold its weights for (this push gave up on it).
                    box.mailbox.withdraw(call.seq, replaced)
                    if abandon is not None:
                        abandon(worker, call.seq)
                    # Silent, as a frozen worker is: the coordinator asks it nothing more (a
                    # settle or teardown would wait another deadline for it).
                    answers[worker] = PushAnswer(outcome=_unwoken(worker, exc), version=None, state="unknown")
                    continue
            if not pid_alive(box.export.pid):
                answers[worker] = PushAnswer(outcome=_lost(worker, Status.DEAD), version=None, state="unknown")
                continue
            why = WeightSyncError(f"{worker}: its listener is gone (nobody answers its doorbell); run setup() again")
            answers[worker] = PushAnswer(outcome=failed(worker, "receive", why), version=None, state="unknown")
        live = tuple(w for w in targets if w not in answers)
        try:
            try:
                sent = ok(self.name, "send", send(replace(call, targets={self.kind: live})) if live else SendResult())
            except Exception as exc:  # noqa: BLE001 - travels as data, with the workers' answers
                sent = failed(self.name, "send", exc)
            self._tell(tell, call, sent)
            for worker in live:
                answers[worker] = self._collect(worker, call.seq, deadline)
            result = PushResult(version=call.version, sent=sent, workers=answers, seconds=time.perf_counter() - start)
        finally:
            # Anything short of a clean result leaves the transports to a new setup.
            self.broken = True
        self.broken = not result.ok
        return result

    def _tell(self, tell: Callable[[SyncCall, Outcome], None] | None, call: SyncCall, sent: Outcome) -> None:
        part = call.part(self.name)
        if tell is None or part is None:
            return
        try:
            tell(replace(call, reply=part, parts=()), sent)
        except Exception as exc:  # noqa: BLE001 - the coordinator reads this push's whole answer instead
            log.warning("weightsync: %s could not leave its send's outcome early: %r", self.name, exc)

    def _collect(self, worker: str, seq: int, deadline: float) -> PushAnswer:
        """``worker``'s answer to push ``seq``; its death, silence or lost listener as data."""
        box = self._boxes[worker]
        mailbox = box.mailbox
        control = mailbox.control
        try:
            control.wait(
                lambda: control[ANSWERED] == seq + 1 or mailbox.stopped or self.closing,
                deadline,
                self.name,
                lambda: f"{worker}'s answer to push {seq}",
                [self.name, worker],
                peer_pid=lambda: box.export.pid,
                late=lambda: [worker],
            )
            if control[ANSWERED] != seq + 1 and self.closing:
                raise SessionTornDown(
                    f"{worker}: the push session was torn down by a teardown running meanwhile, before "
                    f"{worker} answered push {seq}; its state is unknown until the next setup"
                )
            if control[ANSWERED] != seq + 1:
                raise WeightSyncError(f"{worker}: its listener ended before answering push {seq}")
            return mailbox.answer()
        except TransferTimeout:
            return PushAnswer(outcome=_lost(worker, Status.TIMED_OUT), version=None, state="unknown")
        except Exception as exc:  # noqa: BLE001 - this worker's failure, as data; the others' answers stand
            if not pid_alive(box.export.pid):
                return PushAnswer(outcome=_lost(worker, Status.DEAD), version=None, state="unknown")
            return PushAnswer(outcome=failed(worker, "receive", exc), version=None, state="unknown")

    def forget(self, worker: str) -> None:
        with self._lock:
            box = self._boxes.pop(worker, None)
            if box is not None:
                box.bell.close()
                box.importer.release_all()

    def stop(self) -> bool:
        """Refuse every later push; True when one is in flight on another thread (it ends
        once the halves it drives are torn down, :meth:`WeightSender.close_transports`)."""
        self.closing = True
        # A push checks ``closing`` under the lock: a lock this thread can take means no
        # other thread runs one or will (the lock is re-entrant: on the push's own thread,
        # as from a hook inside it, this says False).
        if self._lock.acquire(blocking=False):
            self._lock.release()
            return False
        return True

    def close(self) -> None:
        """Release the mailboxes; a push in flight on another thread stops waiting for answers
        and ends first (its workers answered as torn down), never reading released memory."""
        self.closing = True
        with self._lock:
            for worker in list(self._boxes):
                self.forget(worker)


def _lost(worker: str, status: Status) -> Outcome:
    return Outcome(party=worker, phase="receive", status=status)


def _unwoken(worker: str, exc: TransferTimeout) -> Outcome:
    """``worker`` could not be woken by the deadline (its doorbell's queue stayed full)."""
    return Outcome(party=worker, phase="receive", status=Status.TIMED_OUT, error=type(exc).__name__, message=str(exc))
