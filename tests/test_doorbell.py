"""Push mode's doorbell: foreign datagrams are ignored, and no ring blocks past its deadline."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from weightsync.core.wire import ReceiveResult, SyncCall, TransferTimeout, WeightSyncError
from weightsync.mechanisms.doorbell import Bell, Doorbell, ring
from weightsync.mechanisms.mailbox import ANSWERED
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


def test_an_answer_too_large_for_the_mailbox_is_cut_to_fit_and_the_listener_serves_on() -> None:
    """A stale tensor with a 70,000-character name, or an error of 200,000 characters, makes
    an answer larger than the mailbox: it is cut to fit (each name, the list, the message),
    never raised out of the listener thread, which answers the next sync too."""
    gate = threading.RLock()
    huge = "w" * 70_000

    def receive(call: SyncCall) -> ReceiveResult:
        if call.seq == 0:
            return ReceiveResult(
                worker="w", version=None, state="committed", stale=(huge, *(f"t{i}" for i in range(500)))
            )
        if call.seq == 1:
            raise WeightSyncError("e" * 200_000)
        return ReceiveResult(worker="w", version=call.version, state="committed")

    listener = Listener("worker-5", torch.device("cpu"), receive, lambda: (None, "committed"), gate)
    try:
        answers = []
        for seq in range(3):
            listener.mailbox.post(SyncCall(seq=seq, version=seq + 1))
            assert ring(listener.doorbell.address, listener.doorbell.key, time.monotonic() + HANG_BOUND_S, "worker-5")
            deadline = time.monotonic() + HANG_BOUND_S
            while listener.mailbox.control[ANSWERED] != seq + 1:
                assert not listener.mailbox.stopped, f"the listener ended before answering sync {seq}"
                assert time.monotonic() < deadline, f"no answer to sync {seq}"
                time.sleep(0.001)
            answers.append(listener.mailbox.answer())
        stale = answers[0].outcome.value.stale
        assert answers[0].outcome.ok and stale[0].startswith(huge[:100]) and len(stale[0]) < 1000
        assert "more" in stale[-1] and len(stale) < 100
        assert not answers[1].outcome.ok and answers[1].outcome.message.startswith("e" * 100)
        assert len(answers[1].outcome.message) < 10_000
        assert answers[2].outcome.ok and answers[2].outcome.value.version == 3
        assert not listener.mailbox.stopped
    finally:
        assert listener.close(HANG_BOUND_S)


def test_a_kept_bell_rings_every_sync_and_lets_its_socket_go_once_nobody_listens() -> None:
    listener = Doorbell()
    bell = Bell(listener.address, listener.key, "worker-2")
    try:
        assert not bell.connected
        for _ in range(3):
            assert bell.ring(time.monotonic() + HANG_BOUND_S)
            assert listener.wait(HANG_BOUND_S) is True
            assert bell.connected
        listener.close()
        assert bell.ring(time.monotonic() + HANG_BOUND_S) is False
        assert not bell.connected
    finally:
        bell.close()
        listener.close()


def test_a_kept_bell_reuses_its_socket_and_reaches_a_listener_bound_anew_at_its_address() -> None:
    first = Doorbell()
    bell = Bell(first.address, first.key, "worker-4")
    try:
        assert bell.ring(time.monotonic() + HANG_BOUND_S)
        kept = bell._sock
        assert bell.ring(time.monotonic() + HANG_BOUND_S) and bell._sock is kept  # one socket, every ring
        first.close()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as again:
            again.bind(first.address)  # the same address, a new socket behind it
            assert bell.ring(time.monotonic() + HANG_BOUND_S)  # as a fresh socket's ring would
            assert again.recv(64) == first.key
    finally:
        bell.close()


def test_a_kept_bell_to_a_full_doorbell_fails_by_its_deadline_naming_the_worker(doorbell: Doorbell) -> None:
    bell = Bell(doorbell.address, doorbell.key, "worker-5")
    try:
        assert fill(doorbell.address) > 0
        with pytest.raises(TransferTimeout, match="worker-5"):
            bell.ring(time.monotonic() + 0.2)
        assert doorbell.wait(0.1) is False  # drained: only foreign datagrams were queued
        assert bell.ring(time.monotonic() + HANG_BOUND_S)
        assert doorbell.wait(HANG_BOUND_S) is True
    finally:
        bell.close()
