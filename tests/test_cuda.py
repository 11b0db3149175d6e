"""CUDA IPC and direct transports on one GPU (trainer and workers at 0.5 GPU each).

Marked ``cuda``: skipped without a GPU; run on the H200 test machine (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import ray
import torch
from torch import nn

from tests.helpers import MixedModel, assert_bit_equal, bytes_state_of, perturb, random_tensor, state_of
from tests.test_ray_e2e import assert_workers_match, get
from weightsync import SyncError, WeightSync
from weightsync.core.sinks import module_tensors
from weightsync.core.wire import ALLOWED_DTYPES, dtype_name
from weightsync.glue.actors import TrainerHost, WorkerHost
from weightsync.tools.models import PolicyFactory, train_step

pytestmark = pytest.mark.cuda


class AllDtypes(nn.Module):
    """One tensor of every allowed dtype, odd sizes, on the GPU."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        for i, dtype in enumerate(ALLOWED_DTYPES.values()):
            self.register_buffer(f"t_{dtype_name(dtype)}", random_tensor((37, 11 + i), dtype, seed * 100 + i))
        self.register_buffer("scalar", random_tensor((), torch.float32, seed))
        self.register_buffer("empty", torch.empty(0, 3))


class GpuTrainer(TrainerHost):
    def cuda_memory(self) -> tuple[int, int]:
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved(), torch.cuda.memory_allocated()

    def stream_cache(self) -> int:
        from weightsync.mechanisms.streams import _cuda_streams

        return _cuda_streams.cache_info().currsize

    def write_slowly_then_sync_nothing(self, seed: int) -> None:
        """Queue a long kernel chain on the caller's stream ending in a parameter write,
        and return without synchronizing: a sync must wait for it (vllm-ascend #12713)."""
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):
            big = big @ big
            big = big / big.norm()
        with torch.no_grad():
            for i, (_, t) in enumerate(sorted(self.model.state_dict().items())):
                t.copy_(random_tensor(tuple(t.shape), t.dtype, seed * 1000 + i).to("cuda", non_blocking=True))
                t.view(-1)[:1].copy_(t.view(-1)[:1] + (big[0, 0] * 0).to(t.dtype))

    def pid(self) -> int:
        return os.getpid()


class GpuWorker(WorkerHost):
    def cuda_memory(self) -> tuple[int, int]:
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved(), torch.cuda.memory_allocated()

    def importer_counts(self) -> tuple[int, int]:
        return self._ws_receiver.ipc_import_counts()

    def direct_exports(self) -> int:
        return self._ws_receiver.half("direct").exports_made

    def swap_parameter_storage(self) -> int:
        """Replace one parameter's storage (as a reload with assign=True would)."""
        param = next(p for n, p in self.model.named_parameters() if n.endswith("qkv.weight"))
        old = param.data_ptr()
        param.data = param.data.clone()
        assert param.data_ptr() != old
        return param.data_ptr()

    def pid(self) -> int:
        return os.getpid()


def gpu_pair(actors: Any, factory: Any, n_workers: int = 1, worker_factory: Any = None) -> tuple[Any, list[Any]]:
    opts = {"num_cpus": 0, "num_gpus": 1 / (n_workers + 1)}
    trainer = actors.add(ray.remote(GpuTrainer).options(**opts).remote(factory, device="cuda"))
    workers = [
        actors.add(ray.remote(GpuWorker).options(**opts).remote(worker_factory or factory, device="cuda"))
        for _ in range(n_workers)
    ]
    return trainer, workers


@pytest.mark.parametrize("num_buffers", [1, 2])
def test_cuda_ipc_round_trips_every_dtype_over_many_chunks(num_buffers: int, actors: Any) -> None:
    trainer, workers = gpu_pair(
        actors, functools.partial(AllDtypes, seed=0), worker_factory=functools.partial(AllDtypes, seed=1)
    )
    with WeightSync(trainer, workers, transport="ipc", buffer_bytes=2048, num_buffers=num_buffers) as ws:
        assert len(ws.manifest.chunks) > 4  # type: ignore[union-attr]
        for version in (1, 2, 3):
            get(trainer.call.remote(perturb, version))
            ws.sync(version)
            expected = get(trainer.call.remote(bytes_state_of))
            got = get(workers[0].call.remote(bytes_state_of))
            assert got.keys() == expected.keys()
            for name, (dtype, shape, raw) in expected.items():
                assert got[name][:2] == (dtype, shape), name
                assert torch.equal(got[name][2], raw), name
        assert get(workers[0].importer_counts.remote()) == (2, 0)
    assert get(workers[0].importer_counts.remote()) == (2, 2)


