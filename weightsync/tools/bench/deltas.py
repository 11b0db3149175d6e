"""The bench's delta cases (``--changed``): dense against delta syncs on the same actors.

Per size, a trainer holding fp32 master weights sends bf16 (the usual RL setup) to
``--workers`` bf16 workers over broadcast (ipc on a GPU: one GPU holds no NCCL pair), in
one run: dense syncs, then a delta session with each ``--changed`` case, then dense syncs
again (the dense row's median spans both blocks, so a load that drifts during the run
weighs on both sides alike). A case changes the trainer's weights before every timed sync:

* ``N%``: a masked perturbation, each of about N% of the elements moved by two bf16 units
  in the last place (a new random mask each time), so about N% of the wire's elements change;
* ``adamw:LR``: one real AdamW step at learning rate LR on the demo's loss (the optimizer
  is made at the first step, with that rate).

Each delta row says what crossed the transport (``SyncReport.sent_bytes``, as a share of the
dense bytes) and its speed against the dense row; the ratio lines repeat both.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

import weightsync.tools.bench.probes as probes
from weightsync.tools.bench.report import Case, show
from weightsync.tools.models import PolicyFactory, train_step


class Bench(Protocol):
    """What these cases need of :class:`weightsync.tools.bench.driver.Bench`."""

    args: Any
    timeout_s: float
    cases: list[Case]
    summary: list[str]

    @property
    def ray(self) -> Any: ...

    def get(self, ref: Any) -> Any: ...

    def next_version(self) -> int: ...

    def memory_base(self, parties: list[Any]) -> list[int]: ...


@dataclass(frozen=True)
class Change:
    """One ``--changed`` case: a masked ``fraction`` of the elements, or an AdamW step at ``lr``."""

    label: str
    fraction: float | None = None
    lr: float | None = None


def change_of(part: str) -> Change:
    """The :class:`Change` one ``--changed`` item names; ValueError when it names none."""
    if part.endswith("%"):
        fraction = float(part[:-1]) / 100
        if 0 < fraction <= 1:
            return Change(part, fraction=fraction)
    elif part.startswith("adamw:"):
        lr = float(part.removeprefix("adamw:"))
        if lr > 0:
            return Change(f"adamw lr {lr:g}", lr=lr)
    raise ValueError(part)


def changed_list(value: str) -> list[str]:
    """``--changed``: comma-separated ``N%`` (0 < N <= 100) or ``adamw:LR`` (LR > 0), checked
    here and kept as given (the run's JSON records them as such)."""
    parts = [p.strip() for p in value.split(",") if p.strip()]
    for part in parts:
        try:
            change_of(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a change: give N% (0 < N <= 100) or adamw:LR (LR > 0), e.g. 1%,10%,100%,adamw:1e-6"
            ) from None
    if not parts:
        raise argparse.ArgumentTypeError("expected at least one change, e.g. 1%,10%,100%")
    return parts


def perturb(model: nn.Module, fraction: float, seed: int) -> None:
    """Run in the trainer: about ``fraction`` of every floating tensor's elements moved by two
    bf16 units in the last place (so their bf16 bits change), a fresh mask per ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            mask = torch.rand(flat.numel(), generator=gen) < fraction if fraction < 1 else slice(None)
            picked = flat[mask]
            flat[mask] = picked + picked.abs().clamp_min(1e-3) * 2**-6


def apply_change(model: nn.Module, change: Change, seed: int) -> None:
    """Run in the trainer: one change of ``change``'s kind."""
    if change.lr is not None:
        train_step(model, seed, change.lr)  # type: ignore[arg-type]
    elif change.fraction is not None:
        perturb(model, change.fraction, seed)


def delta_cases(bench: Bench, size: str, changed: list[str]) -> None:
    """The dense and delta rows of one size (see the module doc), on actors of their own."""
    changes = [change_of(part) for part in changed]
    from weightsync.glue.actors import TrainerActor, WorkerActor
    from weightsync.glue.coordinator import WeightSync

    args = bench.args
    cuda = args.device == "cuda"
    opts: dict[str, Any] = {"num_cpus": 0, **({"num_gpus": 0.5} if cuda else {})}
    trainer = TrainerActor.options(**opts).remote(
        PolicyFactory(size, 0, args.device, dtype="float32"), wire_dtype=torch.bfloat16, device=args.device
    )
    workers = [
        WorkerActor.options(**opts).remote(PolicyFactory(size, i + 1, args.device, dtype="bfloat16"))
        for i in range(1 if cuda else args.workers)
    ]
    transport = "ipc" if cuda else "broadcast"
    parties = [trainer, workers[0]]
    try:
        dense = Case(size, f"dense {transport}, fp32 -> bf16", 0, note="the delta rows' baseline")
        with WeightSync(trainer, workers, transport=transport, timeout_s=bench.timeout_s) as ws:
            _timed(bench, ws, trainer, dense, None, parties, False)
        with WeightSync(trainer, workers, transport=transport, delta=True, timeout_s=bench.timeout_s) as ws:
            rows = [_delta_row(bench, ws, trainer, size, transport, c, parties) for c in changes]
        with WeightSync(trainer, workers, transport=transport, timeout_s=bench.timeout_s) as ws:
            _timed(bench, ws, trainer, dense, None, parties, True)
        for row in [dense, *rows]:
            if row is not dense:
                row.note = f"{row.note}, {dense.median / row.median:.2f}x dense's speed"
            bench.cases.append(row)
            show(row)
        for row in rows:
            line = (
                f"{size:>6} ratio {row.name:<38} {dense.median / row.median:6.2f}x dense's speed "
                f"({row.median * 1e3:.1f} ms against {dense.median * 1e3:.1f} ms), {row.note.split(',')[0]}"
            )
            bench.summary.append(line)
            print(line, flush=True)
    finally:
        for handle in [trainer, *workers]:
            bench.ray.kill(handle)


def _delta_row(
    bench: Bench, ws: Any, trainer: Any, size: str, transport: str, change: Change, parties: list[Any]
) -> Case:
    case = Case(size, f"delta {transport}, {change.label}", 0)
    shares = _timed(bench, ws, trainer, case, change, parties, False)
    case.note = f"sent {statistics.median(shares):.1%} of dense"
    return case


def _timed(
    bench: Bench, ws: Any, trainer: Any, case: Case, change: Change | None, parties: list[Any], more: bool
) -> list[float]:
    """Warm-up syncs after a change (two for a delta row: a delta session's first sync is
    dense), then ``--repeats`` timed ones, each after a change; the share of dense bytes each sent.
    ``more``: add to ``case``'s times (its second block) rather than start them."""
    shares: list[float] = []

    def one() -> float:
        version = bench.next_version()
        if change is not None:
            bench.get(trainer.call.remote(apply_change, change, version))
        report = ws.sync(version)
        case.model_bytes = report.bytes
        case.send_times.append(report.send_seconds)
        shares.append(report.sent_bytes / report.bytes)
        return float(report.seconds)

    one()
    if change is not None:
        one()  # a delta session's first sync is dense: the second is the first delta
    shares.clear()
    if not more:
        case.times, case.send_times = [], []
    base = bench.memory_base(parties)
    case.times += [one() for _ in range(bench.args.repeats)]
    peaks = bench.get([p.call.remote(probes.memory_peak) for p in parties])
    case.trainer_extra_mb = max(case.trainer_extra_mb or 0, (peaks[0] - base[0]) / 1e6)
    case.worker_extra_mb = max(case.worker_extra_mb or 0, (peaks[1] - base[1]) / 1e6)
    return shares
