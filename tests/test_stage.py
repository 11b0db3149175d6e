"""Staged syncs in one process: a sync lands in a stage, the model keeps its version until
the swap, and the swap is one copy (``weightsync.core.stage``; engines in test_vllm_staged.py).

Every check compares the worker's tensors with the trainer's (or with what the worker held
before) bit for bit, on random data of several dtypes and awkward sizes (``MixedModel``).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch

from tests.helpers import MixedModel, assert_bit_equal, both_sides, perturb, state_of
from tests.test_verify import SETTINGS, open_ipc
from weightsync import SettingsError, SyncInFlight, WeightReceiver, WeightSender
from weightsync.core import registry
from weightsync.core.local import open_local
from weightsync.core.sinks import LoadWeightsSink, ModuleSink, module_tensors
from weightsync.core.stage import Staging
from weightsync.core.wire import ChecksumMismatch, PeerAborted, SyncCall
from weightsync.core.wire.outcome import failed, ok


def assert_holds(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    for name, tensor in module_tensors(model):
        assert_bit_equal(tensor, state[name], name)


def test_a_staged_ipc_sync_leaves_the_model_alone_until_its_swap_then_swaps_in_one_copy() -> None:
    """Received with its commit chained: the worker is receiving, its model bit for bit the
    old one, the stage holds every byte (one allocation, on the device); the commit swaps it
    in under the gate (a reader holding the gate keeps the old weights until it lets go),
    reports where the stage was and how long readers waited, and releases the stage."""
    trainer, worker = MixedModel(seed=0), MixedModel(seed=1)
    before = state_of(worker)
    sink = ModuleSink(worker, stage="device")
    sender, receiver = open_ipc(trainer, sink)
    try:
        call = SyncCall(seq=0, version=1, chained=("w",))
        sent, got = both_sides(sender, receiver, call)
        assert receiver.status() == (None, "receiving")
        assert_holds(worker, before)
        assert got.stage is not None and got.stage.where == ("device",) and got.stage.swap_s == 0
        assert got.stage.part_bytes[0] >= sum(t.numel() * t.element_size() for _, t in module_tensors(trainer))
        assert sink.staging is not None and sink.staging.pending
        reader = receiver.reading()
        reader.acquire()
        done: list[Any] = []
        commit = threading.Thread(
            target=lambda: done.append(receiver.commit(call, ok("w", "receive", got), None, ok("t", "send", sent)))
        )
        commit.start()
        assert_holds(worker, before)  # the swap waits for the reader
        reader.release()
        commit.join(60)
        assert receiver.status() == (1, "committed")
        assert_holds(worker, state_of(trainer))
        (result,) = done
        assert result.stage is not None and result.stage.swap_s > 0 and result.held_off_s is not None
        assert sink.staging.stage is None and not sink.staging.pending  # nothing held between syncs
    finally:
        receiver.close_transports()
        sender.close_transports()


def test_a_staged_sync_refused_at_its_commit_never_touches_the_model() -> None:
    """A wrong reference checksum at a verified commit: the worker goes back to its version,
    committed (not dirty), bit for bit what it held; the next sync goes through."""
    trainer, worker = MixedModel(seed=0), MixedModel(seed=1)
    sender, receiver = open_ipc(trainer, ModuleSink(worker, stage="auto"))
    try:
        call = SyncCall(seq=0, version=1)
        both_sides(sender, receiver, call)
        assert receiver.status() == (1, "committed")
        held = state_of(worker)
        perturb(trainer, seed=7)
        call = SyncCall(seq=1, version=2, verify=True)
        sent, got = both_sides(sender, receiver, call)
        assert got.held == sent.tensor_checksums  # the stage holds what was sent
        wrong = ok("t", "send", dataclasses.replace(sent, tensor_checksums=[s + 1 for s in sent.tensor_checksums]))
        with pytest.raises(ChecksumMismatch):
            receiver.commit(call, ok("w", "receive", got), wrong, ok("t", "send", sent))
        assert receiver.status() == (1, "committed")
        assert_holds(worker, held)
        call = SyncCall(seq=2, version=2)
        both_sides(sender, receiver, call)
        assert receiver.status() == (2, "committed")
        assert_holds(worker, state_of(trainer))
    finally:
        receiver.close_transports()
        sender.close_transports()


def test_a_second_broadcast_sync_before_the_first_commits_is_refused_by_name_never_mixed() -> None:
    """Two broadcast syncs back to back with no commit between: the second is refused at
    the worker, naming it and the version still in flight, before any byte moves (the
    trainer is told at once, naming the worker); the first then commits, and the worker
    holds the trainer's first version bit for bit (the trainer changed every tensor in
    between)."""
    trainer, worker = MixedModel(seed=0), MixedModel(seed=1)
    sender = WeightSender(trainer)
    receiver = WeightReceiver(ModuleSink(worker, stage="device"), name="bw")
    receiver.accept(sender.manifest(SETTINGS), timeout_s=SETTINGS.timeout_s)
    open_local(registry.get("broadcast"), sender, {"bw": receiver})
    try:
        first = state_of(trainer)
        call = SyncCall(seq=0, version=1)
        sent, got = both_sides(sender, receiver, call)
        assert got.state == "receiving"
        perturb(trainer, 9)
        refused, second = both_sides(sender, receiver, SyncCall(seq=1, version=2))
        assert isinstance(second, SyncInFlight), second
        assert "bw" in str(second) and "version 2" in str(second) and "version 1" in str(second)
        assert isinstance(refused, PeerAborted) and "bw" in str(refused)
        receiver.commit(call, ok("bw", "receive", got), None, ok("trainer", "send", sent))
        assert receiver.status() == (1, "committed")
        assert_holds(worker, first)
    finally:
        receiver.close_transports()
        sender.close_transports()


def test_the_stage_goes_where_it_is_asked_and_stays_only_when_kept() -> None:
    """``host`` is reported as such (a CPU worker's host memory); ``keep_stage`` keeps one
    allocation across syncs (the same buffer), without it each sync allocates and releases;
    an unknown place is refused naming the setting."""
    trainer = MixedModel(seed=0)
    for place, keep in (("host", True), ("device", False)):
        worker = MixedModel(seed=1)
        sink = ModuleSink(worker, stage=place, keep_stage=keep)
        sender, receiver = open_ipc(trainer, sink)
        try:
            buffers = []
            for seq in range(2):
                got = both_sides(sender, receiver, SyncCall(seq=seq, version=seq + 1))[1]
                assert got.stage.where == (place,) and got.stage.kept is keep
                assert sink.staging is not None
                stage = sink.staging.stage
                assert (stage is not None) is keep
                buffers.append(stage.buffer.data_ptr() if stage is not None else None)
                perturb(trainer, seed=seq + 3)
            if keep:
                assert buffers[0] == buffers[1]
        finally:
            receiver.close_transports()
            sender.close_transports()
    with pytest.raises(SettingsError, match="stage"):
        ModuleSink(MixedModel(seed=1), stage="gpu")
    with pytest.raises(SettingsError, match="keep_stage"):
        Staging("auto", keep="yes")  # type: ignore[arg-type]


def test_a_staging_sink_takes_no_direct_writes() -> None:
    sink = ModuleSink(MixedModel(seed=1), stage="auto")
    manifest = WeightSender(MixedModel(seed=0)).manifest(SETTINGS)
    assert sink.allows_direct is False and sink.direct_tensors(manifest) is None
    assert ModuleSink(MixedModel(seed=1)).allows_direct is True


def test_an_engine_style_receiver_marks_a_staged_sync_ready_and_swaps_it_when_told() -> None:
    """``swap_later``: the commit checks and marks the sync ready without loading; the
    swap loads every tensor once, through load_weights; a failure before it leaves nothing."""
    trainer = MixedModel(seed=0)
    loads: list[dict[str, torch.Tensor]] = []

    def load(items: Any) -> None:
        loads.append({name: tensor.clone() for name, tensor in items})

    sender, receiver = open_ipc(trainer, LoadWeightsSink(load, staged=True))
    receiver.swap_later = True
    try:
        got = both_sides(sender, receiver, SyncCall(seq=0, version=1))[1]
        assert (got.state, receiver.ready, loads) == ("receiving", 1, [])
        assert receiver.swap() > 0 and receiver.status() == (1, "committed") and len(loads) == 1
        for name, tensor in module_tensors(trainer):
            assert_bit_equal(loads[0][name], tensor, name)
        with pytest.raises(Exception, match="no staged sync"):
            receiver.swap()
        both_sides(sender, receiver, SyncCall(seq=1, version=2))
        assert receiver.settle() == (1, "committed") and receiver.ready is None and len(loads) == 1
    finally:
        receiver.close_transports()
        sender.close_transports()


def test_a_new_setup_abandons_a_staged_sync_left_in_flight() -> None:
    trainer = MixedModel(seed=0)
    sender, receiver = open_ipc(trainer, ModuleSink(MixedModel(seed=1), stage="auto"))
    try:
        both_sides(sender, receiver, SyncCall(seq=0, version=1, chained=("w",)))
        assert receiver.status() == (None, "receiving")
        receiver.accept(sender.current_manifest)
        assert receiver.status() == (None, "committed")
    finally:
        receiver.close_transports()
        sender.close_transports()


def test_a_sender_that_failed_leaves_a_staging_worker_at_its_version_untouched() -> None:
    """The trainer's side failed after every byte was staged: the commit refuses, the worker
    is committed at its version (not dirty), its model bit for bit what it was, the stage gone."""
    trainer, worker = MixedModel(seed=0), MixedModel(seed=1)
    before = state_of(worker)
    sink = ModuleSink(worker, stage="device")
    sender, receiver = open_ipc(trainer, sink)
    try:
        call = SyncCall(seq=0, version=1, chained=("w",))
        got = both_sides(sender, receiver, call)[1]
        with pytest.raises(PeerAborted, match="trainer"):
            receiver.commit(call, ok("w", "receive", got), None, failed("trainer", "send", RuntimeError("gone")))
        assert receiver.status() == (None, "committed")
        assert_holds(worker, before)
        assert sink.staging is not None and sink.staging.stage is None
    finally:
        receiver.close_transports()
        sender.close_transports()
