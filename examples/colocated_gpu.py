"""Colocated layout: trainer and workers share one GPU through a placement group.

Each actor holds a fraction of the GPU; weightsync sees the same GPU UUID on both sides
and picks `direct` (one copy into the worker's parameters) or `ipc` for load_weights
workers. NCCL is never used on a shared GPU (it refuses two ranks there).

    .venv/bin/python examples/colocated_gpu.py   # on a machine with a GPU

Without a GPU (on this machine, or in the cluster it joins through RAY_ADDRESS) it says so in
one line and exits with status 2, before starting Ray.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import weightsync
from weightsync.tools.cluster import connect_with_gpus
from weightsync.tools.models import PolicyFactory, train_step


def main(workers: int = 2) -> int:
    problem = connect_with_gpus(1, "examples/colocated_gpu.py")  # said before Ray starts, when it would
    if problem:
        print(problem, flush=True)
        return 2
    share = 1.0 / (workers + 1)
    pg = placement_group([{"GPU": 1, "CPU": 1}], strategy="PACK")
    ray.get(pg.ready(), timeout=120)
    place = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
    opts = {"num_gpus": share, "num_cpus": 0, "scheduling_strategy": place}
    trainer = weightsync.TrainerActor.options(**opts).remote(PolicyFactory("100mb", 0, "cuda"), device="cuda")
    inference = [
        weightsync.WorkerActor.options(**opts).remote(PolicyFactory("100mb", i + 1, "cuda"), device="cuda")
        for i in range(workers)
    ]
    with weightsync.WeightSync(trainer, inference) as ws:  # buffer_bytes="auto": sized from the model
        print("transports:", ws.transports())
        for step in range(1, 4):
            ray.get(trainer.call.remote(train_step, step), timeout=120)
            print(ws.sync(version=step).summary())
        digest = ws.verify()
        print(f"verified: every worker equals the trainer, tensor by tensor (digest {digest[:12]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
