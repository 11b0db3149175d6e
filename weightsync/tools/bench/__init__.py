"""``.venv/bin/python -m weightsync bench``: sync speed next to baselines and the hardware limit.

Everything is measured in one run, on one cluster, with the same actors:

* weightsync transports through the real product path (``WeightSync.sync``: Ray calls,
  hand-offs, commits included): ``ipc`` and ``direct`` (colocated), ``broadcast``
  (gloo on CPU; NCCL needs a second GPU);
* the raw limit: one copy of a single buffer of the model's size (``memcpy`` on CPU, a
  device copy on GPU), and for broadcast one gloo broadcast of such a buffer;
* Ray's floor: one no-op call per side, started together and waited for once (a colocated
  sync's shape); and, for a copy of 1 ms or more, the same with calls as long as the copy,
  its length taken off (what Ray adds to a call that lasts as long as a sync);
* naive per-tensor transfer: one broadcast per tensor (CPU), one CUDA IPC handle per
  tensor (GPU);
* the reference file's design: one IPC slot, strictly serialized, two Ray round trips per
  chunk (pack on the trainer, then consume on the worker);
* the Ray object store: ``ray.put`` of the state dict on the trainer, ``ray.get`` on the
  worker, copied into its parameters;
* a sharded source (CPU): the same model as an FSDP2 trainer of ``--sharded-ranks`` ranks
  (gloo), synced to the same workers (:mod:`~weightsync.tools.bench.sharded`);
* with ``--changed 1%,10%,100%,adamw:1e-6``: dense against delta syncs, fp32 master weights
  sent as bf16, after each change (:mod:`~weightsync.tools.bench.deltas`);
* with ``--vllm-tp N`` (CPU, vLLM installed): N FSDP2 ranks of a Llama of the size into a
  vLLM engine of N TP ranks, relayed by TP rank 0 and fed per rank
  (:mod:`~weightsync.tools.bench.engine_tp`);
* with ``--lora-rank R`` (PEFT installed): the size's policy with a LoRA adapter of rank R,
  its adapter synced (``lora=True``) against the same policy synced whole
  (:mod:`~weightsync.tools.bench.lora`).

Each case: one warm-up sync, then ``--repeats`` timed syncs (median, min, max), effective
GB/s (model bytes / median), the ratio to the raw one-copy limit, and the peak extra memory
on each side during the case.

Layout: :mod:`~weightsync.tools.bench.driver` measures (the cases, in order),
:mod:`~weightsync.tools.bench.baselines` the cases outside weightsync,
:mod:`~weightsync.tools.bench.probes` runs inside the actors, :mod:`~weightsync.tools.bench.report`
prints and writes the results, :mod:`~weightsync.tools.bench.chart` draws them (``--plot``).
This module holds the command line.
"""

from __future__ import annotations

import argparse
import os
import sys

from weightsync.tools.bench.deltas import changed_list
from weightsync.tools.bench.driver import Bench
from weightsync.tools.cli_types import (
    comma_list,
    positive_int,
    positive_int_list,
    positive_int_list_or_none,
    positive_seconds,
)
from weightsync.tools.models import SIZES

#: The case groups ``--transports`` selects.
TRANSPORTS = ("ipc", "direct", "broadcast", "naive", "objectstore")
#: The bench's bound on any sync or Ray call: longer than the library's default timeout,
#: since it moves models of up to 16 GB on machines others load too.
TIMEOUT_S = 300.0
#: The buffer sizes of the knob sweeps, in MiB; the first is the reference design's slot.
SWEEP_BUFFER_MIB = (256, 64, 1024, 2048)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_case_arguments(parser)
    add_extra_case_arguments(parser)
    add_run_arguments(parser)
    parser.set_defaults(func=run)


