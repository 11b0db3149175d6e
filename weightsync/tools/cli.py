"""weightsync's command line: demo, bench, doctor, cluster.

Run it from the repository root after the set-up (``bash scripts/run.sh demo``) as
``.venv/bin/python -m weightsync <command> --help``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from weightsync.core import registry
from weightsync.core.choice import requests
from weightsync.core.plugin import Serving
from weightsync.core.wire.errors import SettingsError, WeightSyncError
from weightsync.core.wire.settings import DEFAULT_NUM_BUFFERS, DEFAULT_TIMEOUT_S, GIB, MIB
from weightsync.tools.cli_types import (
    DefaultsHelpFormatter,
    Subparsers,
    mib_as_bytes,
    positive_int,
    positive_seconds,
)
from weightsync.tools.models import SIZES, PolicyFactory, train_step


def _print(*parts: Any) -> None:
    print(*parts, flush=True)


def demo_transports() -> tuple[str, ...]:
    """What ``demo --transport`` offers: ``auto`` and every transport one trainer process can
    serve (not those every rank of a sharded trainer serves: the demo's trainer is one)."""
    return ("auto", *(t.name for t in registry.transports() if t.serving is not Serving.EVERY))


def _demo_transport(value: str) -> str:
    if value in demo_transports():
        return value
    if value in requests():
        raise argparse.ArgumentTypeError(
            f"{value!r} is served by every rank of a sharded trainer, and the demo's trainer is one process; "
            f"choose from {', '.join(demo_transports())}"
        )
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from {', '.join(demo_transports())})")


def _actor_options(device: str, colocated: bool, parties: int) -> dict[str, Any]:
    """Colocated actors share one GPU evenly; others get a GPU each."""
    if device != "cuda":
        return {"num_cpus": 0}
    return {"num_cpus": 0, "num_gpus": 1 / parties if colocated else 1}


def demo(args: argparse.Namespace) -> int:
    """Train a small policy for a few steps, syncing and checking after each one."""
    import ray

    from weightsync.tools.cluster import connect

    started = time.perf_counter()
    how = connect(args.address, num_cpus=args.num_cpus)
    _print(f"ray: {how['mode']} ({how.get('address', '')}) in {time.perf_counter() - started:.1f}s")
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if args.device == "cuda" and gpus < 1:
        _print("error: --device cuda but the Ray cluster has no GPU; run with --device cpu")
        return 2
    trainer, workers = _demo_actors(args, gpus)
    try:
        ok = _demo_syncs(args, trainer, workers)
    finally:
        for handle in [trainer, *workers.values()]:
            ray.kill(handle)
    return 0 if ok else 1


def _demo_actors(args: argparse.Namespace, gpus: int) -> tuple[Any, dict[str, Any]]:
    """The demo's trainer and workers, each with its own seed (so every sync changes bytes)."""
    from weightsync.glue.actors import TrainerActor, WorkerActor

    colocated = args.transport == "auto" or registry.get(args.transport).serving is Serving.NEAREST or gpus < 2
    options = _actor_options(args.device, colocated, args.workers + 1)
    trainer = TrainerActor.options(**options).remote(PolicyFactory(args.size, seed=0, device="cpu"), device=args.device)
    workers = {
        f"worker-{i}": WorkerActor.options(**options).remote(
            PolicyFactory(args.size, seed=i + 1, device="cpu"), device=args.device
        )
        for i in range(args.workers)
    }
    return trainer, workers


