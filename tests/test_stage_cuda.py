"""Staged syncs on a GPU: the stage on the device or in pinned host memory, the swap one copy.

Marked ``cuda``: skipped without a GPU; run on the GPU test machine. In one process, a module
sink's stage is filled the way a transport fills it and swapped in (bit for bit, the stage
released after the swap unless kept); then a real ipc sync between two Ray actors on one
GPU into a staging worker. The swap's speed against one raw device copy is the bench's
(``python3 -m weightsync bench --device cuda --sizes 16gb --transports staged``); these
tests print it for their own size.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import pytest
import torch

from tests.helpers import MixedModel, assert_bit_equal, perturb, state_of
from weightsync import WeightSender
from weightsync.core.sinks import ModuleSink, module_tensors
from weightsync.core.stage import resolve_place
from weightsync.core.wire import SyncSettings
from weightsync.tools.models import PolicyFactory

pytestmark = pytest.mark.cuda


def fill_and_swap(model: torch.nn.Module, sink: ModuleSink, source: torch.nn.Module) -> float:
    """What a staged sync does to a worker: the transport writes every tensor of ``source``
    into the stage, the stage is sealed, the commit swaps it in; returns the swap's seconds."""
    manifest = WeightSender(model=source).manifest(SyncSettings())
    views = sink.destinations(manifest)
    with torch.no_grad():
        for view, (_, tensor) in zip(views, module_tensors(source)):
            assert view is not None
            view.copy_(tensor)
    torch.cuda.synchronize()  # as a transport's receive drains its streams before it returns
    sink.seal()
    assert sink.staging is not None
    sink.land()
    return sink.staging.swap_s


@pytest.mark.parametrize("place", ["device", "host", "auto"])
def test_a_module_sink_stages_on_the_gpu_or_pinned_host_and_swaps_bit_exact(place: str) -> None:
    worker = MixedModel(seed=1).cuda()
    source = MixedModel(seed=0).cuda()
    sink = ModuleSink(worker, stage=place)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    swap_s = fill_and_swap(worker, sink, source)
    assert swap_s > 0
    for (name, got), (_, want) in zip(module_tensors(worker), module_tensors(source)):
        assert_bit_equal(got, want, name)
    assert sink.staging is not None
    report = sink.staging.report()
    assert report is not None and report.where == ("host" if place == "host" else "device",)
    assert sink.staging.stage is None  # released: nothing held between syncs
    torch.cuda.synchronize()
    # What stays is the swap's copy plan (a small table of addresses), not the stage.
    assert torch.cuda.memory_allocated() - before < report.part_bytes[0] // 8


def test_a_kept_stage_stays_allocated_and_is_reused() -> None:
    worker, source = MixedModel(seed=1).cuda(), MixedModel(seed=0).cuda()
    sink = ModuleSink(worker, stage="device", keep_stage=True)
    fill_and_swap(worker, sink, source)
    assert sink.staging is not None and sink.staging.stage is not None
    pointer = sink.staging.stage.buffer.data_ptr()
    perturb(source, seed=4)
    fill_and_swap(worker, sink, source)
    assert sink.staging.stage.buffer.data_ptr() == pointer
    assert_bit_equal(state_of(worker)["big"], state_of(source)["big"], "big")


def test_auto_stages_in_pinned_host_memory_when_the_device_lacks_room() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    free, _ = torch.cuda.mem_get_info(device)
    assert resolve_place("auto", device, 1 << 20) == "device"
    assert resolve_place("auto", device, free) == "host"  # no room to spare beside it


def test_the_swap_of_a_policy_against_one_raw_device_copy() -> None:
    """A 1 GB policy: bit-exact swap from a device stage; prints its time against one raw
    copy of the same bytes (the 16 GB figure is the bench's)."""
    model = PolicyFactory("1gb", seed=1, device="cuda")().cuda()
    source = PolicyFactory("1gb", seed=2, device="cuda")().cuda()
    sink = ModuleSink(model, stage="device")
    swaps = [fill_and_swap(model, sink, source) for _ in range(4)][1:]
    nbytes = sum(t.numel() * t.element_size() for _, t in module_tensors(model))
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copies = []
    for _ in range(4):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - start)
    swap, copy = sorted(swaps)[1], sorted(copies[1:])[1]
    print(
        f"staged swap of {nbytes / 1e9:.2f} GB: {swap * 1e3:.2f} ms; one raw device copy {copy * 1e3:.2f} ms ({swap / copy:.2f}x)"
    )
    for (name, got), (_, want) in zip(module_tensors(model), module_tensors(source)):
        assert torch.equal(got, want), name


def test_a_staging_worker_takes_an_ipc_sync_on_one_gpu(actors: Any) -> None:
    """Trainer and staging worker on one GPU (0.5 each), CUDA IPC into a device stage, then
    the swap: the worker holds the trainer's tensors bit for bit, and the report says so."""
    from tests.test_ray_e2e import assert_workers_match, get
    from weightsync import TrainerActor, WeightSync, WorkerActor

    trainer = actors.add(
        TrainerActor.options(num_cpus=0, num_gpus=0.5).remote(functools.partial(MixedModel, 0), device="cuda")
    )
    worker = actors.add(
        WorkerActor.options(num_cpus=0, num_gpus=0.5).remote(
            functools.partial(MixedModel, 1), device="cuda", stage="device"
        )
    )
    with WeightSync(trainer, [worker], transport="ipc", timeout_s=120) as ws:
        for version in (1, 2):
            get(trainer.call.remote(perturb, version))
            report = ws.sync(version)
            (w,) = report.workers
            assert (w.version, w.state) == (version, "committed") and w.stage is not None
            assert w.stage.where == ("device",) and w.stage.swap_s > 0
            assert_workers_match(trainer, [worker])
