"""Push mode's doorbell: foreign datagrams are ignored, and no ring blocks past its deadline."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from weightsync.core.wire import ReceiveResult, SyncCall, TransferTimeout
from weightsync.mechanisms.doorbell import Doorbell, ring
from weightsync.transports.push.listener import Listener

HANG_BOUND_S = 60.0  # only bounds a hang; a working call returns at once


def fill(address: str) -> int:
    """Send foreign datagrams to ``address`` until its queue is full; how many went in."""
    sent = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.setblocking(False)
        while True:
            try:
                sock.send(b"not the key")
            except BlockingIOError:
                return sent
            sent += 1


@pytest.fixture
def doorbell() -> Iterator[Doorbell]:
    bell = Doorbell()
    yield bell
    bell.close()


def test_a_datagram_without_the_key_is_ignored_and_a_keyed_ring_wakes(doorbell: Doorbell) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"!", doorbell.address)
        sock.sendto(bytes(16), doorbell.address)  # the right length, the wrong secret
    assert doorbell.wait(0.2) is False
    assert doorbell.ignored == 2
    assert ring(doorbell.address, doorbell.key, time.monotonic() + HANG_BOUND_S, "worker-0")
    assert doorbell.wait(HANG_BOUND_S) is True
    assert doorbell.ignored == 2


def test_a_ring_to_a_stalled_full_doorbell_fails_by_its_deadline_naming_the_worker(doorbell: Doorbell) -> None:
    assert fill(doorbell.address) > 0
    with pytest.raises(TransferTimeout, match="worker-7") as info:
        ring(doorbell.address, doorbell.key, time.monotonic() + 0.2, "worker-7")
    assert list(info.value.blames) == ["worker-7"]
    # Once the listener drains its queue, a ring gets through again.
    assert doorbell.wait(0.1) is False
    assert ring(doorbell.address, doorbell.key, time.monotonic() + HANG_BOUND_S, "worker-7")


def test_a_ring_where_nobody_listens_says_so() -> None:
    bell = Doorbell()
    address, key = bell.address, bell.key
    bell.close()
    assert ring(address, key, time.monotonic() + HANG_BOUND_S, "worker-1") is False


def test_a_flood_during_close_does_not_wedge_the_closing_thread() -> None:
    gate = threading.RLock()
    served: list[int] = []

    def receive(call: SyncCall) -> ReceiveResult:
        served.append(call.seq)
        return ReceiveResult(worker="w", version=call.version, state="committed")

    listener = Listener("worker-3", torch.device("cpu"), receive, lambda: (None, "empty"), gate)
    with gate:  # the listener thread will stall on the gate while serving a sync
        listener.mailbox.post(SyncCall(seq=0, version=1))
        assert ring(listener.doorbell.address, listener.doorbell.key, time.monotonic() + HANG_BOUND_S, "worker-3")
        deadline = time.monotonic() + HANG_BOUND_S
        while not listener.busy and time.monotonic() < deadline:
            time.sleep(0.001)
        assert listener.busy, "the listener never started serving the posted sync"
        assert fill(listener.doorbell.address) > 0
        stopper = threading.Thread(target=listener.stop)
        stopper.start()
        stopper.join(HANG_BOUND_S)
        wedged = stopper.is_alive()
    stopper.join(HANG_BOUND_S)
    assert not wedged, "stop() blocked on a full doorbell"
    assert listener.join(HANG_BOUND_S), "the listener thread did not end after stop()"
    # The stop came while the sync waited for the gate: it is answered, as refused, not run.
    answer = listener.mailbox.answer()
    assert not answer.outcome.ok and "stopped" in answer.outcome.message
    assert served == []
    assert listener.close(HANG_BOUND_S)