def test_importer_maps_once_and_releases_once(actors: Any) -> None:
    trainer, workers = gpu_pair(
        actors, functools.partial(MixedModel, seed=0), worker_factory=functools.partial(MixedModel, seed=1)
    )
    ws = WeightSync(trainer, workers, transport="ipc", buffer_bytes=1024)
    ws.setup()
    for version in range(1, 6):
        ws.sync(version)
    assert get(workers[0].importer_counts.remote()) == (2, 0)  # slots + control block, mapped once
    ws.close()
    assert get(workers[0].importer_counts.remote()) == (2, 2)  # and each released once


def test_handle_for_another_gpu_is_refused_with_a_clear_error() -> None:
    from weightsync.core.wire import CudaIpcHandle, DeviceMismatch
    from weightsync.mechanisms.cuda_ipc import map_cuda_ipc

    handle = CudaIpcHandle(
        gpu_uuid="GPU-00000000-0000-0000-0000-000000000000", rebuild_args=tuple(range(15)), nbytes=1024, session="s"
    )
    with pytest.raises(DeviceMismatch, match="GPU-00000000-0000-0000-0000-000000000000, which is not visible here"):
        map_cuda_ipc(handle, "worker-3")


@pytest.mark.parametrize("transport", ["ipc", "direct"])
def test_gpu_memory_is_flat_across_50_syncs_on_both_sides(transport: str, actors: Any) -> None:
    # vLLM gh-52950: fresh streams per call stranded ~2 GB of reserved memory per sync.
    trainer, workers = gpu_pair(
        actors, PolicyFactory("100mb", 0, "cuda"), worker_factory=PolicyFactory("100mb", 1, "cuda")
    )
    with WeightSync(trainer, workers, transport=transport, buffer_bytes=16 << 20) as ws:
        # The first syncs build what every later one reuses (ipc's copy tables, a few KiB on
        # each side, come with the second): measure from the third on.
        for version in (1, 2, 3):
            ws.sync(version)
        streams = get(trainer.stream_cache.remote())
        first = [get(p.cuda_memory.remote()) for p in (trainer, *workers)]
        for version in range(4, 54):
            ws.sync(version)
        last = [get(p.cuda_memory.remote()) for p in (trainer, *workers)]
        assert last == first, f"reserved/allocated moved: {first} -> {last}"
        assert get(trainer.stream_cache.remote()) == streams
        assert_workers_match(trainer, workers)


@pytest.mark.parametrize("transport", ["ipc", "direct"])
def test_ray_path_at_half_a_gpu_each_with_training_between_syncs(transport: str, actors: Any) -> None:
    trainer, workers = gpu_pair(
        actors, PolicyFactory("30mb", 0, "cuda"), worker_factory=PolicyFactory("30mb", 1, "cuda")
    )
    with WeightSync(trainer, workers, buffer_bytes=4 << 20, transport=transport) as ws:
        assert ws.transports() == {"worker-0": transport}
        losses = []
        for version in (1, 2, 3):
            losses.append(get(trainer.call.remote(train_step, version)))
            report = ws.sync(version)
            assert report.workers[0].version == version
            assert_workers_match(trainer, workers)
        assert ws.verify()
        for w in workers:
            assert get(w.call.remote(lambda m: m.head.weight.data_ptr() == m.embed.weight.data_ptr()))


def test_auto_picks_direct_on_a_shared_gpu_and_refuses_nccl_there(actors: Any) -> None:
    trainer, workers = gpu_pair(actors, PolicyFactory("1mb", 0, "cuda"), worker_factory=PolicyFactory("1mb", 1, "cuda"))
    with WeightSync(trainer, workers) as ws:
        assert ws.transports() == {"worker-0": "direct"}
    from weightsync import SetupError

    with pytest.raises(SetupError, match="NCCL refuses two ranks on one GPU"):
        WeightSync(trainer, workers, transport="broadcast").setup()


def test_auto_buffers_on_one_gpu_make_one_ipc_slot_and_sync_bit_exact(actors: Any) -> None:
    """Both sides of ipc copy on the one GPU, whose kernels they share by time slices: "auto"
    gives the memory of the two default slots to one; an explicit size keeps its count."""
    trainer, workers = gpu_pair(
        actors, PolicyFactory("100mb", 0, "cuda"), worker_factory=PolicyFactory("100mb", 1, "cuda")
    )
    with WeightSync(trainer, workers, transport="ipc") as ws:
        manifest = ws.setup()
        assert manifest.agreed.num_buffers == 1
        assert manifest.agreed.buffer_bytes >= manifest.total_bytes and len(manifest.chunks) == 1
        ws.sync(1)
        assert_workers_match(trainer, workers)
    with WeightSync(trainer, workers, transport="ipc", buffer_bytes=16 << 20) as ws:
        manifest = ws.setup()
        assert manifest.agreed.num_buffers == 2 and len(manifest.chunks) > 2
        get(trainer.call.remote(lambda m: train_step(m, 1)))
        ws.sync(2)
        assert_workers_match(trainer, workers)


