"""What the GPU does during a colocated sync, from torch.profiler traces of both sides.

Runs the real product path (Ray actors at half a GPU each, ``WeightSync.sync`` at the
library's defaults), profiles a few syncs inside the trainer and the worker at once, and
lines the two processes' kernels up on the host clock they share (a trace's ``ts`` plus its
``baseTimeNanoseconds`` is wall time in microseconds). Per sync it prints, in ms after
``sync()`` was entered: when the first and the last kernel of each side ran, how long each
side's kernels were busy, how long both sides' kernels were in flight at once, and how
long the GPU ran no kernel of either side inside the sync. With ``--out`` it also writes
both traces as one Chrome trace (open it in Perfetto); with ``--host`` it runs cProfile
in both actors instead of torch.profiler and prints where each side's host time went, per
sync (the actors' Python, which the GPU trace cannot show)::

    .venv/bin/python scripts/profile_sync.py --device cuda --size 16gb --transport ipc --out ipc.json

Reading it: ``ipc`` must move every byte twice (pack, unpack), so its floor is two copies;
a kernel of one side that overlaps the other's and runs at half its lone speed shows the
two processes sharing the GPU's memory bandwidth (or its time slices) rather than adding
to it. Idle time inside the sync is host work or hand-off latency that no kernel hides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import ray
import torch
from torch import nn

from weightsync import WeightSync
from weightsync.tools.colocated import colocated_pair, connect_colocated

#: Trace categories that are GPU work.
_GPU = ("kernel", "gpu_memcpy", "gpu_memset")


def start_profile(model: nn.Module) -> None:
    """Start a CPU+CUDA profiler in this actor (kept on the model between calls)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    prof.start()
    model.__dict__["_ws_profile"] = prof


def stop_profile(model: nn.Module) -> dict[str, Any]:
    """Stop this actor's profiler; its trace, every ``ts`` made absolute (µs since the epoch)."""
    prof = model.__dict__.pop("_ws_profile")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.stop()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            trace: dict[str, Any] = json.load(fh)
    base = trace.get("baseTimeNanoseconds", 0) / 1e3
    for event in trace["traceEvents"]:
        if "ts" in event:
            event["ts"] = float(event["ts"]) + base
    return trace


def start_host_profile(model: nn.Module) -> None:
    """Start cProfile in this actor's thread (Ray runs a plain actor's calls on one thread)."""
    import cProfile

    prof = cProfile.Profile()
    model.__dict__["_ws_host_profile"] = prof
    prof.enable()


def stop_host_profile(model: nn.Module, syncs: int, rows: int) -> str:
    """Stop this actor's cProfile; its top ``rows`` functions by cumulative time, in ms per sync."""
    import pstats

    prof = model.__dict__.pop("_ws_host_profile")
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    top = sorted(stats.items(), key=lambda item: -item[1][3])[:rows]
    lines = [f"  {'ms/sync':>8} {'own ms':>7} {'calls':>6}  function"]
    for (path, line, name), (_, calls, own, total, _) in top:
        where = f"{'/'.join(path.split('/')[-2:])}:{line}({name})"
        lines.append(f"  {total / syncs * 1e3:8.3f} {own / syncs * 1e3:7.3f} {calls // syncs:6d}  {where}")
    return "\n".join(lines)


