"""``python -m weightsync bench``: sync speed next to baselines and the hardware limit.

Everything is measured in one run, on one cluster, with the same actors:

* weightsync transports through the real product path (``WeightSync.sync``: Ray calls,
  hand-offs, commits included): ``ipc`` and ``direct`` (colocated), ``broadcast``
  (gloo on CPU; NCCL needs a second GPU);
* the raw limit: one copy of a single buffer of the model's size (``memcpy`` on CPU, a
  device copy on GPU), and for broadcast one gloo broadcast of such a buffer;
* naive per-tensor transfer: one broadcast per tensor (CPU), one CUDA IPC handle per
  tensor (GPU);
* the reference file's design: one IPC slot, strictly serialized, two Ray round trips per
  chunk (pack on the trainer, then consume on the worker);
* the Ray object store: ``ray.put`` of the state dict on the trainer, ``ray.get`` on the
  worker, copied into its parameters.

Each case: one warm-up sync, then ``--repeats`` timed syncs (median, min, max), effective
GB/s (model bytes / median), the ratio to the raw one-copy limit, and the peak extra memory
on each side during the case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from weightsync.models import SIZES, PolicyFactory

MIB = 1024 * 1024


@dataclass
class Case:
    size: str
    name: str
    model_bytes: int
    buffer_mib: int | None = None
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


# --- probes that run inside the actors ------------------------------------------------------


def _memory_reset(model: torch.nn.Module) -> int:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets the peak resident size (VmHWM)
    return _status_kb("VmRSS") * 1024


def _memory_peak(model: torch.nn.Module) -> int:
    device = next(model.parameters()).device
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return _status_kb("VmHWM") * 1024


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key))


def _raw_copy_seconds(model: torch.nn.Module, nbytes: int, repeats: int) -> float:
    """One copy of a single ``nbytes`` buffer on the model's device: the one-copy limit."""
    device = next(model.parameters()).device
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return statistics.median(times[1:])


