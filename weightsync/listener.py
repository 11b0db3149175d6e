"""A direct worker's listener thread: push mode's receiving side.

In push mode (``WeightSync(..., push=True)``) a sync costs no Ray call on the worker: its
listener sleeps on a doorbell and, when the trainer rings, runs the worker's usual
``receive`` (the same state machine, checks and deadlines as a Ray-called sync) and leaves
its answer in the mailbox. The worker's weights are written while the listener holds the
receiver's gate; code that reads them holds it too (``WorkerActor.call`` does; a
:class:`~weightsync.actors.WorkerMixin` actor uses ``weightsync_reading()``), so weights
are never read while they are written. Life of one listener::

    WeightReceiver.listen()   -> PushExport     (mailbox + doorbell; the thread starts)
    trainer attaches the mailbox; WeightReceiver.seal_listen() unlinks its name
    per push: ring -> posted() -> receive(call) under the gate -> reply(seq, PushAnswer)
    WeightReceiver.close_transports() -> Listener.close()  (stops and joins the thread)
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from weightsync.transport.mailbox import Doorbell, Mailbox, ring
from weightsync.wire.messages import PushAnswer, PushExport, ReceiveResult, SyncCall
from weightsync.wire.outcome import failed, ok

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
    ) -> None:
        self.name = name
        self.device = device
        self._receive = receive
        self._status = status
        self._gate = gate
        self.mailbox = Mailbox.create()
        self.doorbell = Doorbell()
        self._stop = threading.Event()
        self.busy = False
        self.served = 0
        self._thread = threading.Thread(target=self._run, name=f"weightsync-listener-{name}", daemon=True)
        self._thread.start()

    def export(self) -> PushExport:
        return PushExport(
            worker=self.name, mailbox=self.mailbox.handle(), doorbell=self.doorbell.address, pid=os.getpid()
        )

    def seal(self) -> None:
        self.mailbox.control.unlink()

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        last = -1
        while not self._stop.is_set():
            self.doorbell.wait(_IDLE_S)
            posted = self.mailbox.posted()
            if self._stop.is_set() or posted is None or posted[0] == last:
                continue
            seq, version, verify, force = posted
            last = seq
            self._serve(
                SyncCall(seq=seq, version=version, verify=verify, force=force, direct=(self.name,), kinds=("direct",))
            )

    def _serve(self, call: SyncCall) -> None:
        with self._gate:
            self.busy = True
            try:
                result = self._receive(call)
                # The trainer compared checksums itself; the answer stays small.
                outcome = ok(self.name, "receive", replace(result, checksums=[]))
            except Exception as exc:  # noqa: BLE001 - the failure travels to the trainer as data
                outcome = failed(self.name, "receive", exc)
            finally:
                self.busy = False
            version, state = self._status()
        try:
            self.mailbox.reply(call.seq, PushAnswer(outcome=outcome, version=version, state=state))
        except Exception as exc:  # noqa: BLE001 - the trainer's wait names this worker as late
            log.error("weightsync: %s could not answer sync %d: %s", self.name, call.seq, exc)
        self.served += 1

    def stop(self) -> None:
        """Ask the thread to end; it answers a sync in flight first."""
        self._stop.set()
        ring(self.doorbell.address)

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


@contextlib.contextmanager
def holding(gate: threading.RLock) -> Iterator[None]:
    """Hold ``gate`` for the block: the weights are not written meanwhile."""
    with gate:
        yield
