"""A sharded trainer on one GPU: two FSDP2 ranks share it over gloo, with colocated workers.

NCCL refuses two ranks on one GPU, so the ranks' group is gloo on a ``cuda`` mesh: torch's
gloo backend stages CUDA tensors through pinned host memory for the collectives a sync needs
(``all_gather_into_tensor`` = ``_allgather_base`` and ``all_reduce``, both with CUDA work
classes in ProcessGroupGloo). Training would add FSDP2's reduce-scatter, which gloo runs as
an all-reduce; the test changes the shards directly instead, each rank its own part, so
only the collectives weightsync itself issues are exercised.

Marked ``cuda``: skipped without a GPU. Rank 0 writes an ipc worker, rank 1 a direct one,
and both ranks write their own rows into a third (owner writes; CUDA IPC between actors at
a fifth of the GPU each).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import pytest
import ray
import torch

from tests import fsdp_model as fm
from tests.conftest import RAY_TIMEOUT, ActorPool
from tests.helpers import assert_bit_equal
from weightsync import TrainerActor, WeightSync, WorkerActor
from weightsync.glue.ranks import RankSpec

pytestmark = pytest.mark.cuda

SHAPE = {"vocab": 64, "dim": 128, "blocks": 8, "tied": True}
BUFFER = 256 * 1024


def get(ref: Any) -> Any:
    return ray.get(ref, timeout=RAY_TIMEOUT)


def shard_devices(model: torch.nn.Module) -> set[str]:
    from torch.distributed.tensor import DTensor

    return {
        f"{type(p).__name__}:{(p.to_local() if isinstance(p, DTensor) else p).device.type}" for p in model.parameters()
    }


def test_two_ranks_on_one_gpu_sync_to_colocated_ipc_direct_and_owner_write_workers(actors: ActorPool) -> None:
    opts = {"num_cpus": 0, "num_gpus": 0.2}
    # Both ranks see the one GPU as device 0: LOCAL_RANK must not point DeviceMesh elsewhere.
    specs = [replace(spec, local_rank=0) for spec in RankSpec.group(2)]
    ranks = [
        actors.add(TrainerActor.options(**opts).remote(partial(fm.fsdp_lm_cuda, **SHAPE), device="cuda", rank=spec))
        for spec in specs
    ]
    worker = partial(fm.plain_lm, **SHAPE)
    workers = {
        name: actors.add(WorkerActor.options(**opts).remote(worker, device="cuda")) for name in ("i0", "d1", "w2")
    }
    assert get(ranks[0].call.remote(shard_devices)) == {"DTensor:cuda"}
    transports = {"i0": "ipc", "d1": "direct", "w2": "auto"}
    with WeightSync(
        ranks, workers, transport=transports, worker_ranks={"d1": 1}, buffer_bytes=BUFFER, timeout_s=60
    ) as ws:
        assert ws.transports() == {**transports, "w2": "owner-writes"}
        assert len(ws.manifest.chunks) > 2  # type: ignore[union-attr]  # several buckets per walk
        for version in (1, 2):
            get([r.call.remote(fm.perturb_shards, version) for r in ranks])
            ws.sync(version, verify=version == 2)
            shards = get([r.call.remote(fm.local_shards_cpu) for r in ranks])
            for name_w, handle in workers.items():
                held = get(handle.call.remote(fm.state_cpu))
                assert held.keys() == shards[0].keys(), name_w
                for name, full in held.items():
                    covered = 0
                    for rank, mine in enumerate(shards):
                        offset, local = mine[name]
                        part = full[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))]
                        assert_bit_equal(part, local, f"{name_w}: {name} against rank {rank}'s part")
                        covered += local.numel()
                    # Each Shard(0) part is covered once; a replicated tensor once per rank.
                    assert covered in (full.numel(), len(ranks) * full.numel()), f"{name_w}: {name}"
        ws.verify()