@pytest.mark.parametrize("transport", ["ipc", "direct"])
def test_packing_waits_for_the_callers_stream(transport: str, actors: Any) -> None:
    trainer, workers = gpu_pair(
        actors, functools.partial(MixedModel, seed=0), worker_factory=functools.partial(MixedModel, seed=1)
    )
    with WeightSync(trainer, workers, transport=transport, buffer_bytes=1024) as ws:
        for version in (1, 2):
            ray.get(trainer.write_slowly_then_sync_nothing.remote(version), timeout=120)
            ws.sync(version)
            assert_workers_match(trainer, workers)


def test_direct_reexports_a_swapped_parameter_and_never_writes_stale(actors: Any) -> None:
    trainer, workers = gpu_pair(actors, PolicyFactory("1mb", 0, "cuda"), worker_factory=PolicyFactory("1mb", 1, "cuda"))
    with WeightSync(trainer, workers, transport="direct") as ws:
        get(trainer.call.remote(train_step, 1))
        ws.sync(1)
        assert get(workers[0].direct_exports.remote()) == 1
        get(workers[0].swap_parameter_storage.remote())
        get(trainer.call.remote(train_step, 2))
        ws.sync(2)
        assert get(workers[0].direct_exports.remote()) == 2
        assert_workers_match(trainer, workers)


class ExitingWorker(GpuWorker):
    def ws_receive(self, call: Any) -> Any:
        if call.version == 2:
            os._exit(3)
        return super().ws_receive(call)


def test_direct_worker_killed_during_the_sync_is_named_and_the_trainer_stays_usable(actors: Any) -> None:
    opts = {"num_cpus": 0, "num_gpus": 1 / 3}
    trainer = actors.add(ray.remote(GpuTrainer).options(**opts).remote(PolicyFactory("1mb", 0, "cuda"), device="cuda"))
    doomed = actors.add(
        ray.remote(ExitingWorker).options(**opts).remote(PolicyFactory("1mb", 1, "cuda"), device="cuda")
    )
    healthy = actors.add(ray.remote(GpuWorker).options(**opts).remote(PolicyFactory("1mb", 2, "cuda"), device="cuda"))
    ws = WeightSync(trainer, {"doomed": doomed, "healthy": healthy}, transport="direct", timeout_s=20)
    ws.sync(1)
    with pytest.raises(SyncError) as info:
        ws.sync(2)
    assert info.value.dead == ["doomed"]
    get(trainer.call.remote(train_step, 3))
    ws.sync(3)
    assert_workers_match(trainer, [healthy])
    ws.close()


def test_direct_casts_fp32_master_weights_to_bf16_in_the_one_copy(actors: Any) -> None:
    opts = {"num_cpus": 0, "num_gpus": 0.5}
    trainer = actors.add(
        ray.remote(GpuTrainer)
        .options(**opts)
        .remote(functools.partial(_as_dtype, "float32", 0), device="cuda", wire_dtype=torch.bfloat16)
    )
    worker = actors.add(
        ray.remote(GpuWorker).options(**opts).remote(functools.partial(_as_dtype, "bfloat16", 1), device="cuda")
    )
    with WeightSync(trainer, [worker], transport="direct") as ws:
        get(trainer.call.remote(perturb, 4))
        ws.sync(1)
        expected = {n: t.to(torch.bfloat16) for n, t in get(trainer.call.remote(state_of)).items()}
        got = get(worker.call.remote(state_of))
        for name in expected:
            assert_bit_equal(got[name], expected[name], name)


def _as_dtype(dtype: str, seed: int) -> nn.Module:
    return PolicyFactory("1mb", seed, "cpu")().to(getattr(torch, dtype))


class DiesMidReceive(GpuWorker):
    """Queues the first chunks' copies out (their events recorded), then dies on chunk 2."""

    def ws_receive(self, call: Any) -> Any:
        if call.version == 2:
            from weightsync.core.packing import ChunkUnpacker

            inner = ChunkUnpacker.unpack

            def unpack(unpacker: Any, chunk: Any, buffer: torch.Tensor, **batched: Any) -> Any:
                if chunk.index == 2:
                    os._exit(3)
                return inner(unpacker, chunk, buffer, **batched)

            ChunkUnpacker.unpack = unpack  # type: ignore[method-assign]
        return super().ws_receive(call)


