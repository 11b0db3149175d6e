"""CPU broadcast knobs against the raw limit, measured in one set of processes, interleaved.

A trainer and ``--receivers`` receivers (one process each, one gloo group per variant over
loopback) hold the bench's policy of ``--size`` (``weightsync.tools.models``). Every variant
is set up once; then each round times one sync of every variant, in a rotated order, so
that a busy machine's drift falls on all of them alike:

* ``raw``: one gloo broadcast of one buffer of the model's size (the limit), its pages
  written before the first round: the kernel sends a never-written buffer from its one
  shared zero page, which is faster than sending real bytes (1gb: 405 ms against 493 ms);
* ``pieces:N[:D]``: the same buffer as N equal broadcasts, D of them in flight (default 1);
* ``per-tensor[:D]``: one gloo broadcast per tensor, D in flight (default 1: one at a time);
* ``IN:NB:BUF[:D]``: the real ``BroadcastSender``/``BroadcastReceiver`` with ``inplace_bytes``
  IN MiB (0: every tensor packed), ``num_buffers`` NB, ``buffer_bytes`` BUF MiB ("auto":
  the library's choice) and, when given, D operations in flight in place of the library's
  ``max(num_buffers, INPLACE_DEPTH)``.

Time per sync: rank 0's wall time from one barrier (a tiny all-reduce on a group of its
own) before the sync to one after it, so every receiver's unpack counts. Printed: the
median of ``--repeats`` rounds per variant, the raw broadcast's time over it, and each
rank's CPU time (all its threads, gloo's included: on a machine with few cores the CPU a
variant spends is time the others' copies wait for)::

    .venv/bin/python scripts/broadcast_sweep.py --size 100mb --variants raw,per-tensor,4:2:auto,16:2:auto
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from weightsync.core.wire.settings import MIB

TIMEOUT_S = 300.0


def settings_of(variant: str) -> Any:
    from weightsync.core.wire import SyncSettings

    inplace, nbuf, buf = variant.split(":")[:3]
    return SyncSettings(
        buffer_bytes="auto" if buf == "auto" else int(float(buf) * MIB),
        num_buffers=int(nbuf),
        inplace_bytes=int(float(inplace) * MIB),
        timeout_s=TIMEOUT_S,
    )


def rank_main(rank: int, world: int, port: int, args: Any, out: Any) -> None:
    from weightsync import WeightReceiver, WeightSender
    from weightsync.core.sinks import module_tensors
    from weightsync.core.wire import SyncCall
    from weightsync.core.wire.sizing import BufferHints, free_memory_bytes
    from weightsync.mechanisms.gloo import GlooCommunicator
    from weightsync.tools.models import PolicyFactory
    from weightsync.transports.broadcast.halves import BroadcastReceiver, BroadcastSender

    torch.set_num_threads(1)  # as in a Ray actor of num_cpus=0
    model = PolicyFactory(args.size, rank)()
    members = ["trainer", *(f"r{i}" for i in range(1, world))]
    hints = BufferHints(device="cpu", free_bytes=(free_memory_bytes(torch.device("cpu")) or 0,))
    barrier = GlooCommunicator("127.0.0.1", port, rank, world, "sweep-barrier", TIMEOUT_S)
    raw = GlooCommunicator("127.0.0.1", port, rank, world, "sweep-raw", TIMEOUT_S)
    tensors = [t.detach() for _, t in module_tensors(model)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    # Each plain baseline's broadcasts and how many are kept in flight, made once.
    plain = {v: baseline(v, flat, tensors) for v in args.variants if v.split(":")[0] in BASELINES}
    endpoints: dict[str, Any] = {}
    for number, variant in enumerate(args.variants):
        if variant in plain:
            continue
        settings = settings_of(variant)
        # The plan depends on shapes and dtypes only: every rank's own policy gives the trainer's.
        manifest = WeightSender(model).manifest(settings, hints)
        comm = GlooCommunicator("127.0.0.1", port, rank, world, f"sweep-{number}", TIMEOUT_S)
        if rank == 0:
            endpoint: Any = WeightSender(model)
            endpoint.manifest(settings, hints)
        else:
            endpoint = WeightReceiver(model, name=members[rank])
            endpoint.accept(manifest, timeout_s=TIMEOUT_S)
        half = (BroadcastSender if rank == 0 else BroadcastReceiver)(comm, endpoint.session, members)
        if variant.count(":") == 3:
            half.depth = int(variant.split(":")[3])
        endpoint.install(half)
        endpoints[variant] = endpoint
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    cpus: dict[str, list[float]] = {v: [] for v in args.variants}
    seq = 0
    for round_ in range(args.repeats + 1):
        shift = round_ % len(args.variants)
        for variant in args.variants[shift:] + args.variants[:shift]:
            seq += 1
            barrier.agree(False, time.monotonic() + TIMEOUT_S)
            t0, c0 = time.perf_counter(), time.process_time()
            deadline = time.monotonic() + TIMEOUT_S
            if variant in plain:
                in_flight(raw, *plain[variant], deadline)
            else:
                call = SyncCall(seq=seq, version=seq)
                endpoint = endpoints[variant]
                endpoint.send(call) if rank == 0 else endpoint.receive(call)
            cpu = time.process_time() - c0  # this rank's own work, without the barrier's wait
            barrier.agree(False, time.monotonic() + TIMEOUT_S)
            if round_:  # the first round warms up
                times[variant].append(time.perf_counter() - t0)
                cpus[variant].append(cpu)
    for endpoint in endpoints.values():
        endpoint.close_transports()
    raw.close()
    barrier.close()
    out.put(
        (rank, {v: statistics.median(t) for v, t in times.items()}, {v: statistics.median(c) for v, c in cpus.items()})
    )


#: The plain gloo baselines (no weightsync sender or receiver): how few and how many
#: numbers each takes after its name.
BASELINES = {"raw": (0, 0), "pieces": (1, 2), "per-tensor": (0, 1)}


def baseline(variant: str, flat: torch.Tensor, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """A baseline's broadcasts, in order, and how many of them are in flight at once."""
    kind, *numbers = variant.split(":")
    counts = [int(n) for n in numbers]
    if kind == "raw":
        return [flat], 1
    parts = list(flat.tensor_split(counts.pop(0))) if kind == "pieces" else tensors
    return parts, counts[0] if counts else 1


