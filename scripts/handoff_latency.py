"""What a hand-off between processes costs on this host: the floor under a colocated sync.

Three probes, each in processes of its own (no weightsync code in the timed paths)::

    .venv/bin/python scripts/handoff_latency.py --probes wake,ray,gpu

* ``wake``: a ping over a Unix datagram socket to a process blocked in ``recv``, after the
  pinger was idle 0, 0.1, 1, 10 and 50 ms: on a virtual machine a process idle for a while
  wakes slowly, and every hand-off of a sync after a long copy meets such a process.
* ``ray``: two Ray actors' calls started together and waited for once (a colocated sync's
  shape), instant and as long as ``--call-ms``: submit -> method starts, and method ends ->
  ``ray.get`` returns, with the driver blocked in ``ray.get`` or spinning on ``ray.wait``.
* ``gpu``: process A copies 1 MiB, records an interprocess CUDA event and tells B over a
  pipe; B copies 1 MiB (after waiting on the event, or not) and answers when done; against
  one process making both copies: what a second context's kernel costs on one GPU (ipc's
  hand-off per chunk).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

MIB = 1 << 20


def _echo(listen: str, answer: str) -> None:
    inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    inbox.bind(listen)
    out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    while (data := inbox.recv(16)) != b"q":
        out.sendto(data, answer)


def wake(pings: int) -> None:
    listen, answer = f"\0handoff-in-{os.getpid()}", f"\0handoff-out-{os.getpid()}"
    me = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    me.bind(answer)
    child = mp.get_context("spawn").Process(target=_echo, args=(listen, answer))
    child.start()
    send = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    deadline = time.monotonic() + 60
    while True:  # until the echo's socket is bound
        try:
            send.sendto(b"x", listen)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline or not child.is_alive():
                raise
            time.sleep(0.01)
    me.recv(16)
    for idle in (0.0, 1e-4, 1e-3, 1e-2, 5e-2):
        times = []
        for _ in range(pings):
            if idle:
                time.sleep(idle)
            start = time.perf_counter()
            send.sendto(b"x", listen)
            me.recv(16)
            times.append(time.perf_counter() - start)
        times.sort()
        print(
            f"wake: idle {idle * 1e3:5.1f} ms before a ping: round trip median {statistics.median(times) * 1e6:6.1f} us, "
            f"p90 {times[int(0.9 * len(times))] * 1e6:6.1f} us"
        )
    send.sendto(b"q", listen)
    child.join()


def ray_legs(call_ms: float, calls: int) -> None:
    import ray

    from weightsync.tools.cluster import connect

    @ray.remote(num_cpus=0)
    class Party:
        def run(self, seconds: float) -> tuple[float, float]:
            start = time.time()
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                time.sleep(20e-6)
            return start, time.time()

    connect()
    parties = [Party.remote(), Party.remote()]  # type: ignore[attr-defined]
    ray.get([p.run.remote(0) for p in parties], timeout=60)
    for seconds in (0.0, call_ms / 1e3):
        for spin in (False, True):
            legs_in, legs_out = [], []
            for _ in range(calls):
                entered = time.time()
                refs = [p.run.remote(seconds) for p in parties]
                while spin and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
                    pass
                out = ray.get(refs, timeout=60)
                left = time.time()
                legs_in.append(min(s for s, _ in out) - entered)
                legs_out.append(left - max(e for _, e in out))
            print(
                f"ray: calls of {seconds * 1e3:4.1f} ms, driver {'spinning' if spin else 'in ray.get'}: submit -> start "
                f"{statistics.median(legs_in) * 1e3:.3f} ms, end -> return {statistics.median(legs_out) * 1e3:.3f} ms"
            )
    for p in parties:
        ray.kill(p)


def _second(conn: Connection) -> None:
    import torch

    stream = torch.cuda.Stream()
    src = torch.empty(MIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", torch.cuda.current_device()), conn.recv())
    conn.send("ready")
    while (order := conn.recv()) != "q":
        with torch.cuda.stream(stream):
            if order == "wait":
                stream.wait_event(event)
            dst.copy_(src)
        while not stream.query():
            pass
        conn.send("done")


def gpu(rounds: int) -> None:
    import torch

    mine, theirs = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=_second, args=(theirs,))
    child.start()
    stream = torch.cuda.Stream()
    src = torch.empty(MIB, dtype=torch.uint8, device="cuda")
    mid, dst = torch.empty_like(src), torch.empty_like(src)
    event = torch.cuda.Event(interprocess=True)
    event.record(stream)
    torch.cuda.synchronize()
    mine.send(event.ipc_handle())
    mine.recv()

    def timed(step: Any) -> float:
        times = []
        for i in range(rounds + 20):
            start = time.perf_counter()
            step()
            while not stream.query():
                pass
            if i >= 20:
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    def handed(order: str) -> None:
        with torch.cuda.stream(stream):
            mid.copy_(src)
            event.record(stream)
        mine.send(order)
        mine.recv()

    def alone() -> None:
        with torch.cuda.stream(stream):
            mid.copy_(src)
            dst.copy_(mid)

    print(
        f"gpu: a 1 MiB copy in each of two processes, the second waiting on the first's event "
        f"{timed(lambda: handed('wait')):.1f} us, not waiting {timed(lambda: handed('free')):.1f} us; "
        f"both copies in one process {timed(alone):.1f} us"
    )
    mine.send("q")
    child.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probes", default="wake,ray", help="comma-separated: wake, ray, gpu (default: wake,ray)")
    parser.add_argument("--call-ms", type=float, default=12.0, help="the long calls of the ray probe (default: 12)")
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    probes = args.probes.split(",")
    unknown = sorted(set(probes) - {"wake", "ray", "gpu"})
    if unknown:
        parser.error(f"unknown probe(s) {unknown}; choose from wake, ray, gpu")
    if "gpu" in probes:
        import torch

        if not torch.cuda.is_available():
            parser.error("the gpu probe needs a CUDA GPU; run --probes wake,ray here")
    if "wake" in probes:
        wake(args.repeats)
    if "ray" in probes:
        ray_legs(args.call_ms, args.repeats)
    if "gpu" in probes:
        gpu(args.repeats * 5)


if __name__ == "__main__":
    main()