def _demo_syncs(args: argparse.Namespace, trainer: Any, workers: dict[str, Any]) -> bool:
    """Set up, then per step train, sync and verify every worker, printing a row each;
    True when every worker was bit-exact with the trainer after every sync."""
    import ray

    from weightsync.glue.coordinator import WeightSync

    ws = WeightSync(
        trainer,
        workers,
        transport=args.transport,
        buffer_bytes=args.buffer_bytes,
        num_buffers=args.num_buffers,
        timeout_s=args.timeout_s,
        verify=args.verify,
    )
    manifest = ws.setup()
    _print(
        f"model: {args.size} policy, {len(manifest.specs)} tensors, {manifest.total_bytes / 1e6:.1f} MB; "
        f"buffers: {manifest.agreed.num_buffers} x {manifest.agreed.buffer_bytes / MIB:.0f} MiB, {len(manifest.chunks)} chunk(s)"
    )
    _print("transports: " + ", ".join(f"{n}={t}" for n, t in ws.transports().items()))
    _print(f"{'step':>4} {'loss':>8} {'MB':>8} {'ms':>9} {'GB/s':>7}  {'workers (transport@version)':<40} check")
    rows, ok = [], True
    for step in range(1, args.steps + 1):
        loss = ray.get(trainer.call.remote(train_step, step), timeout=args.timeout_s)
        report = ws.sync(version=step)
        try:
            ws.verify()
            check = "bit-exact"
        except Exception as exc:  # noqa: BLE001 - reported in the table and the exit code
            check = f"MISMATCH: {exc}"
            ok = False
        who = " ".join(f"{w.transport}@{w.version}" for w in report.workers)
        _print(
            f"{step:>4} {loss:>8.4f} {report.bytes / 1e6:>8.1f} {report.seconds * 1e3:>9.2f} "
            f"{report.gbps:>7.2f}  {who:<40} {check}"
        )
        rows.append({"step": step, "loss": loss, **report.to_dict(), "check": check})
    losses = [r["loss"] for r in rows]
    if len(losses) >= 2 and not losses[-1] < losses[0]:
        _print(f"warning: the loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})")
    ws.close()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    _print(
        f"demo {'passed' if ok else 'FAILED'}: {args.steps} syncs to {args.workers} worker(s), "
        f"every worker {'bit-exact with' if ok else 'checked against'} the trainer after each"
    )
    return ok


def doctor(args: argparse.Namespace) -> int:
    """Print versions, devices, Ray resources, and which transports work here (and why not)."""
    _print(f"python {platform.python_version()} on {platform.machine()} {platform.system()}")
    _print(f"torch {torch.__version__}; CUDA available: {torch.cuda.is_available()}")
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(i)
        _print(f"  cuda:{i} {props.name} {props.total_memory / GIB:.0f} GiB uuid {props.uuid}")
    try:
        import ray

        _print(f"ray {ray.__version__}")
    except ImportError as exc:
        _print(f"ray: not importable ({exc}); set up .venv with `bash scripts/run.sh demo` and run .venv/bin/python")
        return 1
    try:
        import cupy

        from weightsync.mechanisms.nccl import nccl_version

        version = nccl_version()
        _print(f"cupy {cupy.__version__}; NCCL {version or 'not loadable'}")
    except ImportError:
        _print(
            "cupy: not installed (GPU broadcast needs the cuda12 or cuda13 extra; scripts/run.sh adds it on a GPU machine)"
        )
    from weightsync.mechanisms.shm import SHM_DIR, leftover_segments

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    _print("transports:")
    rows = [
        row
        for transport in registry.transports()
        for row in (transport.usable_here() if transport.usable_here is not None else [(transport.name, None)])
    ]
    width = max(len(label) for label, _ in rows)
    for label, why in rows:
        _print(f"  {label:<{width}}  {'usable' if why is None else 'unusable: ' + why}")
    if gpus == 1:
        _print("  note: NCCL between trainer and workers needs them on different GPUs; one GPU means ipc/direct")
    leftovers = leftover_segments()
    if leftovers:
        _print(f"warning: {len(leftovers)} weightsync segment(s) left in {SHM_DIR}: {leftovers[:5]}")
    if args.ray:
        from weightsync.tools.cluster import connect

        how = connect(args.address)
        _print(f"ray cluster ({how['mode']}): {ray.cluster_resources()}")
        ray.shutdown()
    return 0


