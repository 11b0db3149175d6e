"""The CuPy NCCL communicator and the packed broadcast/IPC functions on CUDA.

The unique-id conversions run everywhere; everything else is marked ``cuda`` (skipped
without a GPU) and runs on the GPU test machine.
"""

from __future__ import annotations

import contextlib
import platform
import sys
import threading
import time
import types
from typing import Any

import pytest
import torch

from tests.helpers import random_tensor
from tests.packed_procs import (
    BUFFER,
    Collector,
    cuda_ipc_consumer,
    expected_chunks,
    iter_model,
    metadata,
    mismatches,
    nccl_rank_alone,
    post_iter,
    sent,
)
from weightsync.core.wire import WeightSyncError
from weightsync.mechanisms.nccl import unique_id_as_bytes, unique_id_for_cupy


def test_the_unique_id_travels_as_bytes_and_converts_to_either_cupy_form() -> None:
    raw = bytes(range(256))[::2]  # 128 bytes, half of them above 127
    signed = unique_id_for_cupy(raw, takes_bytes=False, char_is_signed=True)
    assert isinstance(signed, tuple) and min(signed) == -128 + 0 and max(signed) == 126
    assert unique_id_as_bytes(signed) == raw
    assert unique_id_for_cupy(raw, takes_bytes=False, char_is_signed=False) == tuple(raw)
    assert unique_id_for_cupy(raw, takes_bytes=True, char_is_signed=True) == raw
    with pytest.raises(WeightSyncError, match="128 bytes, got 3"):
        unique_id_as_bytes(b"abc")


class _FakeComm:
    def __init__(self) -> None:
        self.aborted = threading.Event()
        self.calls: list[tuple[int, int, int]] = []

    def abort(self) -> None:
        self.aborted.set()

    def destroy(self) -> None:
        pass

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, stream: int) -> None:
        self.calls.append((count, root, stream))


class _FakeNccl:
    """cupy.cuda.nccl's surface: NcclCommunicator blocks until ``join`` is set, like a real init
    waiting for its peers; ``fail`` makes it raise instead."""

    NCCL_UINT8 = 1
    NCCL_INT32 = 2
    NCCL_SUM = 0

    def __init__(self, fail: bool = False) -> None:
        self.join = threading.Event()
        self.fail = fail
        self.made: list[_FakeComm] = []
        self.created = threading.Event()
        self.ids: list[Any] = []

    def NcclCommunicator(self, world_size: int, unique_id: Any, rank: int) -> _FakeComm:
        self.ids.append(unique_id)
        if self.fail:
            raise RuntimeError("NCCL_ERROR_INVALID_USAGE")
        assert self.join.wait(60)
        comm = _FakeComm()
        self.made.append(comm)
        self.created.set()
        return comm


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    import weightsync.mechanisms.nccl as nccl_module

    def install(version: str, nccl: _FakeNccl) -> None:
        cupy = types.SimpleNamespace(
            __version__=version, cuda=types.SimpleNamespace(Device=lambda index: contextlib.nullcontext())
        )
        monkeypatch.setitem(sys.modules, "cupy", cupy)
        monkeypatch.setattr(nccl_module, "_nccl", lambda: nccl)

    return install


def test_creation_gives_up_at_its_deadline_and_a_late_join_is_aborted(fake_cupy: Any) -> None:
    from weightsync.core.wire import TransferTimeout
    from weightsync.mechanisms.nccl import NcclCommunicator

    nccl = _FakeNccl()
    fake_cupy("14.0.1", nccl)
    with pytest.raises(TransferTimeout, match=r"rank 0 of 3.*ranks \[1, 2\]"):
        NcclCommunicator(bytes(range(128)), 0, 3, torch.device("cuda", 0), 0.2)
    assert nccl.ids == [bytes(range(128))]
    nccl.join.set()  # the missing ranks turn up after the constructor gave up
    assert nccl.created.wait(30)
    assert nccl.made[0].aborted.wait(30), "a communicator nobody owns must be aborted"


