"""Dense against delta syncs of the 1gb policy (fp32 master weights, bf16 wire) over gloo broadcast to
2 workers, in one run with the same actors: dense, delta after real AdamW steps at lr 1e-6, delta with
every element changed. Prints each sync and the medians (docs/benchmarks.md, "Delta syncs")::

    .venv/bin/python scripts/delta_sync.py
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Callable
from typing import Any

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"

import ray
import torch
from torch import nn

import weightsync
from weightsync.glue.actors import TrainerActor, WorkerActor
from weightsync.tools.cluster import connect
from weightsync.tools.models import PolicyFactory, build_policy, train_step


class Policy:
    def __init__(self, dtype: str, seed: int) -> None:
        self.cfg = dataclasses.replace(PolicyFactory("1gb", seed).cfg, dtype=dtype)

    def __call__(self) -> nn.Module:
        return build_policy(self.cfg)


def adamw(model: nn.Module, version: int) -> float:
    return train_step(model, version, lr=1e-6)  # type: ignore[arg-type]


def all_changed(model: nn.Module, version: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)


def main() -> None:
    connect()
    trainer = TrainerActor.options(num_cpus=0).remote(Policy("float32", 0), wire_dtype=torch.bfloat16)
    workers = [WorkerActor.options(num_cpus=0).remote(Policy("bfloat16", i + 1)) for i in range(2)]
    version = 0

    def run(ws: Any, prepare: Callable[[nn.Module, int], object] | None, count: int) -> list[Any]:
        nonlocal version
        out = []
        for _ in range(count):
            version += 1
            if prepare is not None:
                ray.get(trainer.call.remote(prepare, version), timeout=600)
            report = ws.sync(version)
            out.append(report)
            print(f"  {report.summary()}", flush=True)
        return out

    def median(reports: list[Any]) -> float:
        return statistics.median(r.seconds for r in reports)

    dense = weightsync.WeightSync(trainer, workers, transport="broadcast", timeout_s=600)
    run(dense, None, 1)
    dense_runs = run(dense, None, 3)
    dense.close()
    delta = weightsync.WeightSync(trainer, workers, transport="broadcast", timeout_s=600, delta=True)
    run(delta, None, 1)
    run(delta, adamw, 1)
    sparse = run(delta, adamw, 3)
    full = run(delta, all_changed, 3)
    delta.close()
    dense = weightsync.WeightSync(trainer, workers, transport="broadcast", timeout_s=600)
    dense_runs += run(dense, None, 3)
    dense.close()
    base = median(dense_runs)
    share = statistics.median(r.sent_bytes / r.bytes for r in sparse)
    print(
        f"dense median {base * 1e3:.1f} ms; delta after AdamW lr 1e-6: {median(sparse) * 1e3:.1f} ms "
        f"({base / median(sparse):.2f}x faster), sent {share * 100:.1f}%; all changed: "
        f"{median(full) * 1e3:.1f} ms ({median(full) / base:.3f}x dense)"
    )


if __name__ == "__main__":
    main()