DESCRIPTION = """\
Move model weights from a trainer to inference workers (Ray actors), and try it here.

Run from the repository root after `bash scripts/run.sh demo` has set up .venv, e.g.
  .venv/bin/python -m weightsync demo --workers 3 --transport broadcast
  .venv/bin/python -m weightsync bench --help
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=".venv/bin/python -m weightsync",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,doctor,cluster}")
    _add_demo(sub)
    b = sub.add_parser(
        "bench",
        help="measure sync speed against baselines and the hardware limit",
        description="Measure sync speed against baselines and the hardware limit (docs/benchmarks.md).",
        formatter_class=DefaultsHelpFormatter,
    )
    from weightsync.tools.bench import add_arguments

    add_arguments(b)

    c = sub.add_parser(
        "cluster",
        help="a local Ray head (loopback, token auth) and job submission to it",
        description="A local Ray head (loopback, token auth, job server) and job submission to it.",
        formatter_class=DefaultsHelpFormatter,
    )
    from weightsync.tools.cluster_cli import add_arguments as add_cluster_arguments

    add_cluster_arguments(c)
    _add_doctor(sub)
    return parser


def _add_demo(sub: Subparsers[argparse.ArgumentParser]) -> None:
    d = sub.add_parser(
        "demo",
        help="train a small policy and sync it to workers after every step",
        description=demo.__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    d.add_argument("--address", help="join this Ray cluster (default: $RAY_ADDRESS, else start a local one)")
    d.add_argument("--workers", type=positive_int, default=2, help="inference workers to sync to")
    d.add_argument(
        "--transport",
        default="auto",
        type=_demo_transport,
        metavar="{" + ",".join(demo_transports()) + "}",
        help="how every worker is synced; auto picks per worker (direct, ipc or broadcast)",
    )
    d.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="where the trainer and workers hold the model"
    )
    d.add_argument("--steps", type=positive_int, default=5, help="training steps, each followed by a sync")
    d.add_argument("--size", default="30mb", choices=list(SIZES), help="the policy's size (bytes of its weights)")
    d.add_argument(
        "--buffer-mib",
        dest="buffer_bytes",
        metavar="BUFFER_MIB",
        type=mib_as_bytes,
        default=None,
        help="buffer size in MiB (default: auto, sized from the model)",
    )
    d.add_argument(
        "--num-buffers", type=positive_int, default=DEFAULT_NUM_BUFFERS, help="buffers in rotation (1 serializes)"
    )
    d.add_argument(
        "--timeout",
        dest="timeout_s",
        metavar="TIMEOUT",
        type=positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        help="seconds any wait may take",
    )
    d.add_argument("--verify", action="store_true", help="per-chunk checksums on every sync (default: off)")
    d.add_argument(
        "--num-cpus", type=int, default=None, help="CPUs for an embedded cluster (default: all of this machine's)"
    )
    d.add_argument("--json", help="write the per-step reports to this file (default: not written)")
    d.set_defaults(func=demo)


def _add_doctor(sub: Subparsers[argparse.ArgumentParser]) -> None:
    doc = sub.add_parser(
        "doctor",
        help="versions, devices, and which transports work here",
        description=doctor.__doc__,
        formatter_class=DefaultsHelpFormatter,
    )
    doc.add_argument(
        "--ray", action="store_true", help="also start (or join) Ray and list its resources (default: off)"
    )
    doc.add_argument("--address", help="with --ray: join this Ray cluster (default: $RAY_ADDRESS, else start one)")
    doc.set_defaults(func=doctor)


def main(argv: Sequence[str] | None = None) -> int:
    """Run a command; what weightsync refuses or reports as failed (a :class:`WeightSyncError`:
    a setting, an address, a setup or sync that failed) is one line on stderr, not a traceback:
    exit 2 for a refused setting, 1 otherwise."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except WeightSyncError as exc:
        print(f"weightsync {args.command}: error: {exc}", file=sys.stderr, flush=True)
        return 2 if isinstance(exc, SettingsError) else 1
