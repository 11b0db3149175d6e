"""The bench's LoRA cases: one policy's adapter synced against the whole policy.

With ``--lora-rank R`` (needs PEFT): per size, a trainer and one worker each build the
size's policy and wrap it with PEFT, a LoRA adapter of rank R (alpha 2R) on every linear
layer of every block (``qkv``, ``out``, ``gate_up``, ``down``). Then, per transport asked
for (``ipc``, ``direct``, ``broadcast``), the same two actors sync through the real product
path twice: ``WeightSync(..., lora=True)`` (the adapter's tensors only) and the same PEFT
model whole (base and adapter, what a sync without ``lora`` sends). Each row's bytes are
the sync's ``SyncReport.sent_bytes``; a ratio line per transport gives the speed-up and
the share of the bytes. Each timed sync follows one optimizer step's worth of change to
the adapter (a small random nudge, done in the trainer outside the timing).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from weightsync.tools.bench.report import Case
from weightsync.tools.bench.sharded import Timer
from weightsync.tools.models import SIZES, PolicyConfig, build_policy

#: The policy's linear layers, in every block.
TARGETS = ("qkv", "out", "gate_up", "down")


class LoraPolicyFactory:
    """One party's model (picklable): the size's policy (base weights from ``seed``) with a
    LoRA adapter of rank ``rank`` on every block's linear layers."""

    def __init__(self, size: str, seed: int, rank: int) -> None:
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
        self.cfg = PolicyConfig(**{**SIZES[size].__dict__, "seed": seed})
        self.rank = rank

    def __call__(self) -> nn.Module:
        import peft

        config = peft.LoraConfig(r=self.rank, lora_alpha=2 * self.rank, target_modules=list(TARGETS))
        model: nn.Module = peft.get_peft_model(build_policy(self.cfg, "cpu"), config)
        return model


def nudge_adapter(model: nn.Module, step: int) -> int:
    """Change every adapter tensor a little (what an optimizer step does); returns how many."""
    gen = torch.Generator().manual_seed(step)
    changed = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 1e-3)
                changed += 1
    return changed


def lora_cases(bench: Timer, size: str) -> None:
    """The adapter and the whole-model rows of ``size``, per transport (see the module doc)."""
    import ray

    from weightsync.glue.actors import TrainerActor, WorkerActor
    from weightsync.glue.coordinator import WeightSync

    rank = bench.args.lora_rank
    try:
        import peft  # noqa: F401
    except ImportError:
        print(f"{size:>6} {'lora cases':<34} skipped: PEFT is not installed (the lora extra installs it)", flush=True)
        return
    trainer = TrainerActor.options(num_cpus=0).remote(LoraPolicyFactory(size, 0, rank))
    worker = WorkerActor.options(num_cpus=0).remote(LoraPolicyFactory(size, 1, rank))
    parties = [trainer, worker]
    try:
        for transport in [t for t in ("ipc", "direct", "broadcast") if t in bench.args.transports]:
            for lora in (True, False):
                name = f"lora r={rank}, {transport}: {'adapter' if lora else 'whole model'}"
                base = bench.memory_base(parties)
                ws = WeightSync(trainer, [worker], transport=transport, lora=lora, timeout_s=bench.timeout_s)
                try:
                    manifest = ws.setup()
                except Exception as exc:  # noqa: BLE001 - reported, counted in the exit code; the rest go on
                    bench.not_run(size, name, exc)
                    continue
                case = Case(size, name, manifest.total_bytes, note=f"{len(manifest.specs)} tensors")

                def one(ws: Any = ws, case: Case = case) -> float:
                    bench.get(trainer.call.remote(nudge_adapter, bench.next_version()))
                    report = ws.sync(bench.next_version())
                    case.send_times.append(report.send_seconds)
                    return float(report.seconds)

                bench.timed(case, one, parties, base)
                ws.close()
    finally:
        for handle in parties:
            ray.kill(handle)
