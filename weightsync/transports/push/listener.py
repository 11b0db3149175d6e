"""A direct worker's listener thread: push mode's receiving side.

In push mode (``WeightSync(..., push=True)``) a sync costs no Ray call on the worker: its
listener sleeps on a doorbell and, when the trainer rings, runs the worker's usual
``receive`` (the same state machine, checks and deadlines as a Ray-called sync) and leaves
its answer in the mailbox. The worker's weights are written while the listener holds the
receiver's gate; code that reads them holds it too (``WorkerActor.call`` does; a
:class:`~weightsync.glue.actors.WorkerMixin` actor uses ``weightsync_reading()``), so weights
are never read while they are written. Life of one listener::

    push's "listen" action: WeightReceiver.listen(make a Listener) -> PushExport
                              (mailbox + doorbell; the thread starts)
    trainer attaches the mailbox; push's "seal" action unlinks its name
    per push: ring -> posted() -> receive_pushed(call) under the gate
              -> reply(seq, PushAnswer) to the trainer, then tell(call, PushAnswer) when the
                 call names a slot on the coordinator's reply board (``SyncCall.parts``)
    WeightReceiver.close_transports() -> Listener.close()  (stops and joins the thread)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from weightsync.core.wire.errors import TransferTimeout, WeightSyncError
from weightsync.core.wire.messages import PushAnswer, ReceiveResult, SyncCall
from weightsync.core.wire.outcome import failed, ok
from weightsync.mechanisms.doorbell import Doorbell, ring
from weightsync.mechanisms.mailbox import STOP, Mailbox
from weightsync.transports.push.messages import PushExport

log = logging.getLogger("weightsync")
#: How long the listener sleeps between checks that it should stop.
_IDLE_S = 0.25


class Listener:
    """Runs ``receive(call)`` under ``gate`` for every sync the trainer posts."""

    def __init__(
        self,
        name: str,
        device: torch.device,
        receive: Callable[[SyncCall], ReceiveResult],
        status: Callable[[], tuple[int | None, str]],
        gate: threading.RLock,
        tell: Callable[[SyncCall, PushAnswer], None] | None = None,
    ) -> None:
        self.name = name
        #: Leaves an answer in the slot its call names (the glue's reply board).
        self._tell = tell
        self.device = device
        self._receive = receive
        self._status = status
        self._gate = gate
        self.mailbox = Mailbox.create()
        self.doorbell = Doorbell()
        self._stop = threading.Event()
        self.busy = False
        self._thread = threading.Thread(target=self._run, name=f"weightsync-listener-{name}", daemon=True)
        self._thread.start()

    def export(self) -> PushExport:
        return PushExport(
            worker=self.name,
            mailbox=self.mailbox.handle(),
            doorbell=self.doorbell.address,
            doorbell_key=self.doorbell.key,
            pid=os.getpid(),
        )

    def seal(self) -> None:
        self.mailbox.control.unlink()

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            last = -1
            while not self._stop.is_set():
                self.doorbell.wait(_IDLE_S)
                posted = self.mailbox.posted()
                if self._stop.is_set() or posted is None or posted.seq == last:
                    continue
                last = posted.seq
                self._serve(posted)
        except BaseException as exc:  # logged; STOP below tells the trainer at once
            log.error("weightsync: %s's listener ended: %s", self.name, exc, exc_info=exc)
        finally:
            self.mailbox.control[STOP] = 1

    def _serve(self, call: SyncCall) -> None:
        # Claimed before waiting for the gate, so a teardown meanwhile sees it busy and aborts
        # the transport, and re-checked once the gate is held: a stopped listener writes nothing.
        self.busy = True
        try:
            with self._gate:
                try:
                    if self._stop.is_set():
                        raise WeightSyncError(f"{self.name}: its listener was stopped before sync {call.seq}")
                    result = self._receive(call)
                    # The trainer compared checksums itself, and the worker checked what it
                    # holds: the answer stays small (and is built once when it already is).
                    if result.checksums or result.held is not None:
                        result = replace(result, checksums=[], held=None)
                    outcome = ok(self.name, "receive", result)
                except BaseException as exc:  # noqa: BLE001 - the failure travels to the trainer as data
                    outcome = failed(self.name, "receive", exc)
                version, state = self._status()
        finally:
            self.busy = False
        answer = PushAnswer(outcome=outcome, version=version, state=state)
        try:
            self.mailbox.reply(call.seq, answer, _shortened)
        except WeightSyncError as exc:  # even cut, it did not fit: answer that, and serve on
            why = WeightSyncError(f"{self.name}: its answer to sync {call.seq} did not fit its mailbox ({exc})")
            answer = PushAnswer(outcome=failed(self.name, "receive", why), version=version, state=state)
            self.mailbox.reply(call.seq, answer, _shortened)
        if call.reply is not None and self._tell is not None:
            # After the mailbox: a coordinator that goes on once it reads this never leaves
            # the trainer waiting for an answer (this worker may freeze or die meanwhile).
            try:
                self._tell(call, answer)
            except Exception as exc:  # noqa: BLE001 - the trainer's answer carries this one too
                log.warning("weightsync: %s could not leave its answer to sync %d early: %r", self.name, call.seq, exc)

    def stop(self) -> None:
        """Ask the thread to end; it answers a sync in flight first. Never blocks: the ring
        only saves the thread's idle wait, and a full doorbell queue (a stalled thread, or
        another process flooding it) means it wakes anyway."""
        self._stop.set()
        try:
            ring(self.doorbell.address, self.doorbell.key, time.monotonic(), self.name)
        except TransferTimeout:
            log.debug("weightsync: %s's doorbell is full; its listener sees the stop within %.2f s", self.name, _IDLE_S)

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def close(self, timeout_s: float) -> bool:
        """Stop, join, release; False (nothing released) when the thread did not end in time."""
        self.stop()
        if not self.join(timeout_s):
            log.warning(
                "weightsync: %s's listener did not stop within %.1f s; leaving its mailbox", self.name, timeout_s
            )
            return False
        self.doorbell.close()
        self.mailbox.control.close()
        return True


#: The most names, and characters of each, an answer cut to fit the mailbox keeps.
_NAMES_KEPT, _NAME_CHARS, _MESSAGE_CHARS = 20, 200, 4000


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


def _few(names: tuple[str, ...]) -> tuple[str, ...]:
    kept = tuple(_cut(n, _NAME_CHARS) for n in names[:_NAMES_KEPT])
    return kept + ((f"... and {len(names) - _NAMES_KEPT} more",) if len(names) > _NAMES_KEPT else ())


def _shortened(answer: PushAnswer) -> PushAnswer:
    """``answer`` made to fit the mailbox, whatever it holds: every list of tensor names
    keeps its head (each name cut: a name can be of any length) and says how much was left
    out, and so does a long error message. A party's names (blames) are kept whole."""
    outcome = answer.outcome
    if outcome.ok:
        value = outcome.value
        overflows = dict(list(value.overflows.items())[:_NAMES_KEPT])
        value = replace(
            value,
            stale=_few(value.stale),
            overflows={_cut(n, _NAME_CHARS): c for n, c in overflows.items()},
            parts=(),
        )
        outcome = replace(outcome, value=value)
    else:
        outcome = replace(outcome, message=_cut(outcome.message, _MESSAGE_CHARS))
    return replace(answer, outcome=outcome)