def gpu_spans(trace: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every GPU kernel, copy and memset in the trace."""
    spans = []
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in _GPU:
            spans.append((e["ts"], e["ts"] + float(e.get("dur", 0)), e.get("name", "?")))
    return sorted(spans)


def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(spans: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in spans if e > lo and s < hi]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1gb")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--transport", choices=["direct", "ipc", "push"], default="ipc")
    parser.add_argument("--warmup", type=int, default=3, help="syncs before profiling (plans are built by the second)")
    parser.add_argument("--syncs", type=int, default=3, help="profiled syncs")
    parser.add_argument("--out", help="write both sides' traces here as one Chrome trace (default: not written)")
    parser.add_argument("--host", action="store_true", help="profile the actors' Python (cProfile) instead of the GPU")
    parser.add_argument("--rows", type=int, default=30, help="functions per side with --host (default: 30)")
    args = parser.parse_args()
    connect_colocated(args.device, "scripts/profile_sync.py")
    trainer, worker = colocated_pair(args.size, args.device)
    push = args.transport == "push"
    ws = WeightSync(trainer, [worker], transport="direct" if push else args.transport, push=push)
    built = ws.setup()
    print(f"{args.transport} {args.size} on {args.device}: {built.agreed.buffer_bytes >> 20} MiB buffers")
    version = 0
    for _ in range(args.warmup):
        version += 1
        ws.sync(version)
    if args.host:
        host_profile(ws, trainer, worker, version, args)
        return
    ray.get([trainer.call.remote(start_profile), worker.call.remote(start_profile)], timeout=120)
    windows = []
    for _ in range(args.syncs):
        version += 1
        entered = time.time() * 1e6
        ws.sync(version)
        windows.append((entered, time.time() * 1e6))
    traces = ray.get([trainer.call.remote(stop_profile), worker.call.remote(stop_profile)], timeout=300)
    ws.close()
    for handle in (trainer, worker):
        ray.kill(handle)
    sides = {"trainer": gpu_spans(traces[0]), "worker": gpu_spans(traces[1])}
    rows: dict[str, list[float]] = {}
    for lo, hi in windows:
        busy = {k: union(clip([(s, e) for s, e, _ in v], lo, hi)) for k, v in sides.items()}
        both = intersect(busy["trainer"], busy["worker"])
        either = union(busy["trainer"] + busy["worker"])
        row = {"sync wall": hi - lo}
        for side, spans in busy.items():
            if spans:
                row[f"{side} first kernel at"] = spans[0][0] - lo
                row[f"{side} last kernel ends at"] = spans[-1][1] - lo
            row[f"{side} kernels busy"] = length(spans)
        row["both sides' kernels at once"] = length(both)
        row["no kernel (inside the sync)"] = (hi - lo) - length(either)
        for key, value in row.items():
            rows.setdefault(key, []).append(value / 1e3)
    print(f"median of {args.syncs} profiled syncs, ms after sync() was entered:")
    for key, values in rows.items():
        print(f"  {key:<32} {statistics.median(values):9.3f}   ({', '.join(f'{v:.3f}' for v in values)})")
    lo, hi = windows[-1]
    print("last sync's GPU work, ms after sync() was entered (start, duration, side, name):")
    for side, named in sides.items():
        for start, end, name in named:
            if end > lo and start < hi:
                print(f"  {(start - lo) / 1e3:8.3f} {(end - start) / 1e3:7.3f}  {side:<7} {name[:60]}")
    if args.out:
        events = []
        for side, trace in zip(("trainer", "worker"), traces, strict=True):
            for e in trace["traceEvents"]:
                if "ts" in e:
                    e = dict(e, pid=f"{side} {e.get('pid', '')}")
                    events.append(e)
        with open(args.out, "w") as fh:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, fh)
        print(f"wrote {args.out}")


def host_profile(ws: WeightSync, trainer: Any, worker: Any, version: int, args: argparse.Namespace) -> None:
    """cProfile both actors over ``args.syncs`` syncs; prints each side's top functions."""
    ray.get([trainer.call.remote(start_host_profile), worker.call.remote(start_host_profile)], timeout=120)
    times = []
    for _ in range(args.syncs):
        version += 1
        start = time.perf_counter()
        ws.sync(version)
        times.append(time.perf_counter() - start)
    reports = ray.get(
        [
            trainer.call.remote(stop_host_profile, args.syncs, args.rows),
            worker.call.remote(stop_host_profile, args.syncs, args.rows),
        ],
        timeout=300,
    )
    ws.close()
    for handle in (trainer, worker):
        ray.kill(handle)
    print(f"median sync {statistics.median(times) * 1e3:.3f} ms under cProfile ({args.syncs} syncs)")
    for side, report in zip(("trainer", "worker"), reports, strict=True):
        print(f"{side} (the listener thread's work is not seen in push mode):" if side == "worker" else f"{side}:")
        print(report)


if __name__ == "__main__":
    main()
