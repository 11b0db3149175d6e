"""Child-process bodies and shared data for the weightsync.packed_tensor tests.

Every rank rebuilds the same tensors from a seed, so receivers check bit-exactness
themselves and report plain values (names, booleans, counts) back through a queue.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import torch
import torch.distributed as dist

from tests.helpers import bits, random_tensor

# name, shape, dtype; names starting with "cast_" are fp32 that post_iter_func sends as bf16.
LAYOUT: list[tuple[str, tuple[int, ...], torch.dtype]] = [
    ("odd_half", (3, 5), torch.float16),  # 30 bytes: everything after it starts unaligned
    ("after_odd", (7,), torch.float32),
    ("mask", (9, 3), torch.bool),
    ("scalar", (), torch.int64),
    ("empty", (0, 4), torch.float32),
    ("cast_proj", (6, 10), torch.float32),
    ("big", (40, 20), torch.bfloat16),  # 1600 bytes: larger than the 256-byte buffer
    ("fp8", (33,), torch.float8_e4m3fn),
    ("cplx", (5,), torch.complex64),
    ("ids", (11, 3), torch.int32),
    ("scalar_half", (), torch.float16),
    ("tail_empty", (0,), torch.int8),
]
# For vLLM's own functions: every slice aligned and no 0-d tensor (vLLM's unpack fails at odd
# offsets without its PR 57665, and its pack refuses 0-d tensors wider than a byte).
ALIGNED: list[tuple[str, tuple[int, ...], torch.dtype]] = [
    ("a", (4, 8), torch.float32),
    ("cast_b", (8, 8), torch.float32),
    ("c", (16,), torch.bfloat16),
    ("big", (40, 20), torch.bfloat16),
    ("d", (8,), torch.int64),
    ("mask", (16,), torch.bool),
    ("e", (0, 4), torch.float32),
    ("f", (3, 4), torch.float16),
    ("g", (50,), torch.int32),
]
# Odd offsets without 0-d tensors: what vLLM's producer can send and only weightsync's consumer can read.
LAYOUTS = {"awkward": LAYOUT, "aligned": ALIGNED, "odd": [entry for entry in LAYOUT if entry[1] != ()]}
BUFFER = 64


def model(seed: int, layout: str = "awkward") -> list[tuple[str, torch.Tensor]]:
    return [
        (name, random_tensor(shape, dtype, seed * 100 + i)) for i, (name, shape, dtype) in enumerate(LAYOUTS[layout])
    ]


def post_iter(item: tuple[str, torch.Tensor]) -> torch.Tensor:
    name, tensor = item
    return tensor.to(torch.bfloat16) if name.startswith("cast_") else tensor


def sent(seed: int, layout: str = "awkward", device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """What the producer puts on the wire for ``seed``: post_iter applied."""
    return [(name, post_iter((name, t)).to(device)) for name, t in model(seed, layout)]


def metadata(seed: int, layout: str = "awkward") -> list[tuple[str, tuple[list[int], torch.dtype]]]:
    return [(name, (list(t.shape), t.dtype)) for name, t in sent(seed, layout)]


def expected_chunks(sizes: list[int], buffer: int) -> list[list[int]]:
    """vLLM's boundary rule: take until the running total exceeds the buffer."""
    chunks: list[list[int]] = []
    current: list[int] = []
    total = 0
    for index, size in enumerate(sizes):
        current.append(index)
        total += size
        if total > buffer:
            chunks.append(current)
            current, total = [], 0
    if current:
        chunks.append(current)
    return chunks


def mismatches(received: dict[str, torch.Tensor], expected: list[tuple[str, torch.Tensor]]) -> list[str]:
    bad = [name for name, _ in expected if name not in received]
    for name, tensor in expected:
        got = received.get(name)
        if got is None:
            continue
        if got.dtype != tensor.dtype or got.shape != tensor.shape or not torch.equal(bits(got), bits(tensor)):
            bad.append(name)
    return bad