def test_creation_hands_back_the_communicator_or_the_init_error_by_rank(fake_cupy: Any) -> None:
    from weightsync.mechanisms.nccl import NcclCommunicator

    nccl = _FakeNccl()
    nccl.join.set()
    fake_cupy("13.3.0", nccl)
    comm = NcclCommunicator(bytes([200] * 128), 1, 2, torch.device("cuda", 0), 30.0)
    signed = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686", "x86"}
    assert nccl.ids == [tuple([200 - 256 if signed else 200] * 128)]  # CuPy 13 takes a tuple of C chars
    data = torch.arange(6, dtype=torch.float32)
    comm.broadcast(data, 0, 1234)
    assert nccl.made[0].calls == [(24, 0, 1234)] and not nccl.made[0].aborted.is_set()
    comm.abort()
    assert nccl.made[0].aborted.is_set()
    failing = _FakeNccl(fail=True)
    fake_cupy("14.0.0", failing)
    with pytest.raises(WeightSyncError, match=r"rank 1 of 2.*INVALID_USAGE"):
        NcclCommunicator(bytes(128), 1, 2, torch.device("cuda", 0), 30.0)


def _cuda() -> torch.device:
    pytest.importorskip("cupy")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


@pytest.mark.cuda
def test_a_world_of_one_rank_inits_broadcasts_on_a_torch_stream_aborts_and_closes() -> None:
    from weightsync.mechanisms.nccl import NcclCommunicator, make_unique_id
    from weightsync.mechanisms.streams import wait_for_stream

    device = _cuda()
    unique_id = make_unique_id()
    assert isinstance(unique_id, bytes) and len(unique_id) == 128
    comm = NcclCommunicator(unique_id, 0, 1, device, 60.0)
    stream = torch.cuda.Stream(device=device)
    data = random_tensor((1 << 20,), torch.uint8, 1).to(device)
    floats = random_tensor((1001,), torch.float32, 2).to(device)
    expected = (data.clone(), floats.clone())
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        comm.broadcast(data, 0, int(stream.cuda_stream)).wait(time.monotonic() + 60)
        comm.broadcast(floats, 0, int(stream.cuda_stream))  # counted in bytes, whatever the dtype
    wait_for_stream(stream, time.monotonic() + 60, "the world-of-one broadcast")
    assert torch.equal(data, expected[0]) and torch.equal(floats, expected[1])
    comm.abort()
    with pytest.raises(WeightSyncError, match="rank 0"):
        comm.broadcast(data, 0, 0)
    comm.close()  # after abort: nothing left to release
    second = NcclCommunicator(make_unique_id(), 0, 1, device, 60.0)
    second.close()
    with pytest.raises(WeightSyncError, match="rank 0"):
        second.broadcast(data, 0, 0)


@pytest.mark.cuda
def test_creation_fails_within_its_deadline_naming_the_ranks_that_never_joined() -> None:
    _cuda()
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=nccl_rank_alone, args=(2, 3.0, queue))
    child.start()
    try:
        kind, message, error = queue.get(timeout=120)
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert error is None, error
    assert kind == "timeout"
    assert "rank 0 of 2" in message and "[1]" in message and "3.0s" in message


