"""The ipc transport's planned slot copies (one kernel launch per chunk on a GPU).

On a CPU the kernel is stood in for by :class:`HostCopier`, which runs the very tables the
planning builds (addresses and lengths) with ``memmove``: a plan kept after a tensor moved
writes the old storage (kept alive here) and the test sees the stale bytes. The ``cuda``
tests run the real kernel.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import pytest
import torch
from torch import nn

from tests.helpers import MixedModel, assert_bit_equal, both_sides, perturb, random_tensor
from weightsync import WeightReceiver, WeightSender
from weightsync.core import registry
from weightsync.core.local import open_local
from weightsync.core.packing import ChunkUnpacker, pack_chunk
from weightsync.core.sinks import module_tensors
from weightsync.core.wire import Manifest, SyncCall, SyncSettings, TensorSpec
from weightsync.core.wire.outcome import ok
from weightsync.mechanisms.batched_copy import BatchedCopier, CopyPlan, PlanKey, batched_rows, plan_key
from weightsync.transports.ipc.halves import IpcReceiver, IpcSender
from weightsync.transports.ipc.slot_copies import PackPlans, UnpackPlans


class HostCopier(BatchedCopier):
    """The batched copier's plans, run on the host: each row is one ``memmove``."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"), kernel=None, threads=32, unit_vectors=1)
        self.launches = 0
        self.rows_run = 0

    def plan(
        self, destinations: Sequence[torch.Tensor | None], sources: Sequence[torch.Tensor], key: PlanKey | None = None
    ) -> CopyPlan:
        rows, leftovers = batched_rows(destinations, sources)
        table = torch.tensor(rows, dtype=torch.int64) if rows else None
        return CopyPlan(plan_key(sources) if key is None else key, table, None, len(rows), len(rows), leftovers, 1)

    def launch(self, plan: CopyPlan, stream: torch.cuda.Stream | None) -> None:
        self.launches += 1
        if plan.table is None:
            return
        for source, destination, vectors in plan.table.tolist():
            ctypes.memmove(destination, source, vectors * 16)
            self.rows_run += 1


def _tensors(device: str, seed: int) -> dict[str, torch.Tensor]:
    """Pieces of every kind: batched whole tensors, a split one, unaligned, strided, a cast."""
    return {
        "big": random_tensor((3000, 4), torch.bfloat16, seed).to(device),  # split over chunks
        "aligned": random_tensor((60,), torch.float32, seed + 1).to(device),  # 240 bytes: batched
        "odd": random_tensor((3, 5), torch.float16, seed + 2).to(device),  # 30 bytes: copy_
        "strided": random_tensor((8, 16), torch.float32, seed + 3).to(device).t(),  # copy_
        "empty": torch.empty(0, 4, device=device),
        "wide": random_tensor((64, 8), torch.float32, seed + 4).to(device),  # cast to bf16 on the way
    }


def _round_trip(device: str, copier: BatchedCopier) -> None:
    """Pack every chunk into alternating slots and unpack it, three syncs per step, while the
    sources and destinations move; every sync bit for bit."""
    sources = _tensors(device, 1)
    specs = [TensorSpec.of(n, t) for n, t in sources.items()]
    specs[-1] = TensorSpec(name="wide", shape=(64, 8), dtype="bfloat16")
    manifest = Manifest.build(specs, buffer_bytes=4096, num_buffers=2)
    assert len(manifest.chunks) % 2 == 1, "an odd chunk count puts each chunk in both slots over two syncs"
    slots = torch.empty(2 * 4096, dtype=torch.uint8, device=device)
    out = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype, device=device) for s in manifest.specs}
    packing, unpacking = PackPlans(copier, manifest.specs), UnpackPlans(copier, manifest.specs)
    kept: list[torch.Tensor] = []  # moved-away storage stays alive, so a stale plan shows as stale bytes
    seq = 0

    def sync(seed: int) -> None:
        nonlocal seq
        for i, tensor in enumerate(sources.values()):
            with torch.no_grad():
                tensor.copy_(random_tensor(tuple(tensor.shape), tensor.dtype, seed * 100 + i).to(device))
        order = list(sources.values())
        packs = packing.begin(plan_key(order))
        destinations = [out[s.name] if s.name != "odd" else None for s in manifest.specs]
        unpacks = unpacking.begin(destinations)
        unpacker = ChunkUnpacker(manifest.specs, destinations.__getitem__, keeps_references=False)
        handed: dict[str, torch.Tensor] = {}
        for chunk in manifest.chunks:
            slot = (seq * len(manifest.chunks) + chunk.index) % 2
            buffer = slots[slot * 4096 : (slot + 1) * 4096]
            buffer.fill_(0xAB)
            stream = torch.cuda.current_stream() if device == "cuda" else None
            if packs:
                packing.pack(chunk, slot, buffer, order, stream)
            else:
                pack_chunk(chunk, manifest.specs, order, buffer)
            if unpacks:
                got = unpacking.unpack(chunk, slot, buffer, destinations, unpacker, stream)
            else:
                got = unpacker.unpack(chunk, buffer)
            for name, tensor in got:
                handed[name] = tensor.clone()
        unpacker.finish()
        seq += 1
        for spec in manifest.specs:
            got = handed[spec.name] if spec.name == "odd" else out[spec.name]
            assert_bit_equal(got, sources[spec.name].to(spec.torch_dtype), f"sync {seq}: {spec.name}")

    n = len(manifest.chunks)  # plans one sync makes: (chunk, slot) alternates between syncs
    sync(1)
    assert (packing.built, unpacking.built) == (0, 0), "a first sync copies tensor by tensor"
    sync(2)
    sync(3)
    assert (packing.built, unpacking.built) == (2 * n, 2 * n), "every (chunk, slot) planned once"
    sync(4)
    assert (packing.built, unpacking.built) == (2 * n, 2 * n), "nothing moved: every plan is reused"
    kept.append(sources["aligned"])
    sources["aligned"] = sources["aligned"].clone()  # the trainer's tensor gets new storage
    sync(5)
    assert (packing.built, unpacking.built) == (2 * n, 2 * n), "a moved source: that sync packs tensor by tensor"
    sync(6)
    sync(7)
    assert (packing.built, unpacking.built) == (4 * n, 2 * n), "then the producer plans again, alone"
    kept.append(out["big"])
    out["big"] = torch.zeros_like(out["big"])  # the worker's tensor gets new storage
    sync(8)
    sync(9)
    sync(10)
    assert (packing.built, unpacking.built) == (4 * n, 4 * n), "a moved destination replans the consumer only"


