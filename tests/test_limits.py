"""Bounds that keep a setting from costing what it cannot use: buffers never outnumber the
chunks of a plan, and a plan's chunk count is bounded with an error naming the setting."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import MixedModel, assert_bit_equal, both_sides
from weightsync import WeightReceiver, WeightSender
from weightsync.core import registry
from weightsync.core.local import open_local
from weightsync.core.sinks import module_tensors
from weightsync.core.wire import Manifest, SettingsError, SyncCall, SyncSettings, TensorSpec
from weightsync.core.wire.manifest import MAX_CHUNKS
from weightsync.core.wire.session import Session
from weightsync.transports.broadcast.halves import BroadcastSender
from weightsync.transports.ipc.halves import IpcSender

HUGE = 10**5


def _session(manifest: Manifest) -> Session:
    return Session(manifest=manifest, party="trainer", server="trainer", timeout_s=5.0)


def test_broadcast_and_ipc_allocate_no_more_buffers_than_chunks() -> None:
    specs = [TensorSpec(name=f"t{i}", shape=(100,), dtype="float32") for i in range(5)]
    manifest = Manifest.build(specs, buffer_bytes=1024, num_buffers=HUGE, inplace_bytes=0)
    assert 1 < len(manifest.chunks) < 10
    assert manifest.depth(manifest.chunks) == len(manifest.chunks)
    comm = SimpleNamespace(world_size=2, rank=0, device=torch.device("cpu"))
    half = BroadcastSender(comm, _session(manifest), ["trainer", "w"])  # type: ignore[arg-type]
    assert len(half.buffers()) == len(manifest.broadcast_chunks)
    ipc = IpcSender(_session(manifest), torch.device("cpu"))
    try:
        export = ipc.export(["w"])
        assert export.num_slots == len(manifest.chunks)
        assert export.slots.nbytes == len(manifest.chunks) * manifest.agreed.buffer_bytes
    finally:
        ipc.close()


def test_an_ipc_sync_with_a_huge_num_buffers_is_bit_exact() -> None:
    trainer, worker = MixedModel(seed=0), MixedModel(seed=1)
    sender = WeightSender(model=trainer)
    manifest = sender.manifest(SyncSettings(buffer_bytes=4096, num_buffers=HUGE, timeout_s=20.0))
    receiver = WeightReceiver(worker, name="w")
    receiver.accept(manifest, timeout_s=20.0)
    open_local(registry.get("ipc"), sender, {"w": receiver})
    try:
        _, got = both_sides(sender, receiver, SyncCall(seq=0, version=1))
        assert receiver.status() == (1, "committed"), got
        want = dict(module_tensors(trainer))
        for name, tensor in module_tensors(worker):
            assert_bit_equal(tensor, want[name], name)
    finally:
        receiver.close_transports()
        sender.close_transports()


def test_a_plan_of_too_many_chunks_is_refused_naming_buffer_bytes() -> None:
    big = [TensorSpec(name="embed", shape=(MAX_CHUNKS, 8), dtype="float32")]  # 32 MiB, no bytes allocated
    with pytest.raises(SettingsError, match="buffer_bytes=16") as refused:
        Manifest.build(big, buffer_bytes=16, num_buffers=2, alignment=16)
    assert str(MAX_CHUNKS) in str(refused.value)
    assert len(Manifest.build(big, buffer_bytes=1 << 20, num_buffers=2).chunks) == 32


def test_a_manifest_of_many_tiny_tensors_is_small_and_checked_again_on_arrival() -> None:
    """Per tensor a manifest holds one spec and, without in-place tensors, one plan shared
    by ipc and broadcast (sent once); what arrives is rebuilt through the constructors."""
    n = 2000
    specs = [TensorSpec(name=f"layers.{i}.w", shape=(4,), dtype="float32") for i in range(n)]
    manifest = Manifest.build(specs, buffer_bytes=1 << 20, num_buffers=2)
    assert manifest.broadcast_chunks is manifest.chunks
    blob = pickle.dumps(manifest)
    assert len(blob) < 80 * n, f"{len(blob) / n:.0f} bytes per tensor"  # was 124 with two plans
    arrived = pickle.loads(blob)
    assert arrived == manifest and arrived.broadcast_chunks is arrived.chunks
    arrived.validate()
    with pytest.raises(ValueError, match="float99"):
        pickle.loads(blob.replace(b"float32", b"float99", 1))
    inplace = Manifest.build([*specs[:3], TensorSpec(name="big", shape=(1 << 20,), dtype="float32")], 1 << 20, 2)
    assert inplace.broadcast_chunks != inplace.chunks and inplace.inplace_count == 1