@pytest.mark.cuda
@pytest.mark.parametrize("num_buffers", [1, 2, 3])
@pytest.mark.parametrize("size_header", [False, True])
def test_packed_broadcast_on_cuda_tensors_over_a_world_of_one(num_buffers: int, size_header: bool) -> None:
    """vLLM's wire by default (the chunks alone); with ``size_header`` on both sides each
    chunk follows its size header and one more ends the stream."""
    import warnings

    from weightsync import packed_tensor as pt
    from weightsync.mechanisms.nccl import NcclCommunicator, make_unique_id

    device = _cuda()
    nccl = pt.CommunicatorGroup(NcclCommunicator(make_unique_id(), 0, 1, device, 60.0), 60.0)
    recorded: list[torch.Tensor] = []

    class Recording:
        """The real NCCL group; each chunk is also cloned on the slot stream after its broadcast."""

        def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
            assert tensor.is_cuda and torch.cuda.current_stream(device) != torch.cuda.default_stream(device)
            nccl.broadcast(tensor, src=src)
            recorded.append(tensor.clone())

    class Feeding:
        """Fills each receive buffer with the recorded chunk, then runs the real NCCL broadcast."""

        def __init__(self) -> None:
            self.index = 0

        def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
            chunk = recorded[self.index]
            self.index += 1
            # Same bytes, maybe typed differently (a size header goes out as int64 words).
            assert tensor.numel() * tensor.element_size() == chunk.numel() * chunk.element_size()
            assert tensor.device == device
            tensor.view(torch.uint8).copy_(chunk.view(torch.uint8))
            nccl.broadcast(tensor, src=src)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        pt.packed_nccl_broadcast_producer(
            iter_model(3, "cuda"), Recording(), 0, post_iter, BUFFER, num_buffers, size_header=size_header
        )
    wire = sent(3)
    chunks = expected_chunks([t.numel() * t.element_size() for _, t in wire], BUFFER)
    headers, data = (recorded[0::2], recorded[1::2]) if size_header else ([], recorded)
    assert len(headers) == (len(chunks) + 1 if size_header else 0)
    assert [c.numel() for c in data] == [sum(wire[i][1].numel() * wire[i][1].element_size() for i in c) for c in chunks]
    collector = Collector()
    pt.packed_nccl_broadcast_consumer(
        iter(metadata(3)), Feeding(), 0, collector, BUFFER, num_buffers, device, size_header=size_header
    )
    assert all(t.is_cuda for t in collector.tensors.values())
    assert mismatches(collector.tensors, wire) == []
    assert collector.chunks == [[wire[i][0] for i in c] for c in chunks]
    nccl.close()


@pytest.mark.cuda
def test_cuda_ipc_between_two_processes_maps_once_per_export_and_memory_stays_flat() -> None:
    from weightsync import packed_tensor as pt
    from weightsync.mechanisms.cuda_ipc import gpu_uuid

    device = _cuda()
    seeds = [200 + t for t in range(50)]
    ctx = torch.multiprocessing.get_context("spawn")
    chunks_out, acks = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=cuda_ipc_consumer, args=(seeds, chunks_out, acks))
    child.start()
    producer_memory: list[tuple[int, int]] = []
    consumer_memory: list[Any] = []
    try:
        for number, seed in enumerate(seeds, start=1):
            count = 0
            for chunk in pt.packed_ipc_producer(iter_model(seed, "cuda"), gpu_uuid(0), post_iter, 1700):
                chunks_out.put(chunk)
                kind, mapped, released, error = acks.get(timeout=120)  # chunk k is read before k+1 is packed
                assert error is None, error
                assert (kind, mapped, released) == ("chunk", number, number - 1), "one mapping per export"
                count += 1
            assert count >= 3
            chunks_out.put(None)
            kind, bad, memory, error = acks.get(timeout=120)
            assert error is None, error
            assert kind == "transfer" and bad == [], f"transfer {number}: {bad}"
            consumer_memory.append(memory)
            torch.cuda.synchronize(device)
            torch.cuda.ipc_collect()
            producer_memory.append((torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)))
        kind, mapped, released, error = acks.get(timeout=120)
        assert (kind, mapped, released, error) == ("closed", len(seeds), len(seeds), None)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    # Flat means no growth: what is allocated and reserved after transfer 50 is at most what
    # it was after transfer 10 (a small allocation of the first transfers may be freed later).
    for side, memory in (("producer", producer_memory), ("consumer", consumer_memory)):
        assert all(late <= early for early, late in zip(memory[9], memory[-1])), (
            f"{side} memory grew: {memory[9]} -> {memory[-1]}"
        )