def test_ipc_worker_killed_with_copies_in_flight_leaves_the_trainer_usable(actors: Any) -> None:
    """The trainer's stream waits on the dead worker's events: it must not wedge later syncs."""
    opts = {"num_cpus": 0, "num_gpus": 1 / 3}
    trainer = actors.add(ray.remote(GpuTrainer).options(**opts).remote(PolicyFactory("30mb", 0, "cuda"), device="cuda"))
    doomed = actors.add(
        ray.remote(DiesMidReceive).options(**opts).remote(PolicyFactory("30mb", 1, "cuda"), device="cuda")
    )
    healthy = actors.add(ray.remote(GpuWorker).options(**opts).remote(PolicyFactory("30mb", 2, "cuda"), device="cuda"))
    ws = WeightSync(
        trainer, {"doomed": doomed, "healthy": healthy}, transport="ipc", buffer_bytes=1 << 20, timeout_s=30
    )
    ws.sync(1)
    get(trainer.call.remote(train_step, 2))
    with pytest.raises(SyncError) as info:
        ws.sync(2)
    assert info.value.dead == ["doomed"]
    for version in (3, 4):
        get(trainer.call.remote(train_step, version))
        assert ws.sync(version).workers[0].version == version
    assert_workers_match(trainer, [healthy])
    ws.close()


class PushingGpuTrainer(GpuTrainer):
    def train_and_push(self, version: int) -> tuple[float, bool]:
        loss = train_step(self.model, version)
        return loss, self.weightsync_push(version, verify=version % 2 == 0).ok


def test_push_mode_on_a_shared_gpu_from_the_coordinator_and_from_the_trainer(actors: Any) -> None:
    """Push mode over CUDA IPC: the listener thread receives on the worker's GPU, the
    trainer's own call pushes, a swapped parameter is re-exported, bytes equal."""
    opts = {"num_cpus": 0, "num_gpus": 0.5}
    trainer = actors.add(
        ray.remote(PushingGpuTrainer).options(**opts).remote(PolicyFactory("30mb", 0, "cuda"), device="cuda")
    )
    worker = actors.add(ray.remote(GpuWorker).options(**opts).remote(PolicyFactory("30mb", 1, "cuda"), device="cuda"))
    with WeightSync(trainer, [worker], transport="direct", push=True, buffer_bytes=4 << 20) as ws:
        for version in (1, 2):
            get(trainer.call.remote(train_step, version))
            ws.sync(version, verify=True)
            assert_workers_match(trainer, [worker])
        for version in (3, 4):
            _, pushed = get(trainer.train_and_push.remote(version))
            assert pushed
            assert_workers_match(trainer, [worker])
        get(worker.swap_parameter_storage.remote())
        ws.sync(5)
        assert get(worker.direct_exports.remote()) == 2
        assert_workers_match(trainer, [worker])
        assert get(worker.version.remote()) == (5, "committed")


def nudge_on_device(model: nn.Module, seed: int) -> None:
    """Run in the trainer: new values in about 2% of each tensor's elements, on its device."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, (_, tensor) in enumerate(module_tensors(model)):
            flat = tensor.view(-1)
            picked = (torch.rand(flat.numel(), generator=gen) < 0.02).to(flat.device)
            flat[picked] = random_tensor((flat.numel(),), flat.dtype, seed * 1000 + i).to(flat.device)[picked]


def test_ipc_delta_syncs_on_one_gpu_encode_on_the_trainer_and_patch_the_worker_bit_exact(actors: Any) -> None:
    """A delta session on the GPU end to end: the trainer's kernels encode against its base
    on the device, the payloads cross in 4 MiB chunks, and the worker's module sink scatters
    each chunk's payloads in batched launches; every version bit-exact, the bytes sent a
    fraction of the model's."""
    trainer, workers = gpu_pair(
        actors, PolicyFactory("30mb", 0, "cuda"), worker_factory=PolicyFactory("30mb", 1, "cuda")
    )
    with WeightSync(trainer, workers, transport="ipc", delta=True, buffer_bytes=4 << 20) as ws:
        assert ws.sync(1).workers[0].encoding == "dense"  # the worker holds nothing to patch yet
        assert_workers_match(trainer, workers)
        for version in (2, 3, 4):
            get(trainer.call.remote(nudge_on_device, version))
            report = ws.sync(version)
            assert report.workers[0].encoding == "delta", report.summary()
            assert report.sent_bytes < 0.2 * report.bytes, report.summary()
            assert_workers_match(trainer, workers)
        assert ws.verify()
