"""Packed against in-place broadcast, per tensor size, over gloo to N receivers (CPU).

For each size S, a model of ``--total-mib`` of float32 tensors of S bytes each is synced
with every tensor packed (``inplace_bytes=0``) and with every tensor in place
(``inplace_bytes=S``), through the real BroadcastSender/BroadcastReceiver, one process per
rank over loopback. Time per sync: from a barrier before it to a barrier after it on every
rank (so every receiver's unpack counts), median of ``--repeats``. The size where in place
starts to win is the threshold (``weightsync.core.wire.settings.DEFAULT_INPLACE_BYTES``)::

    .venv/bin/python scripts/inplace_threshold.py --sizes-kib 16,64,256,1024,4096 --receivers 2
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
from torch import nn

from weightsync.core.wire.settings import DEFAULT_TIMEOUT_S, MIB


class Flat(nn.Module):
    def __init__(self, count: int, numel: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for i in range(count):
            self.register_buffer(f"t{i}", torch.randn(numel, generator=gen))


def rank_main(rank: int, world: int, port: int, args: Any, size: int, inplace: int, out: Any) -> None:
    from weightsync import WeightReceiver, WeightSender
    from weightsync.core.wire import SyncCall, SyncSettings
    from weightsync.mechanisms.gloo import GlooCommunicator
    from weightsync.transports.broadcast.halves import BroadcastReceiver, BroadcastSender

    torch.set_num_threads(1)
    count = max(1, args.total_mib * MIB // size)
    settings = SyncSettings(
        buffer_bytes=args.buffer_mib * MIB,
        num_buffers=args.num_buffers,
        inplace_bytes=inplace,
        timeout_s=DEFAULT_TIMEOUT_S,
    )
    model = Flat(count, size // 4, rank)
    manifest = WeightSender(Flat(count, size // 4, 0)).manifest(settings)
    members = ["trainer", *(f"r{i}" for i in range(1, world))]
    comm = GlooCommunicator("127.0.0.1", port, rank, world, "thr", DEFAULT_TIMEOUT_S)
    if rank == 0:
        endpoint: Any = WeightSender(model)
        endpoint.manifest(settings)
    else:
        endpoint = WeightReceiver(model, name=members[rank])
        endpoint.accept(manifest, timeout_s=DEFAULT_TIMEOUT_S)
    half = BroadcastSender if rank == 0 else BroadcastReceiver
    endpoint.install(half(comm, endpoint.session, members))
    times = []
    for seq in range(args.repeats + 1):
        comm.agree(False, time.monotonic() + DEFAULT_TIMEOUT_S)
        t0 = time.perf_counter()
        call = SyncCall(seq=seq, version=seq + 1)
        endpoint.send(call) if rank == 0 else endpoint.receive(call)
        comm.agree(False, time.monotonic() + DEFAULT_TIMEOUT_S)
        times.append(time.perf_counter() - t0)
    endpoint.close_transports()
    if rank == 0:
        out.put(statistics.median(times[1:]))


def measure(args: Any, size: int, inplace: int) -> float:
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    world = args.receivers + 1
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, use_libuv=True)
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, store.port, args, size, inplace, out)) for r in range(world)]
    for p in procs:
        p.start()
    result = float(out.get(timeout=600))
    for p in procs:
        p.join(60)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-kib", default="16,64,256,1024,4096")
    parser.add_argument("--receivers", type=int, default=2)
    parser.add_argument("--total-mib", type=int, default=32)
    parser.add_argument("--buffer-mib", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-buffers", type=int, default=2, help="also the in-place operations kept in flight")
    args = parser.parse_args()
    print(
        f"gloo, {args.receivers} receivers, {args.total_mib} MiB per model, packed buffers {args.buffer_mib} MiB x {args.num_buffers}"
    )
    print(f"{'tensor KiB':>10} {'tensors':>8} {'packed ms':>10} {'in place ms':>12} {'in place/packed':>16}")
    for kib in (int(k) for k in args.sizes_kib.split(",")):
        size = kib * 1024
        packed = measure(args, size, 0)
        inplace = measure(args, size, size)
        count = max(1, args.total_mib * MIB // size)
        print(
            f"{kib:>10} {count:>8} {packed * 1e3:>10.1f} {inplace * 1e3:>12.1f} {inplace / packed:>15.2f}x", flush=True
        )


if __name__ == "__main__":
    main()