class Collector:
    """A post_unpack_func that clones what it is handed and records each chunk's names."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.chunks: list[list[str]] = []

    def __call__(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.chunks.append([name for name, _ in items])
        for name, tensor in items:
            self.tensors[name] = tensor.clone()


class _NoStream:
    def synchronize(self) -> None:
        pass


def cpu_shims_for_vllm(patch: Callable[[Any, str, Any], None] = setattr) -> Any:
    """vLLM's broadcast functions always make CUDA streams; on a CPU host give them no-ops
    (through ``patch``: ``setattr`` in a child process, ``monkeypatch.setattr`` in a test).
    Returns vLLM's module.

    Their chunking and byte handling, which is what interoperability is about, run as is.
    """
    import vllm.distributed.weight_transfer.packed_tensor as vpt

    if not torch.cuda.is_available():
        if hasattr(vpt, "_get_streams"):
            patch(vpt, "_get_streams", lambda device_idx, num_buffers: tuple(_NoStream() for _ in range(num_buffers)))
        patch(torch.accelerator, "current_device_index", lambda: 0)
        patch(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    return vpt


#: (group, num_buffers, seed, producer "ws"/"vllm", consumer "ws"/"vllm", layout, size_header:
#: None leaves weightsync's functions at their default, True/False is passed to both sides)
Scenario = tuple[str, int, int, str, str, str, bool | None]


def _run_scenarios(
    rank: int, groups: dict[str, tuple[Any, list[int]]], scenarios: list[Scenario]
) -> list[tuple[Scenario, list[str], list[list[str]]]]:
    from weightsync import packed_tensor as ws

    impls: dict[str, Any] = {"ws": ws}
    if any("vllm" in (s[3], s[4]) for s in scenarios):
        impls["vllm"] = cpu_shims_for_vllm()
    results = []
    for scenario in scenarios:
        group_name, num_buffers, seed, producer, consumer, layout, header = scenario
        group, members = groups[group_name]
        if rank not in members:
            continue
        headers = {} if header is None else {"size_header": header}
        if rank == 0:
            if producer == "vllm":
                # vLLM records the original dtype, so its producer is fed what goes on the wire.
                impls["vllm"].packed_nccl_broadcast_producer(
                    iter(sent(seed, layout)), group, 0, lambda item: item[1], BUFFER, num_buffers
                )
            else:
                ws.packed_nccl_broadcast_producer(
                    iter(model(seed, layout)), group, 0, post_iter, BUFFER, num_buffers, **headers
                )
            continue
        collector = Collector()
        impls[consumer].packed_nccl_broadcast_consumer(
            iter(metadata(seed, layout)), group, 0, collector, BUFFER, num_buffers, "cpu", **headers
        )
        results.append((scenario, mismatches(collector.tensors, sent(seed, layout)), collector.chunks))
    return results


def gloo_world(rank: int, world: int, rdzv: str, scenarios: list[Scenario], queue: Any) -> None:
    """One rank of a 3-rank world: runs every scenario over three kinds of real gloo group."""
    try:
        import warnings

        from weightsync.mechanisms.gloo import GlooCommunicator, open_store
        from weightsync.packed_tensor import CommunicatorGroup, GlooGroup

        warnings.simplefilter("ignore", UserWarning)  # the oversize tensor's warning, tested elsewhere
        dist.init_process_group("gloo", init_method=rdzv, rank=rank, world_size=world)
        pair = dist.new_group([0, 1], backend="gloo")
        store = open_store("127.0.0.1", 0, world, 30.0) if rank == 0 else None
        port = [store.port if store is not None else 0]
        dist.broadcast_object_list(port, src=0)
        comm = GlooCommunicator("127.0.0.1", port[0], rank, world, "packed-test", 30.0, store=store)
        groups: dict[str, tuple[Any, list[int]]] = {
            "world": (GlooGroup(), list(range(world))),
            "pair": (GlooGroup(pair), [0, 1]),
            "weightsync": (CommunicatorGroup(comm, 30.0), list(range(world))),
        }
        results = _run_scenarios(rank, groups, scenarios)
        dist.barrier()
        comm.close()
        dist.destroy_process_group()
        queue.put((rank, results, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))


def shm_ipc_consumer(seeds: list[int], chunks_in: Any, acks: Any) -> None:
    """Consumes CPU (shared-memory) packed IPC chunks; acks each one after reading it."""
    try:
        from weightsync.packed_tensor import PackedBufferImporter, packed_ipc_consumer

        importer = PackedBufferImporter()
        for seed in seeds:
            received: dict[str, torch.Tensor] = {}
            while True:
                chunk = chunks_in.get(timeout=60)
                if chunk is None:
                    break
                for name, tensor in packed_ipc_consumer(
                    chunk.ipc_handle, chunk.names, chunk.shapes, chunk.dtype_names, chunk.tensor_sizes, -1, importer
                ):
                    received[name] = tensor
                acks.put(("chunk", importer.mapped, importer.released, None))
            acks.put(("transfer", mismatches(received, sent(seed)), importer.mapped, None))
        importer.close()
        acks.put(("closed", importer.mapped, importer.released, None))
    except BaseException:
        acks.put(("error", None, None, traceback.format_exc()))


def iter_model(seed: int, device: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in model(seed):
        yield name, tensor.to(device)


def cuda_ipc_consumer(seeds: list[int], chunks_in: Any, acks: Any) -> None:
    """Consumes CUDA packed IPC chunks on its own index of the producer's GPU, one ack per chunk."""
    try:
        from weightsync.mechanisms.cuda_ipc import local_index_of
        from weightsync.packed_tensor import PackedBufferImporter, packed_ipc_consumer

        importer = PackedBufferImporter()
        for seed in seeds:
            received: dict[str, torch.Tensor] = {}
            while True:
                chunk = chunks_in.get(timeout=120)
                if chunk is None:
                    break
                (uuid,) = chunk.ipc_handle.keys()
                index = local_index_of(uuid)
                assert index is not None, f"GPU {uuid} is not visible to the consumer"
                for name, tensor in packed_ipc_consumer(
                    chunk.ipc_handle, chunk.names, chunk.shapes, chunk.dtype_names, chunk.tensor_sizes, index, importer
                ):
                    assert tensor.is_cuda
                    received[name] = tensor
                acks.put(("chunk", importer.mapped, importer.released, None))
            bad = mismatches(received, sent(seed))
            del received
            torch.cuda.synchronize()
            acks.put(("transfer", bad, (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()), None))
        importer.close()
        torch.cuda.synchronize()
        acks.put(("closed", importer.mapped, importer.released, None))
    except BaseException:
        acks.put(("error", None, None, traceback.format_exc()))


