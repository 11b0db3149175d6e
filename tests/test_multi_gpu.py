"""NCCL broadcast between GPUs (CuPy). Marked ``multi_gpu``: needs two or more GPUs."""

from __future__ import annotations

import os
from typing import Any

import pytest
import ray
import torch

from tests.test_cuda import GpuTrainer, GpuWorker
from tests.test_ray_e2e import assert_workers_match, get
from weightsync import SyncError, WeightSync
from weightsync.tools.models import PolicyFactory, train_step

pytestmark = [pytest.mark.cuda, pytest.mark.multi_gpu]


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def nccl_group(actors: Any, n_workers: int, size: str = "30mb") -> tuple[Any, list[Any]]:
    trainer = actors.add(
        ray.remote(GpuTrainer).options(num_cpus=0, num_gpus=1).remote(PolicyFactory(size, 0, "cuda"), device="cuda")
    )
    workers = [
        actors.add(
            ray.remote(GpuWorker)
            .options(num_cpus=0, num_gpus=1)
            .remote(PolicyFactory(size, i + 1, "cuda"), device="cuda")
        )
        for i in range(n_workers)
    ]
    return trainer, workers


@pytest.mark.parametrize("n_workers", [1, "max"])
def test_nccl_broadcast_is_bit_exact_after_training(n_workers: Any, actors: Any) -> None:
    n = gpus() - 1 if n_workers == "max" else n_workers
    trainer, workers = nccl_group(actors, n)
    with WeightSync(trainer, workers, buffer_bytes=8 << 20) as ws:
        assert set(ws.transports().values()) == {"broadcast"}
        for version in (1, 2, 3):
            get(trainer.call.remote(train_step, version))
            ws.sync(version)
            assert_workers_match(trainer, workers)


def test_nccl_memory_is_flat_over_50_syncs(actors: Any) -> None:
    trainer, workers = nccl_group(actors, 1, "100mb")
    with WeightSync(trainer, workers, buffer_bytes=16 << 20) as ws:
        ws.sync(1)
        first = [get(p.cuda_memory.remote()) for p in (trainer, *workers)]
        for version in range(2, 52):
            ws.sync(version)
        assert [get(p.cuda_memory.remote()) for p in (trainer, *workers)] == first


class DyingWorker(GpuWorker):
    def ws_receive(self, call: Any) -> Any:
        if call.version == 2:
            os._exit(5)
        return super().ws_receive(call)


def test_worker_killed_mid_broadcast_ends_in_a_named_error_not_a_hang(actors: Any) -> None:
    trainer = actors.add(
        ray.remote(GpuTrainer).options(num_cpus=0, num_gpus=1).remote(PolicyFactory("30mb", 0, "cuda"), device="cuda")
    )
    doomed = actors.add(
        ray.remote(DyingWorker).options(num_cpus=0, num_gpus=1).remote(PolicyFactory("30mb", 1, "cuda"), device="cuda")
    )
    ws = WeightSync(trainer, {"doomed": doomed}, buffer_bytes=8 << 20, timeout_s=20)
    ws.sync(1)
    with pytest.raises(SyncError) as info:
        ws.sync(2)
    assert "doomed" in str(info.value)
    get(trainer.call.remote(train_step, 3))  # the trainer is still usable


def test_mixed_sync_colocated_ipc_and_remote_nccl(actors: Any) -> None:
    trainer = actors.add(
        ray.remote(GpuTrainer).options(num_cpus=0, num_gpus=0.5).remote(PolicyFactory("30mb", 0, "cuda"), device="cuda")
    )
    local = actors.add(
        ray.remote(GpuWorker).options(num_cpus=0, num_gpus=0.5).remote(PolicyFactory("30mb", 1, "cuda"), device="cuda")
    )
    remote = actors.add(
        ray.remote(GpuWorker).options(num_cpus=0, num_gpus=1).remote(PolicyFactory("30mb", 2, "cuda"), device="cuda")
    )
    with WeightSync(
        trainer, {"local": local, "remote": remote}, transport={"local": "ipc", "remote": "auto"}, buffer_bytes=8 << 20
    ) as ws:
        assert ws.transports() == {"local": "ipc", "remote": "broadcast"}
        for version in (1, 2):
            get(trainer.call.remote(train_step, version))
            report = ws.sync(version)
            assert report.transports == {"ipc": 1, "broadcast": 1}
            assert_workers_match(trainer, [local, remote])
