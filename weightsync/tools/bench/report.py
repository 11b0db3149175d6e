"""The bench's results: one :class:`Case` per measured row, its printed line and JSON (the chart:
:mod:`weightsync.tools.bench.chart`).

Printing and file formats live here, apart from how cases are measured
(:mod:`weightsync.tools.bench.driver`), so both can change without touching the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from weightsync.core.wire.errors import SettingsError


@dataclass
class Case:
    size: str
    name: str
    model_bytes: int
    #: The buffer size the case ran with, in MiB (a model smaller than 1 MiB gets a smaller
    #: "auto" buffer, hence a fraction).
    buffer_mib: float | None = None
    num_buffers: int | None = None
    times: list[float] = field(default_factory=list)
    #: For weightsync cases: seconds inside the trainer's send call, per timed sync.
    send_times: list[float] = field(default_factory=list)
    limit_s: float | None = None
    trainer_extra_mb: float | None = None
    worker_extra_mb: float | None = None
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def gbps(self) -> float:
        return self.model_bytes / self.median / 1e9

    def row(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            median_s=self.median,
            min_s=min(self.times),
            max_s=max(self.times),
            gbps=self.gbps,
            send_median_s=statistics.median(self.send_times) if self.send_times else None,
            fraction_of_raw_limit=(self.limit_s / self.median) if self.limit_s else None,
        )
        return out


def mib_column(buffer_mib: float | None) -> str:
    """The MiB column: blank for a case without buffers, whole MiB from 10 up, else 3 digits."""
    if buffer_mib is None:
        return ""
    return f"{buffer_mib:.0f}" if buffer_mib >= 10 else f"{buffer_mib:.3g}"


def show(c: Case) -> None:
    knobs = f"{mib_column(c.buffer_mib):>5} {c.num_buffers or '':>2}"
    ratio = f"{c.limit_s / c.median:6.1%}" if c.limit_s else "     -"
    extra = f"{c.trainer_extra_mb or 0:8.0f} {c.worker_extra_mb if c.worker_extra_mb is not None else 0:8.0f}"
    send = f"{statistics.median(c.send_times) * 1e3:8.2f}" if c.send_times else f"{'-':>8}"
    print(
        f"{c.size:>6} {c.name:<34} {knobs} {c.median * 1e3:10.2f} {min(c.times) * 1e3:9.2f}-{max(c.times) * 1e3:<9.2f}"
        f" {send} {c.gbps:8.2f} {ratio}  {extra}  {c.note}",
        flush=True,
    )


def _find(cases: list[Case], size: str, prefix: str) -> Case | None:
    return next((c for c in cases if c.size == size and c.name.startswith(prefix)), None)


def ratios(cases: list[Case], size: str, receivers: int) -> list[str]:
    """The ratios of one size: each a limit's or baseline's time over the case's time
    (above 100%: faster than it), from cases measured in this run."""
    lines = []
    copy = _find(cases, size, "raw limit: one copy")
    pairs = [
        (
            "broadcast / raw one-buffer broadcast",
            f"weightsync broadcast, {receivers} receiver",
            "raw limit: one gloo",
            1,
        ),
        ("broadcast / per-tensor broadcast", f"weightsync broadcast, {receivers} receiver", "naive: one gloo", 1),
        ("broadcast / all packed", f"weightsync broadcast, {receivers} receiver", "weightsync broadcast (all", 1),
        ("ipc (defaults) / two-copy limit", "weightsync ipc", "raw limit: one copy", 2),
        ("direct (defaults) / one raw copy", "weightsync direct", "raw limit: one copy", 1),
    ]
    for label, case_name, base_name, factor in pairs:
        case = _find(cases, size, case_name)
        base = copy if base_name.startswith("raw limit: one copy") else _find(cases, size, base_name)
        if case is None or base is None or case.name.endswith("(knobs)"):
            continue
        limit = base.median * factor
        lines.append(
            f"{size:>6} ratio {label:<38} {limit / case.median:7.1%}   "
            f"({limit * 1e3:.2f} ms{' (2 x copy)' if factor == 2 else ''} against {case.median * 1e3:.2f} ms)"
        )
    return (
        lines
        + _board_ratios(cases, size)
        + _sharded_ratios(cases, size, receivers)
        + _engine_ratios(cases, size)
        + _lora_ratios(cases, size)
    )


def _board_ratios(cases: list[Case], size: str) -> list[str]:
    """Per colocated transport, its sync with every answer through Ray against the same sync
    answered on the reply board (above 1x: the board is faster), and the time it saves."""
    lines = []
    for transport in ("ipc", "direct"):
        board = next((c for c in cases if c.size == size and c.name == f"weightsync {transport}"), None)
        ray = next((c for c in cases if c.size == size and c.name == f"weightsync {transport}, Ray answers"), None)
        if board is not None and ray is not None:
            lines.append(
                f"{size:>6} ratio {transport + ': Ray answers / reply board':<38} {ray.median / board.median:6.2f}x  "
                f"({ray.median * 1e3:.2f} ms against {board.median * 1e3:.2f} ms: "
                f"{(ray.median - board.median) * 1e3:.2f} ms saved)"
            )
    return lines


def _lora_ratios(cases: list[Case], size: str) -> list[str]:
    """Per transport, the whole PEFT model's sync against its adapter's alone (above 1x: the
    adapter is faster), with the share of the bytes the adapter is."""
    lines = []
    for adapter in (c for c in cases if c.size == size and c.name.startswith("lora ") and c.name.endswith(": adapter")):
        prefix = adapter.name.rsplit(":", 1)[0]
        whole = _find(cases, size, f"{prefix}: whole model")
        if whole is not None:
            lines.append(
                f"{size:>6} ratio {prefix + ': adapter vs whole':<38} {whole.median / adapter.median:6.2f}x  "
                f"({adapter.median * 1e3:.2f} ms against {whole.median * 1e3:.2f} ms; "
                f"{adapter.model_bytes / whole.model_bytes:.2%} of the bytes)"
            )
    return lines


def _engine_ratios(cases: list[Case], size: str) -> list[str]:
    """A vLLM engine of TP ranks fed per rank against the same engine relayed (above 1x:
    feeding each rank is faster)."""
    lines = []
    for fed in (c for c in cases if c.size == size and c.name.startswith("vllm TP=") and c.name.endswith("rank-ipc")):
        prefix = fed.name.rsplit(":", 1)[0]
        relay = _find(cases, size, f"{prefix}: relay")
        if relay is not None:
            lines.append(
                f"{size:>6} ratio {prefix + ': rank-ipc vs relay':<38} {relay.median / fed.median:6.2f}x  "
                f"({relay.median * 1e3:.2f} ms against {fed.median * 1e3:.2f} ms)"
            )
    return lines


def _sharded_ratios(cases: list[Case], size: str, receivers: int) -> list[str]:
    """Per rank count, owner sends against the gather path (broadcast) and the unsharded
    broadcast, owner writes against the gather path (direct) and the unsharded direct: the
    other's time over the owners' (above 1x: the owners are faster)."""
    lines = []
    for kind, gather, plain, short in (
        ("owners", "broadcast", f"weightsync broadcast, {receivers} receiver", "bc"),
        ("owner-writes", "direct", "weightsync direct", "direct"),
    ):
        unsharded = _find(cases, size, plain)
        for owners in (c for c in cases if c.size == size and c.name.startswith("sharded ") and f": {kind}" in c.name):
            ranks = owners.name.split(":")[0]
            for label, base in (
                (f"{ranks}: {kind} vs gather", _find(cases, size, f"{ranks}: {gather}")),
                (f"{ranks}: {kind} vs unsharded {short}", unsharded),
            ):
                if base is not None:
                    lines.append(
                        f"{size:>6} ratio {label:<38} {base.median / owners.median:6.2f}x  "
                        f"({base.median * 1e3:.2f} ms against {owners.median * 1e3:.2f} ms)"
                    )
    return lines


def header() -> None:
    print(
        f"{'size':>6} {'case':<34} {'MiB':>5} {'nb':>2} {'median ms':>10} {'min-max ms':>19} {'send ms':>8}"
        f" {'GB/s':>8} {'/raw':>6}"
        f"  {'trainMB':>8} {'workMB':>8}",
        flush=True,
    )


def check_json_path(path: str) -> None:
    """Refuse, before anything is measured, a results file that could not be written at the end."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SettingsError(f"--json {path}: folder {folder} does not exist; create it or pick another path")


def write_json(path: str, args: argparse.Namespace, cases: list[Case], summary: list[str] | None = None) -> None:
    with open(path, "w") as fh:
        json.dump(
            {
                "args": {k: v for k, v in vars(args).items() if k != "func"},
                "cases": [c.row() for c in cases],
                "ratios": summary or [],
            },
            fh,
            indent=2,
        )
    print(f"wrote {path}")