def test_planned_slot_copies_stay_bit_exact_as_tensors_move() -> None:
    copier = HostCopier()
    _round_trip("cpu", copier)
    assert copier.rows_run > 0, "the planned rows must carry bytes, or nothing here is tested"


def test_pieces_the_kernel_cannot_take_are_copied_otherwise() -> None:
    sources = _tensors("cpu", 7)
    specs = [TensorSpec.of(n, t) for n, t in sources.items()]
    specs[-1] = TensorSpec(name="wide", shape=(64, 8), dtype="bfloat16")
    manifest = Manifest.build(specs, buffer_bytes=1 << 16, num_buffers=1)
    [chunk] = manifest.chunks
    plans = PackPlans(HostCopier(), manifest.specs)
    assert not plans.begin(plan_key(list(sources.values())))
    assert plans.begin(plan_key(list(sources.values())))
    buffer = torch.zeros(1 << 16, dtype=torch.uint8)
    plans.pack(chunk, 0, buffer, list(sources.values()), None)
    [plan] = plans._plans.values()
    names = {manifest.specs[chunk.pieces[p].spec_index].name for p in plan.batched}
    others = {manifest.specs[chunk.pieces[p].spec_index].name for p in plan.others}
    assert names == {"big", "aligned"}
    assert others == {"odd", "strided", "wide"}


class _Pair(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.inner = MixedModel(seed, big=3000)
        self.wide = nn.Parameter(random_tensor((300, 16), torch.float32, seed + 9))


def test_ipc_with_planned_copies_is_bit_exact_across_syncs_when_tensors_move() -> None:
    trainer, worker = _Pair(0), _Pair(1)
    sender = WeightSender(model=trainer)
    manifest = sender.manifest(SyncSettings(buffer_bytes=8192, num_buffers=2, timeout_s=20.0))
    receiver = WeightReceiver(worker, name="w")
    receiver.accept(manifest, timeout_s=20.0)
    open_local(registry.get("ipc"), sender, {"w": receiver})
    kept: list[torch.Tensor] = []
    try:
        send_half, receive_half = sender.half("ipc"), receiver.half("ipc")
        assert isinstance(send_half, IpcSender) and isinstance(receive_half, IpcReceiver)
        send_half.copier, receive_half.copier = HostCopier(), HostCopier()
        for seq in range(8):
            perturb(trainer, seq + 10)
            if seq == 2:
                kept.append(trainer.wide.data)
                trainer.wide.data = trainer.wide.data.clone()
            if seq == 3:
                kept.append(worker.inner.big.data)
                worker.inner.big.data = worker.inner.big.data.clone()
                worker.wide = nn.Parameter(torch.zeros(300, 16))  # a new tensor object under the same name
            call = SyncCall(seq=seq, version=seq + 1, verify=seq == 7)
            sent, got = both_sides(sender, receiver, call)
            if call.verify:  # the worker's checksums of what it holds against the trainer's
                receiver.commit(call, ok("w", "receive", got), None, ok("trainer", "send", sent))
            assert receiver.status() == (seq + 1, "committed"), (sent, got)
            want = dict(module_tensors(trainer))
            for name, tensor in module_tensors(worker):
                assert_bit_equal(tensor, want[name], f"sync {seq}: {name}")
        assert send_half.copier.rows_run > 0 and receive_half.copier.rows_run > 0
    finally:
        receiver.close_transports()
        sender.close_transports()


@pytest.mark.cuda
def test_planned_slot_copies_on_the_gpu_are_bit_exact_as_tensors_move() -> None:
    copier = BatchedCopier.create(torch.device("cuda", 0))
    assert copier is not None, "CuPy's kernel did not compile (see the log)"
    _round_trip("cuda", copier)
    torch.cuda.synchronize()