def _state_cpu(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from weightsync.sinks import module_tensors

    return {name: t.detach().cpu() for name, t in module_tensors(model)}


def _load_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> int:
    from weightsync.sinks import module_tensors

    held = dict(module_tensors(model))
    with torch.no_grad():
        for name, tensor in state.items():
            held[name].copy_(tensor, non_blocking=True)
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()
    return len(state)


def _export_per_tensor(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """Naive CUDA IPC: a fresh export of every tensor, every sync."""
    from torch.multiprocessing.reductions import reduce_tensor

    from weightsync.sinks import module_tensors

    torch.cuda.synchronize()
    return [(name, reduce_tensor(t.detach())[1]) for name, t in module_tensors(model)]


def _import_per_tensor(model: torch.nn.Module, handles: list[tuple[str, Any]]) -> int:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from weightsync.sinks import module_tensors

    held = dict(module_tensors(model))
    with torch.no_grad():
        for name, args in handles:
            args = list(args)
            args[6] = torch.cuda.current_device()
            held[name].copy_(rebuild_cuda_tensor(*args))
    torch.cuda.synchronize()
    return len(handles)


#: Per actor process: the raw-broadcast baseline's communicator, store and buffer.
_RAW: dict[str, Any] = {}


def _gloo_join(model: torch.nn.Module, host: str, port: int, rank: int, world: int) -> None:
    from weightsync.transport.gloo import GlooCommunicator

    _RAW["comm"] = GlooCommunicator(host, port, rank, world, "bench-raw", 300.0, bind_host=host)


def _gloo_open_store(model: torch.nn.Module, host: str, world: int) -> int:
    from weightsync.transport.gloo import open_store

    _RAW["store"] = open_store(host, 0, world, 300.0)
    return int(_RAW["store"].port)


def _gloo_join_root(model: torch.nn.Module, host: str, world: int) -> None:
    from weightsync.transport.gloo import GlooCommunicator

    _RAW["comm"] = GlooCommunicator(host, 0, 0, world, "bench-raw", 300.0, bind_host=host, store=_RAW["store"])


def _gloo_broadcast(model: torch.nn.Module, per_tensor: bool, nbytes: int) -> None:
    """Root and receivers alike: one buffer of ``nbytes``, or every tensor in turn."""
    from weightsync.sinks import module_tensors

    comm = _RAW["comm"]
    deadline = time.monotonic() + 300
    if per_tensor:
        for _, tensor in module_tensors(model):
            comm.broadcast(tensor.detach(), 0).wait(deadline)
    else:
        buf = _RAW.get("buf")
        if buf is None or buf.numel() != nbytes:
            buf = _RAW["buf"] = torch.empty(nbytes, dtype=torch.uint8)
        comm.broadcast(buf, 0).wait(deadline)


def _gloo_close(model: torch.nn.Module) -> None:
    comm = _RAW.pop("comm", None)
    if comm is not None:
        comm.close()
    _RAW.clear()


def _nothing(model: torch.nn.Module, *_: Any) -> None:
    return None


# --- the driver ------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import ray

        self.ray = ray
        self.args = args
        self.cases: list[Case] = []
        self.timeout = args.timeout

    def get(self, ref: Any) -> Any:
        return self.ray.get(ref, timeout=self.timeout)

    def memory_base(self, parties: list[Any]) -> list[int]:
        """Reset each side's peak counter; returns what each holds now."""
        return list(self.get([p.call.remote(_memory_reset) for p in parties]))

    def timed(
        self, case: Case, one: Callable[[], float | None], parties: list[Any], base: list[int] | None = None
    ) -> Case:
        """Warm up once, then time ``repeats`` runs of ``one``. Peak memory counts from
        ``base`` (taken before a case's setup, so its buffers count) or from now."""
        if base is None:
            base = self.memory_base(parties)
        one()
        case.times = []
        case.send_times = []
        for _ in range(self.args.repeats):
            t0 = time.perf_counter()
            measured = one()
            case.times.append(measured if measured is not None else time.perf_counter() - t0)
        peaks = self.get([p.call.remote(_memory_peak) for p in parties])
        case.trainer_extra_mb = (peaks[0] - base[0]) / 1e6
        case.worker_extra_mb = (peaks[1] - base[1]) / 1e6 if len(parties) > 1 else None
        self.cases.append(case)
        self.show(case)
        return case

    def show(self, c: Case) -> None:
        knobs = f"{c.buffer_mib or '':>5} {c.num_buffers or '':>2}"
        ratio = f"{c.limit_s / c.median:6.1%}" if c.limit_s else "     -"
        extra = f"{c.trainer_extra_mb or 0:8.0f} {c.worker_extra_mb if c.worker_extra_mb is not None else 0:8.0f}"
        send = f"{statistics.median(c.send_times) * 1e3:8.2f}" if c.send_times else f"{'-':>8}"
        print(
            f"{c.size:>6} {c.name:<34} {knobs} {c.median * 1e3:10.2f} {min(c.times) * 1e3:9.2f}-{max(c.times) * 1e3:<9.2f}"
            f" {send} {c.gbps:8.2f} {ratio}  {extra}  {c.note}",
            flush=True,
        )

    def header(self) -> None:
        print(
            f"{'size':>6} {'case':<34} {'MiB':>5} {'nb':>2} {'median ms':>10} {'min-max ms':>19} {'send ms':>8}"
            f" {'GB/s':>8} {'/raw':>6}"
            f"  {'trainMB':>8} {'workMB':>8}",
            flush=True,
        )

    def run(self) -> int:
        from weightsync.actors import TrainerActor, WorkerActor
        from weightsync.cluster import connect

        args = self.args
        cuda = args.device == "cuda"
        connect(args.address, num_cpus=args.num_cpus)
        opts: dict[str, Any] = {"num_cpus": 0}
        if cuda:
            # Colocated cases need one GPU shared by the trainer and one worker; NCCL cases
            # would need more GPUs, which this bench does not place yet.
            args.workers = 1
            opts["num_gpus"] = 0.5
        self.header()
        for size in args.sizes:
            factory_device = "cuda" if cuda else "cpu"
            trainer = TrainerActor.options(**opts).remote(PolicyFactory(size, 0, factory_device), device=args.device)
            workers = [
                WorkerActor.options(**opts).remote(PolicyFactory(size, i + 1, factory_device), device=args.device)
                for i in range(args.workers)
            ]
            try:
                self.size_cases(size, trainer, workers)
            finally:
                for handle in [trainer, *workers]:
                    self.ray.kill(handle)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(
                    {
                        "args": {k: v for k, v in vars(args).items() if k != "func"},
                        "cases": [c.row() for c in self.cases],
                    },
                    fh,
                    indent=2,
                )
            print(f"wrote {args.json}")
        if args.plot:
            self.plot(args.plot)
        return 0

    def size_cases(self, size: str, trainer: Any, workers: list[Any]) -> None:
        from weightsync.coordinator import WeightSync

        args = self.args
        cuda = args.device == "cuda"
        parties = [trainer, workers[0]]
        manifest = self.get(trainer.ws_manifest.remote(args.buffer_mib[0] * MIB, 2, 256))
        nbytes = manifest.total_bytes
        copy_s = self.get(trainer.call.remote(_raw_copy_seconds, nbytes, args.repeats))
        self.cases.append(
            Case(
                size,
                "raw limit: one copy of one buffer",
                nbytes,
                times=[copy_s] * 2,
                limit_s=copy_s,
                note=f"{len(manifest.specs)} tensors",
            )
        )
        self.show(self.cases[-1])
        version = [0]

        def sync_case(
            name: str, transport: str, buffer_mib: int, nbuf: int, limit: float | None, members: list[Any]
        ) -> None:
            base = self.memory_base(parties)
            ws = WeightSync(
                trainer,
                members,
                transport=transport,
                buffer_bytes=buffer_mib * MIB,
                num_buffers=nbuf,
                timeout_s=self.timeout,
            )
            try:
                ws.setup()
            except Exception as exc:  # noqa: BLE001 - a case that cannot run is reported, not fatal
                print(f"{size:>6} {name:<34} skipped: {exc}".splitlines()[0], flush=True)
                return

            case = Case(size, name, nbytes, buffer_mib, nbuf, limit_s=limit)

            def one() -> float:
                version[0] += 1
                report = ws.sync(version[0])
                case.send_times.append(report.send_seconds)
                return report.seconds

            self.timed(case, one, parties, base)
            ws.close()

        self.ray_floor_case(size, trainer, workers[0], nbytes)
        first = args.buffer_mib[0]
        colocated = ["ipc", "direct"] if ("ipc" in args.transports or "direct" in args.transports) else []
        for transport in colocated:
            if transport not in args.transports:
                continue
            sync_case(f"weightsync {transport}", transport, first, 2, copy_s, workers[:1])
        if "ipc" in args.transports and not args.quick:
            for buffer_mib in args.buffer_mib:
                for nbuf in (1, 2, 3):
                    if (buffer_mib, nbuf) != (first, 2) and buffer_mib * MIB <= max(2 * nbytes, first * MIB):
                        sync_case("weightsync ipc (knobs)", "ipc", buffer_mib, nbuf, copy_s, workers[:1])
            self.reference_case(size, trainer, workers[0], nbytes, copy_s, first)
        if "broadcast" in args.transports and not cuda:
            raw = self.gloo_case(size, trainer, workers, nbytes, per_tensor=False)
            for n in sorted({1, len(workers)}):
                sync_case(
                    f"weightsync broadcast, {n} receiver(s)",
                    "broadcast",
                    first,
                    2,
                    raw if n == len(workers) else None,
                    workers[:n],
                )
            if not args.quick:
                for buffer_mib in args.buffer_mib[1:]:
                    sync_case("weightsync broadcast (knobs)", "broadcast", buffer_mib, 2, raw, workers)
                for nbuf in (1, 3):
                    sync_case("weightsync broadcast (knobs)", "broadcast", first, nbuf, raw, workers)
            self.gloo_case(size, trainer, workers, nbytes, per_tensor=True, limit=raw)
        if cuda and "naive" in args.transports:

            def naive() -> None:
                handles = self.get(trainer.call.remote(_export_per_tensor))
                self.get(workers[0].call.remote(_import_per_tensor, handles))

            self.timed(
                Case(size, "naive: one CUDA IPC handle per tensor", nbytes, limit_s=copy_s), lambda: naive(), parties
            )
        if "objectstore" in args.transports and nbytes <= args.object_store_max_mb * 1e6:

            def object_store() -> None:
                self.get(workers[0].call.remote(_load_state, trainer.call.remote(_state_cpu)))

            self.timed(
                Case(size, "ray object store (put/get state dict)", nbytes, limit_s=copy_s),
                lambda: object_store(),
                parties,
            )

    def ray_floor_case(self, size: str, trainer: Any, worker: Any, nbytes: int) -> None:
        """The hand-off floor: a colocated sync's shape (one call per side, started
        together, waited for once), doing nothing."""

        def one() -> None:
            self.get([worker.call.remote(_nothing), trainer.call.remote(_nothing)])

        self.timed(
            Case(size, "ray floor: one no-op call per side", nbytes, note="what any sync pays for Ray"),
            one,
            [trainer, worker],
        )

    def reference_case(self, size: str, trainer: Any, worker: Any, nbytes: int, copy_s: float, buffer_mib: int) -> None:
        """The reference design: one slot, pack then consume, a Ray round trip each, per chunk."""
        from weightsync.coordinator import WeightSync

        base = self.memory_base([trainer, worker])
        ws = WeightSync(
            trainer, [worker], transport="ipc", buffer_bytes=buffer_mib * MIB, num_buffers=1, timeout_s=self.timeout
        )
        manifest = ws.setup()

        def one() -> None:
            for chunk in manifest.chunks:
                handle = self.get(trainer.ws_pack_ipc_chunk.remote(chunk.index, 0))
                self.get(worker.ws_consume_ipc_chunk.remote(handle))

        self.timed(
            Case(
                size,
                "reference: 1 slot, serialized via Ray",
                nbytes,
                buffer_mib,
                1,
                limit_s=copy_s,
                note=f"{len(manifest.chunks)} chunks",
            ),
            one,
            [trainer, worker],
            base,
        )
        ws.close()

    def gloo_case(
        self, size: str, trainer: Any, workers: list[Any], nbytes: int, per_tensor: bool, limit: float | None = None
    ) -> float:
        world = len(workers) + 1
        port = self.get(trainer.call.remote(_gloo_open_store, "127.0.0.1", world))
        self.get(
            [trainer.call.remote(_gloo_join_root, "127.0.0.1", world)]
            + [w.call.remote(_gloo_join, "127.0.0.1", port, r, world) for r, w in enumerate(workers, start=1)]
        )

        def one() -> None:
            self.get([p.call.remote(_gloo_broadcast, per_tensor, nbytes) for p in [trainer, *workers]])

        name = (
            "naive: one gloo broadcast per tensor"
            if per_tensor
            else f"raw limit: one gloo broadcast, {len(workers)} recv"
        )
        case = self.timed(Case(size, name, nbytes, limit_s=limit), one, [trainer, workers[0]])
        self.get([p.call.remote(_gloo_close) for p in [trainer, *workers]])
        if not per_tensor:
            case.limit_s = case.median
        return case.median

    def plot(self, path: str) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed (pip install 'weightsync[plot]'); no plot written")
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        for size in dict.fromkeys(c.size for c in self.cases):
            for nbuf in (1, 2, 3):
                pts = sorted(
                    (c.buffer_mib, c.gbps)
                    for c in self.cases
                    if c.size == size and c.num_buffers == nbuf and c.name.startswith("weightsync ipc")
                )
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{size} ipc, {nbuf} buffer(s)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("buffer size (MiB)")
        ax.set_ylabel("effective GB/s")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        print(f"wrote {path}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--sizes",
        type=lambda s: s.split(","),
        default=None,
        help=f"comma-separated model sizes from {', '.join(SIZES)} (default: cpu 1mb,100mb,1gb; cuda 100mb,1gb,16gb)",
    )
    parser.add_argument(
        "--transports",
        type=lambda s: s.split(","),
        default=["ipc", "direct", "broadcast", "naive", "objectstore"],
        help="cases to run: ipc,direct,broadcast,naive,objectstore",
    )
    parser.add_argument(
        "--buffer-mib",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="buffer sizes in MiB; the first is the default for the main cases (default 256,64,1024,2048)",
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="workers (broadcast receivers); colocated cases use the first"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed syncs per case, after one warm-up")
    parser.add_argument("--quick", action="store_true", help="skip the buffer-size / buffer-count sweep")
    parser.add_argument(
        "--object-store-max-mb", type=float, default=2000, help="skip the object-store baseline above this size"
    )
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--address")
    parser.add_argument("--num-cpus", type=int, default=None)
    parser.add_argument("--json", help="write every case here")
    parser.add_argument("--plot", help="write a PNG of GB/s against buffer size here (needs matplotlib)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.sizes is None:
        args.sizes = ["100mb", "1gb", "16gb"] if args.device == "cuda" else ["1mb", "100mb", "1gb"]
    if args.buffer_mib is None:
        args.buffer_mib = [256, 64, 1024, 2048]
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return Bench(args).run()