def nccl_rank_alone(world: int, timeout_s: float, queue: Any) -> None:
    """Rank 0 of an NCCL world whose other ranks never join; reports how creation ended."""
    try:
        from weightsync.core.wire import TransferTimeout
        from weightsync.mechanisms.nccl import NcclCommunicator, make_unique_id

        try:
            NcclCommunicator(make_unique_id(), 0, world, torch.device("cuda", 0), timeout_s)
            queue.put(("created", "", None))
        except TransferTimeout as exc:
            queue.put(("timeout", str(exc), None))
    except BaseException:
        queue.put(("error", "", traceback.format_exc()))
    queue.close()
    queue.join_thread()  # the report is written before leaving
    # The abandoned init thread is still inside NCCL: leave without running exit handlers.
    os._exit(0)


def mismatched_pair(rank: int, rdzv: str, consumer_buffer: int, headers: tuple[bool, bool], queue: Any) -> None:
    """One rank of a 2-rank gloo world whose consumer uses another ``buffer_size_bytes`` than
    the producer, or another ``size_header`` (``headers``: the producer's, the consumer's);
    each rank reports what it raised (the consumer's error text, or None)."""
    try:
        import datetime
        import warnings

        from weightsync.packed_tensor import GlooGroup, packed_nccl_broadcast_consumer, packed_nccl_broadcast_producer

        warnings.simplefilter("ignore", UserWarning)
        dist.init_process_group(
            "gloo", init_method=rdzv, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
        )
        outcome: str | None = None
        try:
            if rank == 0:
                packed_nccl_broadcast_producer(
                    iter(model(9)), GlooGroup(), 0, post_iter, BUFFER, 2, size_header=headers[0]
                )
            else:
                packed_nccl_broadcast_consumer(
                    iter(metadata(9)), GlooGroup(), 0, Collector(), consumer_buffer, 2, "cpu", size_header=headers[1]
                )
        except ValueError as exc:
            outcome = f"ValueError: {exc}"
        except RuntimeError as exc:  # the producer, once the consumer has gone
            outcome = f"RuntimeError: {exc}"
        # An aborted group left for interpreter exit to tear down sometimes ends the process in
        # std::terminate inside torch (about 1 run in 10): destroy it here, as a program should.
        dist.destroy_process_group()
        queue.put((rank, outcome, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
