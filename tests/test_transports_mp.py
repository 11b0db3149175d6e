"""Real transports between real processes: gloo over loopback, shared-memory IPC."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from tests.helpers import act, session_of
from tests.procs import Holder, gloo_rank, ipc_consumer
from weightsync.core.halves import Sources
from weightsync.core.sender import WeightSender
from weightsync.core.wire import Manifest, SyncCall, SyncSettings, TransferError, TransferTimeout
from weightsync.core.wire.shm_names import current_scope
from weightsync.mechanisms.gloo import GlooCommunicator, open_store
from weightsync.mechanisms.shm import leftover_segments
from weightsync.transports.broadcast.halves import BroadcastSender

CTX = mp.get_context("spawn")
SEEDS = [11, 12, 13]


def collect(queue, count: int, timeout: float = 120.0) -> list:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(count):
        item = queue.get(timeout=timeout)
        assert item[-1] is None, f"child failed:\n{item[-1]}"
        out.append(item)
    return out


@pytest.mark.parametrize("num_buffers", [1, 2, 3])
def test_gloo_broadcast_to_two_receivers_over_loopback_is_bit_exact(num_buffers: int) -> None:
    buffer_bytes = 8192
    world = 3
    store = open_store("127.0.0.1", 0, world, 30.0)
    queue = CTX.Queue()
    children = [
        CTX.Process(target=gloo_rank, args=(rank, store.port, world, buffer_bytes, num_buffers, SEEDS, queue))
        for rank in (1, 2)
    ]
    for child in children:
        child.start()
    try:
        model = Holder(seed=0)
        sender = WeightSender(model)
        manifest = sender.manifest(SyncSettings(buffer_bytes=buffer_bytes, num_buffers=num_buffers))
        assert len(manifest.chunks) >= 4
        sender.install(
            BroadcastSender(
                GlooCommunicator("127.0.0.1", store.port, 0, world, "test-group", 30.0, store=store),
                sender.session,
                ["trainer", "rank-1", "rank-2"],
            )
        )
        half = sender.halves["broadcast"]
        assert isinstance(half, BroadcastSender)
        first_buffers = None
        for sync, seed in enumerate(SEEDS):
            model.load(seed)
            sender.send(SyncCall(seq=sync, version=sync + 1, targets={"broadcast": ("rank-1", "rank-2")}))
            buffers = [b.data_ptr() for b in half.buffers()]
            first_buffers = first_buffers or buffers
            assert buffers == first_buffers, "buffers must be allocated once and reused"
        results = collect(queue, 2)
        assert sorted(r[0] for r in results) == [1, 2]
        for _, matches, _ in results:
            assert matches == [True] * len(SEEDS)
        sender.close_transports()
    finally:
        for child in children:
            child.join(timeout=60)


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_shm_ipc_never_rewrites_a_slot_a_consumer_still_reads(num_buffers: int, no_shm_leftovers: None) -> None:
    buffer_bytes = 8192
    model = Holder(seed=0)
    sender = WeightSender(model)
    manifest = sender.manifest(SyncSettings(buffer_bytes=buffer_bytes, num_buffers=num_buffers))
    assert len(manifest.chunks) > num_buffers
    export = act(sender, "ipc", "export", ("consumer",))
    queue = CTX.Queue()
    child = CTX.Process(target=ipc_consumer, args=(export, buffer_bytes, num_buffers, SEEDS, queue, True))
    child.start()
    try:
        for sync, seed in enumerate(SEEDS):
            model.load(seed)
            sender.send(SyncCall(seq=sync, version=sync + 1, targets={"ipc": ("consumer",)}))
        [(matches, rewritten, maps, releases, _)] = collect(queue, 1)
        assert matches == [True] * len(SEEDS)
        assert rewritten == 0
        # One mapping of the slots and one of the control block, each released once.
        assert (maps, releases) == (2, 2)
    finally:
        child.join(timeout=60)
        sender.close_transports()
    assert not any(export.session in name for name in leftover_segments(scope=current_scope()))


def test_the_slot_check_catches_a_producer_that_ignores_the_hand_off(
    monkeypatch: pytest.MonkeyPatch, no_shm_leftovers: None
) -> None:
    """Break the producer on purpose (never wait for the slot): the same check must fire."""
    from weightsync.mechanisms.control import ControlBlock

    def no_wait(block, predicate, deadline, me, what, names, **kw):  # type: ignore[no-untyped-def]
        if "release slot" in what():
            return
        return original(block, predicate, deadline, me, what, names, **kw)

    original = ControlBlock.wait
    monkeypatch.setattr(ControlBlock, "wait", no_wait)
    model = Holder(seed=0)
    sender = WeightSender(model)
    sender.manifest(SyncSettings(buffer_bytes=8192, num_buffers=1))
    export = act(sender, "ipc", "export", ("consumer",))
    queue = CTX.Queue()
    child = CTX.Process(target=ipc_consumer, args=(export, 8192, 1, SEEDS[:1], queue, True))
    child.start()
    try:
        model.load(SEEDS[0])
        sender.send(SyncCall(seq=0, version=1, targets={"ipc": ("consumer",)}))
        [(_, rewritten, _, _, _)] = collect(queue, 1)
        assert rewritten > 0
    finally:
        child.join(timeout=60)
        sender.close_transports()


class RecordingComm:
    """A fake communicator whose work checks, when waited on, that the buffer it was given
    still holds the bytes it had when the broadcast started."""

    def __init__(self) -> None:
        self.rank, self.world_size, self.device = 0, 2, torch.device("cpu")
        self.started = 0
        self.waited = 0
        self.torn = 0
        self.aborted = False

    def broadcast(self, tensor: torch.Tensor, src: int, stream_pointer: int = 0) -> object:
        self.started += 1
        comm = self
        snapshot = tensor.clone()

        class Work:
            def wait(self, deadline: float) -> None:
                comm.waited += 1
                if not torch.equal(tensor, snapshot):
                    comm.torn += 1

        return Work()

    def agree(self, refuse: bool, deadline: float) -> list[int]:
        return []

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        pass


@pytest.mark.parametrize("num_buffers", [1, 2, 3])
def test_producer_keeps_in_flight_chunks_intact_and_drains_before_returning(num_buffers: int) -> None:
    # NeMo-RL #3055 tore weights by returning before the last sends finished.
    model = Holder(seed=0)
    manifest = WeightSender(model).manifest(SyncSettings(buffer_bytes=8192, num_buffers=num_buffers))
    comm = RecordingComm()
    sender = BroadcastSender(comm, session_of(manifest), ["trainer", "worker"])
    sources = [t for _, t in WeightSender(model).named_tensors()]
    sender.send(Sources(sources, None), SyncCall(seq=0, version=1), time.monotonic() + 30.0)
    assert comm.started == len(manifest.chunks)
    assert comm.waited == comm.started, "every broadcast must be waited for before send returns"
    assert comm.torn == 0


def test_gloo_timeout_names_the_rank_and_what_to_raise() -> None:
    store = open_store("127.0.0.1", 0, 2, 5.0)
    queue, ready = CTX.Queue(), CTX.Queue()
    # A peer that joins the group and then never receives.
    child = CTX.Process(target=_join_and_idle, args=(store.port, queue, ready))
    child.start()
    try:
        # The group's 2 s timeout also bounds its forming: join only once the child has
        # started up (a spawned interpreter importing torch can take longer than that).
        assert ready.get(timeout=120) == "joining"
        comm = GlooCommunicator("127.0.0.1", store.port, 0, 2, "idle", 2.0, store=store)
        model = Holder(seed=0)
        manifest = Manifest.build(WeightSender(model).specs(), 8192, 2)
        sender = BroadcastSender(comm, session_of(manifest, timeout_s=1.0), ["trainer", "idle"])
        sources = [t for _, t in WeightSender(model).named_tensors()]
        with pytest.raises(TransferTimeout) as info:  # a hang instead is pytest-timeout's to end
            sender.send(Sources(sources, None), SyncCall(seq=0, version=1), time.monotonic() + 5.0)
        text = str(info.value)
        assert "rank 0" in text and "timeout_s" in text, text
    finally:
        queue.put("done")
        child.join(timeout=60)


def _join_and_idle(port: int, queue, ready) -> None:  # type: ignore[no-untyped-def]
    ready.put("joining")
    comm = GlooCommunicator("127.0.0.1", port, 1, 2, "idle", 2.0)
    queue.get(timeout=120)
    comm.close()


#: Long enough that an abort seen by the peer is told apart from the group timing out.
ABORT_OP_TIMEOUT_S = 8.0


def _wait_for_rank_0(port: int, ready, queue) -> None:  # type: ignore[no-untyped-def]
    """Rank 1: joins, then waits (for up to the op timeout) on a broadcast from rank 0 that
    rank 0 never sends; reports the error class and text it ended with, then exits at once
    (a normal exit would wait the op timeout for its dropped group's pending receive)."""
    try:
        ready.put("joining")
        comm = GlooCommunicator("127.0.0.1", port, 1, 2, "abort", ABORT_OP_TIMEOUT_S)
        ready.put("joined")
        try:
            comm.broadcast(torch.zeros(16), 0).wait(time.monotonic() + 30.0)
            queue.put(("completed", ""))
        except Exception as exc:
            queue.put((type(exc).__name__, str(exc)))
        comm.abort()
    except BaseException as exc:
        queue.put(("setup", repr(exc)))
    for q in (ready, queue):
        q.close()
        q.join_thread()  # the report is in the pipe before the exit
    os._exit(0)


@pytest.mark.parametrize("attempt", range(5))
def test_a_rank_aborting_while_it_waits_on_a_live_peer_fails_that_peer_by_abort_not_timeout(attempt: int) -> None:
    # Destroying a gloo group waits for its pending receives, so a rank that aborted while
    # waiting on a live peer used to keep its sockets open, and the peer waiting, until
    # gloo's timeout; the abort word reaches the peer at once.
    store = open_store("127.0.0.1", 0, 2, 120.0)
    ready, queue = CTX.Queue(), CTX.Queue()
    child = CTX.Process(target=_wait_for_rank_0, args=(store.port, ready, queue))
    child.start()
    try:
        assert ready.get(timeout=120) == "joining"
        comm = GlooCommunicator("127.0.0.1", store.port, 0, 2, "abort", ABORT_OP_TIMEOUT_S, store=store)
        assert ready.get(timeout=120) == "joined"
        # Rank 0 waits on a broadcast from rank 1, which rank 1 never sends, then fails.
        pending = comm.broadcast(torch.zeros(16), 1)
        comm.abort()
        kind, text = queue.get(timeout=120)
        assert kind == "TransferError", f"rank 1 ended with {kind}: {text}"
        assert "rank 0" in text and "aborted" in text, text
        with pytest.raises(TransferError):
            pending.wait(time.monotonic() + 30.0)
    finally:
        child.join(timeout=120)
    assert child.exitcode == 0


def _host_rank_0(ports, ready) -> None:  # type: ignore[no-untyped-def]
    """Rank 0 of three, which hosts the group's store (as a trainer does): joins, then idles
    until the test kills it."""
    store = open_store("127.0.0.1", 0, 3, 120.0)
    ports.put(store.port)
    GlooCommunicator("127.0.0.1", store.port, 0, 3, "host", 30.0, store=store)
    ready.put("rank 0 joined")
    time.sleep(600)  # killed long before


def _wait_for_rank_2(port: int, ready, queue) -> None:  # type: ignore[no-untyped-def]
    """Rank 1 of three: waits on a broadcast from rank 2, a live peer that never sends (as a
    worker waits on another in gloo's relay of a large broadcast); reports how it ended."""
    try:
        comm = GlooCommunicator("127.0.0.1", port, 1, 3, "host", 30.0)
        ready.put("rank 1 joined")
        try:
            comm.broadcast(torch.zeros(16), 2).wait(time.monotonic() + 15.0)
            queue.put(("completed", ""))
        except Exception as exc:
            queue.put((type(exc).__name__, str(exc)))
        comm.abort()
    except BaseException as exc:
        queue.put(("setup", repr(exc)))
    for q in (ready, queue):
        q.close()
        q.join_thread()
    os._exit(0)


def test_a_rank_waiting_on_a_live_peer_fails_at_once_when_the_store_host_dies() -> None:
    """Rank 0 (a trainer, which hosts the group's store) is killed (SIGKILL) while rank 1
    waits on rank 2: nobody can write the abort word into a dead store, and rank 1's own
    wait never touches rank 0. It must still fail at once, naming rank 0, not when its
    deadline (15 s) runs out."""
    ports, ready, queue = CTX.Queue(), CTX.Queue(), CTX.Queue()
    host = CTX.Process(target=_host_rank_0, args=(ports, ready))
    host.start()
    waiter = None
    comm = None
    try:
        port = ports.get(timeout=120)
        waiter = CTX.Process(target=_wait_for_rank_2, args=(port, ready, queue))
        waiter.start()
        comm = GlooCommunicator("127.0.0.1", port, 2, 3, "host", 30.0)
        assert sorted(ready.get(timeout=120) for _ in range(2)) == ["rank 0 joined", "rank 1 joined"]
        pending = comm.broadcast(torch.zeros(16), 1)  # rank 2 waits too, on rank 1
        os.kill(host.pid, signal.SIGKILL)  # type: ignore[arg-type]
        kind, text = queue.get(timeout=120)
        assert kind == "TransferError", f"rank 1 ended with {kind}: {text}"
        assert "rank 0" in text and "store" in text, text
        with pytest.raises(TransferError):
            pending.wait(time.monotonic() + 15.0)
    finally:
        if comm is not None:
            comm.abort()
        host.join(timeout=120)
        if waiter is not None:
            waiter.join(timeout=120)
    assert waiter.exitcode == 0