def in_flight(comm: Any, parts: list[torch.Tensor], depth: int, deadline: float) -> None:
    """Broadcast each of ``parts`` from rank 0, keeping up to ``depth`` operations in flight."""
    pending: list[Any] = []
    for part in parts:
        if len(pending) >= depth:
            pending.pop(0).wait(deadline)
        pending.append(comm.broadcast(part, 0))
    for work in pending:
        work.wait(deadline)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="100mb", help="a model size of weightsync.tools.models (default 100mb)")
    parser.add_argument("--receivers", type=int, default=2, help="receiving processes (default 2)")
    parser.add_argument(
        "--variants",
        default="raw,per-tensor,4:2:auto",
        help="comma-separated: raw, pieces:N[:D], per-tensor[:D], or INPLACE_MIB:NUM_BUFFERS:BUFFER_MIB|auto[:D] "
        "(default raw,per-tensor,4:2:auto)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds after one warm-up round (default 7)")
    args = parser.parse_args()
    args.variants = args.variants.split(",")
    for variant in args.variants:
        kind, *numbers = variant.split(":")
        if kind in BASELINES:
            fewest, most = BASELINES[kind]
            if not fewest <= len(numbers) <= most or not all(n.isdigit() and int(n) >= 1 for n in numbers):
                parser.error(f"variant {variant}: expected raw, pieces:N[:D] or per-tensor[:D], counts of at least 1")
        else:
            settings_of(variant)  # refuses a malformed variant before anything starts
            if variant.count(":") == 3 and int(variant.split(":")[3]) < 1:
                parser.error(f"variant {variant}: operations in flight must be at least 1")
    import torch.distributed as dist

    world = args.receivers + 1
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, use_libuv=True)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, store.port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=3600) for _ in procs]
    medians = next(times for rank, times, _ in results if rank == 0)
    cpu = {variant: [0.0] * world for variant in medians}
    for rank, _, cpus in results:
        for variant, seconds in cpus.items():
            cpu[variant][rank] = seconds
    for p in procs:
        p.join(60)
    raw = medians.get("raw")
    print(f"{args.size}, gloo, {args.receivers} receivers, median of {args.repeats} interleaved rounds")
    print(
        f"{'variant (inplace MiB:buffers:buffer MiB[:in flight])':<52} {'median ms':>10} {'raw / it':>9}  cpu ms per rank"
    )
    for variant, median in medians.items():
        ratio = f"{raw / median:8.1%}" if raw else "       -"
        spent = " ".join(f"{seconds * 1e3:7.1f}" for seconds in cpu[variant])
        print(f"{variant:<52} {median * 1e3:>10.2f} {ratio}  {spent}", flush=True)


if __name__ == "__main__":
    main()
