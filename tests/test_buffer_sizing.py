"""``buffer_bytes="auto"`` on a GPU whose slots are all filled and drained on one device:
the memory of ``num_buffers`` slots in one slot (the two processes' kernels are
time-sliced there, so a second slot overlaps nothing); everywhere else, unchanged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from weightsync import WeightSender
from weightsync.core import registry
from weightsync.core.plugin import Slots
from weightsync.core.wire import SettingsError, SyncSettings
from weightsync.core.wire.manifest import TensorSpec
from weightsync.core.wire.settings import GIB, MIB
from weightsync.core.wire.sizing import CPU_KNEE_BYTES, CUDA_KNEE_BYTES, BufferHints, resolve_buffers
from weightsync.glue.setup import slots_on_one_device

# An 8B-shaped model's worth of specs (no memory: shapes only): 16 tensors of 1 GiB of bf16.
BIG = [TensorSpec(f"layer{i}.weight", (32768, 16384), "bfloat16") for i in range(16)]
ONE_GPU = BufferHints(device="cuda", one_device=True)


def test_one_gpu_puts_the_memory_of_every_slot_into_one() -> None:
    assert resolve_buffers("auto", BIG, 2, 256, ONE_GPU) == (2 * CUDA_KNEE_BYTES, 1)
    assert resolve_buffers("auto", BIG, 3, 256, ONE_GPU) == (3 * CUDA_KNEE_BYTES, 1)
    # A model smaller than that is one chunk in one slot, as big as it needs.
    small = BIG[:3]
    size, count = resolve_buffers("auto", small, 2, 256, ONE_GPU)
    assert count == 1 and size == sum(s.nbytes for s in small)


def test_one_gpu_slot_is_capped_by_a_quarter_of_the_least_free_memory() -> None:
    tight = BufferHints(device="cuda", one_device=True, free_bytes=(80 * GIB, 8 * GIB))
    assert resolve_buffers("auto", BIG, 2, 256, tight) == (2 * GIB, 1)


def test_slots_elsewhere_keep_their_count_and_the_knee() -> None:
    # A transport that overlaps packing with a move (broadcast) among the session's.
    assert resolve_buffers("auto", BIG, 2, 256, BufferHints(device="cuda")) == (CUDA_KNEE_BYTES, 2)
    # On a CPU producer and consumer run on cores of their own: slots rotate.
    assert resolve_buffers("auto", BIG, 2, 256, BufferHints(device="cpu", one_device=True)) == (CPU_KNEE_BYTES, 2)
    # An explicit size always wins, with the count given.
    assert resolve_buffers(64 * MIB, BIG, 2, 256, ONE_GPU) == (64 * MIB, 2)


def test_the_manifest_carries_the_one_slot() -> None:
    sender = WeightSender(torch.nn.Linear(64, 32))
    manifest = sender.manifest(SyncSettings(), ONE_GPU)
    assert manifest.agreed.num_buffers == 1
    assert manifest.depth(manifest.chunks) == 1
    explicit = sender.manifest(SyncSettings(buffer_bytes=4096, num_buffers=3), ONE_GPU)
    assert explicit.agreed.num_buffers == 3 and explicit.agreed.buffer_bytes == 4096


def test_which_sessions_fill_and_drain_every_slot_on_one_device() -> None:
    assert slots_on_one_device(["ipc"])
    assert slots_on_one_device(["ipc", "direct", "ipc"])  # direct has no slots
    assert not slots_on_one_device(["ipc", "broadcast"])
    assert not slots_on_one_device(["direct"])  # no slots at all: nothing to size
    assert not slots_on_one_device([])


def test_bad_one_device_hint_is_refused_naming_it() -> None:
    with pytest.raises(SettingsError, match="one_device"):
        BufferHints(device="cuda", one_device="yes")  # type: ignore[arg-type]


def test_a_transport_declaring_slots_wrongly_is_refused_naming_it_and_the_choices() -> None:
    with pytest.raises(SettingsError, match=r"'ipc'.*slots.*Slots\.ONE_DEVICE"):
        dataclasses.replace(registry.get("ipc"), slots="one device")
    assert registry.get("ipc").slots is Slots.ONE_DEVICE and registry.get("direct").slots is Slots.NONE
