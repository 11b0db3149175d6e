"""A sharded trainer as the sync source: FSDP2 ranks (gloo, CPU) train and sync to workers.

    .venv/bin/python examples/fsdp_trainer.py   # from the repository root; CPU, about a minute

Two trainer ranks build the model and shard it with FSDP2 inside their actors (each joins
the process group from the RankSpec that ``trainer_ranks`` gives it), train a few steps and
sync the full model to two broadcast workers (served by rank 0) and one colocated direct
worker served by rank 1, without any rank ever holding the whole model.
"""

from __future__ import annotations

import datetime
import os

import ray
import torch
from torch import nn

import weightsync
from weightsync.glue.actors import trainer_ranks
from weightsync.tools.cluster import connect


def policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(256, 64), *(nn.Linear(64, 64) for _ in range(6)), nn.Linear(64, 256))


def sharded_policy() -> nn.Module:
    """Runs in every rank: join the user's group, build, shard each layer, then the root."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    model = policy()
    for layer in model:
        fully_shard(layer)
    return fully_shard(model)


def train_step(model: nn.Module, step: int) -> float:
    opt = getattr(model, "opt", None) or torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.opt = opt
    tokens = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(step))
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(1, 1).flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss)


def main() -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    connect()
    ranks = trainer_ranks(sharded_policy, world_size=2, actor_options={"num_cpus": 0})
    workers = {f"worker-{i}": weightsync.WorkerActor.options(num_cpus=0).remote(policy) for i in range(3)}
    transport = {"worker-0": "broadcast", "worker-1": "broadcast", "worker-2": "direct"}
    with weightsync.WeightSync(ranks, workers, transport=transport, worker_ranks={"worker-2": 1}, timeout_s=60) as ws:
        for step in range(1, 4):
            losses = ray.get([r.call.remote(train_step, step) for r in ranks], timeout=120)
            report = ws.sync(version=step)
            print(f"step {step}: loss {losses[0]:.3f}, {report.summary()}")
        print("verified, digest", ws.verify()[:12])
    for handle in [*ranks, *workers.values()]:
        ray.kill(handle)


if __name__ == "__main__":
    main()