def add_case_arguments(parser: argparse.ArgumentParser) -> None:
    """Which cases run (where, at which sizes, over which transports, with which knobs) and how often."""
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where every party holds the model")
    parser.add_argument(
        "--sizes",
        type=comma_list(list(SIZES)),
        default=None,
        help=f"comma-separated model sizes from {', '.join(SIZES)} (default: cpu 1mb,100mb,1gb; cuda 100mb,1gb,16gb)",
    )
    parser.add_argument(
        "--transports",
        type=comma_list(TRANSPORTS),
        default=list(TRANSPORTS),
        help="comma-separated cases to run (default: all of ipc,direct,broadcast,naive,objectstore)",
    )
    parser.add_argument(
        "--buffer-mib",
        type=positive_int_list,
        default=None,
        help="buffer sizes in MiB for the knob sweeps (the main cases use the library's defaults, buffer_bytes='auto'); "
        f"default {','.join(map(str, SWEEP_BUFFER_MIB))}, and on CPU no sweep unless given",
    )
    parser.add_argument(
        "--workers", type=positive_int, default=2, help="workers (broadcast receivers); colocated cases use the first"
    )
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed syncs per case, after one warm-up")
    parser.add_argument(
        "--quick", action="store_true", help="skip the buffer-size / buffer-count sweep (default: off; on CPU no sweep)"
    )
    parser.add_argument(
        "--object-store-max-mb", type=float, default=2000, help="skip the object-store baseline above this size"
    )


def add_extra_case_arguments(parser: argparse.ArgumentParser) -> None:
    """The rows beyond the main cases, each off unless asked: sharded trainers, vLLM engines,
    LoRA adapters, delta syncs."""
    parser.add_argument(
        "--sharded-ranks",
        type=positive_int_list_or_none,
        default=None,
        help="rank counts of the sharded (FSDP2, gloo) trainer cases, e.g. 2,4; 'none' skips them (default: cpu 2)",
    )
    parser.add_argument(
        "--vllm-tp",
        type=positive_int,
        default=None,
        help="also sync a sharded trainer of N ranks into a vLLM engine of N TP ranks, relayed and fed per rank "
        "(rank-ipc); CPU, needs vLLM (default: off)",
    )
    parser.add_argument(
        "--lora-rank",
        type=positive_int,
        default=None,
        help="also wrap each size's policy with a PEFT LoRA adapter of this rank and sync the adapter alone "
        "(lora=True) against the whole model, per transport; needs PEFT (default: off)",
    )
    parser.add_argument(
        "--changed",
        type=changed_list,
        default=None,
        help="also time dense against delta syncs (fp32 master weights, bf16 wire) after each change: N%% of the "
        "elements perturbed, or adamw:LR for a real AdamW step, e.g. 1%%,10%%,100%%,adamw:1e-6 (default: off)",
    )
    parser.add_argument(
        "--changed-only", action="store_true", help="run only the --changed rows (default: off: every case)"
    )


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """How the bench runs: the bound on every call, the cluster, the output files."""
    parser.add_argument(
        "--timeout",
        dest="timeout_s",
        metavar="TIMEOUT",
        type=positive_seconds,
        default=TIMEOUT_S,
        help="seconds any sync or Ray call may take",
    )
    parser.add_argument("--address", help="join this Ray cluster (default: $RAY_ADDRESS, else start a local one)")
    parser.add_argument(
        "--num-cpus", type=int, default=None, help="CPUs for an embedded cluster (default: all of this machine's)"
    )
    parser.add_argument("--json", help="write every case to this file (default: not written)")
    parser.add_argument(
        "--plot",
        help="draw every case's GB/s against its raw limit, per size, into this file: .svg needs nothing more, "
        "other suffixes (.png) need matplotlib, the plot extra (default: not written)",
    )


def run(args: argparse.Namespace) -> int:
    if args.sizes is None:
        args.sizes = ["100mb", "1gb", "16gb"] if args.device == "cuda" else ["1mb", "100mb", "1gb"]
    if args.sharded_ranks is None:
        args.sharded_ranks = [] if args.device == "cuda" else [2]
    # The sharded cases run at the library's default buffers unless --buffer-mib was given.
    args.buffer_mib_given = args.buffer_mib is not None
    if args.buffer_mib is None:
        args.buffer_mib = list(SWEEP_BUFFER_MIB)
        # The main cases run at the library's defaults; on a CPU the knob sweep is opt-in
        # (pass --buffer-mib) so that a plain ``bench`` stays quick.
        args.quick = args.quick or args.device == "cpu"
    if args.changed_only and not args.changed:
        print("bench: --changed-only needs --changed (e.g. --changed 1%,10%,100%)", file=sys.stderr)
        return 2
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return Bench(args).run()
