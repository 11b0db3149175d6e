"""``verify`` means the destination: what each worker's sink holds after loading, compared
with one reference (the trainer's checksums; rank 0's for a sharded trainer's ranks).

In-process endpoints (no Ray): ipc through ``open_local`` and broadcast over a gloo group
of threads; the sharded case runs over FSDP2 ranks in tests/test_sharded.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.helpers import MixedModel, assert_bit_equal, both_sides, perturb
from tests.test_inplace import run_group
from weightsync import WeightReceiver, WeightSender
from weightsync.core import registry
from weightsync.core.checking import check_destination, compare_checksums
from weightsync.core.local import open_local
from weightsync.core.sinks import LoadWeightsSink, ModuleSink, module_tensors
from weightsync.core.wire import ChecksumMismatch, Manifest, ManifestError, SyncCall, SyncSettings
from weightsync.core.wire.errors import VerificationError, WeightSyncError
from weightsync.core.wire.messages import SendResult
from weightsync.core.wire.outcome import ok

SETTINGS = SyncSettings(buffer_bytes=4096, num_buffers=2, timeout_s=20.0)


class ElsewhereSink(ModuleSink):
    """A sink with a bug: it unpacks ``lost`` into a scratch copy, never into the model."""

    def __init__(self, module: nn.Module, lost: str) -> None:
        super().__init__(module)
        self.lost = lost

    def destinations(self, manifest: Manifest) -> list[torch.Tensor | None]:
        dests = super().destinations(manifest)
        index = manifest.names.index(self.lost)
        dests[index] = torch.empty_like(self._order[index])
        return dests


def open_ipc(trainer: nn.Module, sink: Any, name: str = "w") -> tuple[WeightSender, WeightReceiver]:
    sender = WeightSender(model=trainer)
    manifest = sender.manifest(SETTINGS)
    receiver = WeightReceiver(sink, name=name)
    receiver.accept(manifest, timeout_s=SETTINGS.timeout_s)
    open_local(registry.get("ipc"), sender, {name: receiver})
    return sender, receiver


def test_a_verified_ipc_sync_refuses_bytes_that_never_reached_the_weights() -> None:
    """The transport's buffer checks out, the worker's weight does not hold the bytes."""
    trainer, worker = MixedModel(seed=0), MixedModel(seed=1)
    lost = "linear.weight"
    sender, receiver = open_ipc(trainer, ElsewhereSink(worker, lost))
    try:
        call = SyncCall(seq=0, version=1, verify=True)
        sent, got = both_sides(sender, receiver, call)
        assert receiver.status() == (None, "receiving")  # with verify, no commit before the check
        with pytest.raises(ChecksumMismatch) as failure:
            receiver.commit(call, ok("w", "receive", got), None, ok("trainer", "send", sent))
        assert lost in str(failure.value) and "w" in failure.value.blames
        assert receiver.status() == (None, "dirty")
        # Every other tensor did land, bit for bit.
        want = dict(module_tensors(trainer))
        for name, tensor in module_tensors(worker):
            if name != lost:
                assert_bit_equal(tensor, want[name], name)
    finally:
        receiver.close_transports()
        sender.close_transports()


def test_a_verified_ipc_sync_commits_what_landed_and_a_plain_one_commits_at_once() -> None:
    trainer, worker = MixedModel(seed=0), MixedModel(seed=1)
    sender, receiver = open_ipc(trainer, ModuleSink(worker))
    try:
        plain = SyncCall(seq=0, version=1)
        _, got = both_sides(sender, receiver, plain)
        assert got.held is None and receiver.status() == (1, "committed")
        perturb(trainer, seed=5)
        checked = SyncCall(seq=1, version=2, verify=True)
        sent, got = both_sides(sender, receiver, checked)
        assert got.held == sent.tensor_checksums and len(got.held) == len(sender.current_manifest.specs)
        receiver.commit(checked, ok("w", "receive", got), None, ok("trainer", "send", sent))
        assert receiver.status() == (2, "committed")
        want = dict(module_tensors(trainer))
        for name, tensor in module_tensors(worker):
            assert_bit_equal(tensor, want[name], name)
    finally:
        receiver.close_transports()
        sender.close_transports()


def test_a_verified_broadcast_refuses_bytes_that_never_reached_the_weights() -> None:
    model = MixedModel(seed=0)
    sender = WeightSender(model)
    sender.manifest(SETTINGS)
    worker = MixedModel(seed=2)
    [res] = run_group(
        sender,
        [WeightReceiver(ElsewhereSink(worker, "after_odd"), name="bw")],
        [SyncCall(seq=0, version=1, verify=True)],
    )
    assert isinstance(res[0], ChecksumMismatch), res[0]
    assert "after_odd" in str(res[0]) and "bw" in str(res[0])


def test_a_worker_model_on_the_meta_device_is_refused_at_the_handshake_by_name() -> None:
    sender = WeightSender(MixedModel(seed=0))
    manifest = sender.manifest(SETTINGS)
    with torch.device("meta"):
        ghost = MixedModel(seed=1)
    receiver = WeightReceiver(ghost, name="ghost")
    with pytest.raises(ManifestError) as failure:
        receiver.accept(manifest)
    assert "meta" in str(failure.value) and "linear.weight" in str(failure.value)
    # Half on meta: only those are named.
    partly = MixedModel(seed=1)
    partly.linear.weight = nn.Parameter(torch.empty(partly.linear.weight.shape, device="meta"))
    with pytest.raises(ManifestError, match=r"1 tensor\(s\).*linear\.weight"):
        WeightReceiver(partly, name="partly").accept(manifest)


def test_verify_with_a_load_weights_sink_checks_the_bytes_it_was_handed() -> None:
    trainer = MixedModel(seed=0)
    handed: dict[str, torch.Tensor] = {}

    def load(items: Any) -> None:
        for name, tensor in items:
            handed[name] = tensor.clone()

    sender, receiver = open_ipc(trainer, LoadWeightsSink(load))
    try:
        call = SyncCall(seq=0, version=1, verify=True)
        sent, got = both_sides(sender, receiver, call)
        receiver.commit(call, ok("w", "receive", got), None, ok("trainer", "send", sent))
        assert receiver.status() == (1, "committed")
        for name, tensor in module_tensors(trainer):
            assert_bit_equal(handed[name], tensor, name)
    finally:
        receiver.close_transports()
        sender.close_transports()
    # A sink that records nothing cannot be verified: refused before any byte, by name.
    sender, receiver = open_ipc(trainer, LoadWeightsSink(load, record_checksums=False), name="blind")
    try:
        sent, got = both_sides(sender, receiver, SyncCall(seq=0, version=1, verify=True))
        assert isinstance(got, WeightSyncError) and "record_checksums" in str(got), got
        assert isinstance(sent, WeightSyncError) and "blind" in str(sent)  # told at once, by name
        assert receiver.status() == (None, "committed")
    finally:
        receiver.close_transports()
        sender.close_transports()


def test_a_staging_sink_loads_only_a_committed_sync_and_a_refused_one_never() -> None:
    """``LoadWeightsSink(staged=True)``: the tensors of a sync reach ``load_weights`` once,
    all together, as it commits (the worker is ``receiving`` until then, so an engine holds
    generation off); a sync refused at its commit never reaches it, and the worker keeps
    its version, committed (not dirty: its model was never touched), and the checksums of
    what it holds."""
    trainer = MixedModel(seed=0)
    loads: list[dict[str, torch.Tensor]] = []

    def load(items: Any) -> None:
        loads.append({name: tensor.clone() for name, tensor in items})

    sink = LoadWeightsSink(load, staged=True)
    sender, receiver = open_ipc(trainer, sink)
    try:
        call = SyncCall(seq=0, version=1, verify=True)
        sent, got = both_sides(sender, receiver, call)
        assert loads == [] and receiver.status() == (None, "receiving")  # received, nothing loaded yet
        with pytest.raises(WeightSyncError, match="staged"):
            sink.set_staged(False)  # not between a receive and its commit
        receiver.commit(call, ok("w", "receive", got), None, ok("trainer", "send", sent))
        assert receiver.status() == (1, "committed") and len(loads) == 1  # one load, every tensor
        for name, tensor in module_tensors(trainer):
            assert_bit_equal(loads[0][name], tensor, name)
        held = receiver.checksums()
        assert held == sent.tensor_checksums
        perturb(trainer, seed=5)
        call = SyncCall(seq=1, version=2, verify=True)
        sent, got = both_sides(sender, receiver, call)
        wrong = [s + 1 for s in sent.tensor_checksums]  # a reference the bytes cannot match
        with pytest.raises(ChecksumMismatch):
            receiver.commit(call, ok("w", "receive", got), _sent("trainer", wrong), ok("trainer", "send", sent))
        assert receiver.status() == (1, "committed") and len(loads) == 1, "a refused sync reached load_weights"
        assert receiver.checksums() == held  # what it holds: version 1's bytes, not the refused ones
    finally:
        receiver.close_transports()
        sender.close_transports()


def _sent(party: str, sums: list[int]) -> Any:
    return ok(party, "send", SendResult(tensor_checksums=sums))


def test_a_replica_that_differs_from_the_reference_rank_is_blamed_on_its_rank() -> None:
    names = ["embed", "scale", "head"]
    rank0, rank1 = _sent("trainer-rank-0", [1, 2, 3]), _sent("trainer-rank-1", [1, 9, 3])
    check_destination("w0", names, [1, 2, 3], rank0, rank0)  # rank 0's worker: fine
    with pytest.raises(ChecksumMismatch) as failure:
        check_destination("w1", names, [1, 9, 3], rank1, rank0)  # landed as sent, but rank 1 diverged
    text = str(failure.value)
    assert "scale" in text and "trainer-rank-1" in text and "trainer-rank-0" in text and "w1" in text
    assert failure.value.blames == ("trainer-rank-1",)
    with pytest.raises(ChecksumMismatch) as landed:
        check_destination("w1", names, [1, 2, 7], rank1, rank0)  # head never landed: the worker's
    assert "head" in str(landed.value) and landed.value.blames == ("w1",)
    # WeightSync.verify() names the ranks whose replicas differ from rank 0's.
    outcomes = [ok("trainer-rank-0", "checksums", [1, 2, 3]), ok("trainer-rank-1", "checksums", [1, 9, 3])]
    with pytest.raises(VerificationError) as verified:
        compare_checksums(outcomes, {"w0": ok("w0", "checksums", [1, 2, 3])}, names)
    assert verified.value.mismatches == {"trainer-rank-1": "scale"}
