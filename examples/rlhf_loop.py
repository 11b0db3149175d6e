"""An RLHF-style loop on the Python API: train, sync, generate, repeat (CPU or GPU).

.venv/bin/python examples/rlhf_loop.py       # from the repository root, after the set-up
"""

from __future__ import annotations

import ray
import torch

import weightsync
from weightsync.tools.cluster import connect
from weightsync.tools.models import PolicyFactory, synthetic_batch, train_step


def generate(model: torch.nn.Module, step: int) -> float:
    """Stand-in for rollout generation: the mean next-token log-prob on a prompt batch."""
    with torch.no_grad():
        tokens = synthetic_batch(model.cfg, step, batch=4, length=32, device=next(model.parameters()).device)
        logits = model(tokens[:, :-1]).float()
        return float(torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).mean())


def main() -> None:
    connect()
    trainer = weightsync.TrainerActor.options(num_cpus=0).remote(PolicyFactory("30mb", seed=0))
    workers = [weightsync.WorkerActor.options(num_cpus=0).remote(PolicyFactory("30mb", seed=i + 1)) for i in range(2)]
    with weightsync.WeightSync(trainer, workers, transport="auto", timeout_s=60) as ws:
        for step in range(1, 6):
            loss = ray.get(trainer.call.remote(train_step, step), timeout=60)
            report = ws.sync(version=step)
            scores = ray.get([w.call.remote(generate, step) for w in workers], timeout=60)
            print(f"step {step}: loss {loss:.3f}, {report.summary()}, rollout logp {scores}")
        digest = ws.verify()
        print(f"verified: every worker equals the trainer, tensor by tensor (digest {digest[:12]})")


if __name__ == "__main__":
    main()
