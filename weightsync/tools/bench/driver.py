"""The bench's driver: one trainer and its workers per model size, every case in turn.

:meth:`Bench.run` -> per size :meth:`Bench.size_cases` (the raw limit, the Ray floor, the
weightsync transports and their knob sweeps, the reference design, the baselines: the
cases outside weightsync live in :mod:`~weightsync.tools.bench.baselines`) -> each case
through :meth:`Bench.timed` (one warm-up, ``--repeats`` timed runs, peak memory).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import weightsync.tools.bench.probes as probes
from weightsync.core.wire.errors import SettingsError, SetupError, WeightSyncError
from weightsync.core.wire.outcome import Status
from weightsync.core.wire.settings import DEFAULT_NUM_BUFFERS, MIB, SyncSettings
from weightsync.tools.bench.baselines import gloo_case, outside_cases, ray_floor_case, reference_case
from weightsync.tools.bench.chart import check_plot_path, plot
from weightsync.tools.bench.deltas import delta_cases
from weightsync.tools.bench.engine_staged import engine_staged_cases
from weightsync.tools.bench.engine_tp import engine_tp_cases
from weightsync.tools.bench.lora import lora_cases
from weightsync.tools.bench.report import Case, check_json_path, header, ratios, show, write_json
from weightsync.tools.bench.sharded import sharded_cases
from weightsync.tools.models import PolicyFactory


@dataclass(frozen=True)
class SizeRun:
    """One model size's actors and the raw one-copy limit: what every case of the size reads."""

    size: str
    trainer: Any
    workers: list[Any]
    nbytes: int
    copy_s: float

    @property
    def parties(self) -> list[Any]:
        """The two sides whose memory a case reports: the trainer and the first worker."""
        return [self.trainer, self.workers[0]]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import ray

        self.ray = ray
        self.args = args
        self.cases: list[Case] = []
        self.summary: list[str] = []
        #: Cases whose setup failed for another reason than a refusal: the run's exit code says so.
        self.failed: list[str] = []
        self.timeout_s = args.timeout_s
        self._version = 0

    def not_run(self, size: str, name: str, exc: Exception) -> None:
        """A case whose setup raised: skipped when weightsync refused the case (a setting or
        a handshake it cannot run here), failed otherwise (a party died or did not answer,
        or anything else raised); either way the other cases go on."""
        refused = isinstance(exc, SettingsError) or (
            isinstance(exc, SetupError)
            and not exc.dead
            and all(o.status is not Status.TIMED_OUT for o in exc.outcomes.values())
        )
        line = f"{size:>6} {name:<34} {'skipped' if refused else 'FAILED'}: {type(exc).__name__}: {exc}"
        print(line.splitlines()[0], flush=True)
        if not refused:
            self.failed.append(f"{size} {name}")

    def next_version(self) -> int:
        """One counter for every case: the workers are shared and refuse an older version."""
        self._version += 1
        return self._version

    def get(self, ref: Any) -> Any:
        return self.ray.get(ref, timeout=self.timeout_s)

    def memory_base(self, parties: list[Any]) -> list[int]:
        """Reset each side's peak counter; returns what each holds now."""
        return list(self.get([p.call.remote(probes.memory_reset) for p in parties]))

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
        peaks = self.get([p.call.remote(probes.memory_peak) for p in parties])
        case.trainer_extra_mb = (peaks[0] - base[0]) / 1e6
        case.worker_extra_mb = (peaks[1] - base[1]) / 1e6 if len(parties) > 1 else None
        self.cases.append(case)
        show(case)
        return case

    def run(self) -> int:
        from weightsync.tools.bench.reference import ChunkTrainerActor, ChunkWorkerActor
        from weightsync.tools.cluster import connect_with_gpus

        args = self.args
        cuda = args.device == "cuda"
        if args.plot:
            check_plot_path(args.plot)
        if args.json:
            check_json_path(args.json)
        problem = connect_with_gpus(1 if cuda else 0, "bench --device cuda", args.address, args.num_cpus)
        if problem is not None:  # else every case's actors would wait for a GPU for ever
            print(problem, flush=True)
            return 2
        opts: dict[str, Any] = {"num_cpus": 0}
        if cuda:
            # Colocated cases need one GPU shared by the trainer and one worker; NCCL cases
            # would need more GPUs, which this bench does not place yet.
            args.workers = 1
            opts["num_gpus"] = 0.5
        header()
        started = time.perf_counter()
        for index, size in enumerate(args.sizes, 1):
            # Progress: which size of how many, and the time so far (sizes grow, so the last
            # ones take longest).
            print(f"-- size {index}/{len(args.sizes)}: {size}, {time.perf_counter() - started:.0f}s so far", flush=True)
            if not args.changed_only:
                self.main_cases(size, ChunkTrainerActor, ChunkWorkerActor, opts)
            if args.changed:
                delta_cases(self, size, args.changed)
            for line in ratios(self.cases, size, args.workers):
                self.summary.append(line)
                print(line, flush=True)
        if args.json:
            write_json(args.json, args, self.cases, self.summary)
        if args.plot:
            plot(self.cases, args.plot)
        if self.failed:
            print(f"failed cases (their setup raised): {', '.join(self.failed)}", flush=True)
            return 1
        return 0

    def main_cases(self, size: str, trainer_cls: Any, worker_cls: Any, opts: dict[str, Any]) -> None:
        """Every case but the delta rows, on one trainer and its workers made for them."""
        args = self.args
        factory_device = "cuda" if args.device == "cuda" else "cpu"
        trainer = trainer_cls.options(**opts).remote(PolicyFactory(size, 0, factory_device), device=args.device)
        workers = [
            worker_cls.options(**opts).remote(PolicyFactory(size, i + 1, factory_device), device=args.device)
            for i in range(args.workers)
        ]
        try:
            self.size_cases(size, trainer, workers)
        finally:
            for handle in [trainer, *workers]:
                self.ray.kill(handle)

    def size_cases(self, size: str, trainer: Any, workers: list[Any]) -> None:
        """Every case of one model size, in the order the report prints them."""
        run = self.limit_case(size, trainer, workers)
        ray_floor_case(self, size, trainer, workers[0], run.nbytes, run.copy_s)
        self.colocated_cases(run)
        raw = self.broadcast_cases(run)
        self.other_cases(run, raw)

    def limit_case(self, size: str, trainer: Any, workers: list[Any]) -> SizeRun:
        """The raw limit, one copy of one buffer of the model's bytes: what the colocated
        cases are measured against."""
        built = self.get(trainer.ws_manifest.remote(SyncSettings(buffer_bytes=self.args.buffer_mib[0] * MIB)))
        self.get(trainer.ws_teardown.remote(forget=True))  # that session was only for the manifest
        if not built.ok:
            raise WeightSyncError(f"the bench's trainer could not build its manifest: {built.line()}")
        manifest = built.value
        nbytes = manifest.total_bytes
        copy_s = self.get(trainer.call.remote(probes.raw_copy_seconds, nbytes, self.args.repeats))
        note = f"{len(manifest.specs)} tensors"
        self.cases.append(
            Case(size, "raw limit: one copy of one buffer", nbytes, times=[copy_s] * 2, limit_s=copy_s, note=note)
        )
        show(self.cases[-1])
        return SizeRun(size, trainer, workers, nbytes, copy_s)

    def sync_case(
        self,
        run: SizeRun,
        name: str,
        transport: str,
        buffer_mib: int | None,
        nbuf: int,
        limit: float | None,
        members: list[Any],
        inplace_bytes: int | None = None,
        reply_board: bool = True,
    ) -> None:
        """One weightsync case; ``buffer_mib=None``: the library's default ("auto");
        ``inplace_bytes=None``: the library's default threshold; ``reply_board=False``: every
        answer through Ray."""
        from weightsync.glue.coordinator import WeightSync

        base = self.memory_base(run.parties)
        ws = WeightSync(
            run.trainer,
            members,
            transport=transport,
            buffer_bytes=buffer_mib * MIB if buffer_mib is not None else "auto",
            num_buffers=nbuf,
            inplace_bytes=inplace_bytes,
            timeout_s=self.timeout_s,
            reply_board=reply_board,
        )
        try:
            built = ws.setup()
        except Exception as exc:  # noqa: BLE001 - reported, counted in the exit code; the rest go on
            self.not_run(run.size, name, exc)
            return

        note = f"{built.inplace_count} in place" if transport == "broadcast" and built.inplace_count else ""
        case = Case(
            run.size,
            name,
            run.nbytes,
            built.agreed.buffer_bytes / MIB,
            built.agreed.num_buffers,
            limit_s=limit,
            note=note,
        )

        def one() -> float:
            report = ws.sync(self.next_version())
            case.send_times.append(report.send_seconds)
            return report.seconds

        self.timed(case, one, run.parties, base)
        ws.close()

    def colocated_cases(self, run: SizeRun) -> None:
        """ipc and direct at the library's defaults (and with every answer through Ray, as
        before the reply board), push mode, a staged worker's swap, and (without ``--quick``)
        the ipc knob sweep and the reference design."""
        args, worker = self.args, run.workers[0]
        for transport in ("ipc", "direct"):
            if transport in args.transports:
                name = f"weightsync {transport}"
                self.sync_case(run, name, transport, None, DEFAULT_NUM_BUFFERS, run.copy_s, [worker])
                self.sync_case(
                    run, f"{name}, Ray answers", transport, None, DEFAULT_NUM_BUFFERS, run.copy_s, [worker], None, False
                )
        if "direct" in args.transports:
            self.push_cases(run.size, run.trainer, worker, run.nbytes, run.copy_s)
        if "staged" in args.transports:
            self.swap_cases(run)
        if "ipc" not in args.transports or args.quick:
            return
        first = args.buffer_mib[0]
        for buffer_mib in args.buffer_mib:
            for nbuf in (1, 2, 3):
                if buffer_mib * MIB <= max(2 * run.nbytes, first * MIB):
                    self.sync_case(run, "weightsync ipc (knobs)", "ipc", buffer_mib, nbuf, run.copy_s, [worker])
        reference_case(self, run.size, run.trainer, worker, run.nbytes, run.copy_s, first)

    def broadcast_cases(self, run: SizeRun) -> float | None:
        """Broadcast (CPU, gloo) against one raw gloo broadcast of the model's bytes, and the
        per-tensor baseline; returns that raw limit (None when not measured)."""
        args, workers = self.args, run.workers
        if "broadcast" not in args.transports or args.device == "cuda":
            return None
        raw = gloo_case(self, run.size, run.trainer, workers, run.nbytes, per_tensor=False)
        for n in sorted({1, len(workers)}):
            limit = raw if n == len(workers) else None
            name = f"weightsync broadcast, {n} receiver(s)"
            self.sync_case(run, name, "broadcast", None, DEFAULT_NUM_BUFFERS, limit, workers[:n])
        name = "weightsync broadcast (all packed)"
        self.sync_case(run, name, "broadcast", None, DEFAULT_NUM_BUFFERS, raw, workers, inplace_bytes=0)
        if not args.quick:
            for buffer_mib in args.buffer_mib:
                self.sync_case(
                    run, "weightsync broadcast (knobs)", "broadcast", buffer_mib, DEFAULT_NUM_BUFFERS, raw, workers
                )
            for nbuf in (1, 3):
                self.sync_case(run, "weightsync broadcast (knobs)", "broadcast", args.buffer_mib[0], nbuf, raw, workers)
        gloo_case(self, run.size, run.trainer, workers, run.nbytes, per_tensor=True, limit=raw)
        return raw

    def other_cases(self, run: SizeRun, raw: float | None) -> None:
        """The sharded trainer, the vLLM engines, LoRA, and the baselines outside weightsync."""
        args, size, cuda = self.args, run.size, self.args.device == "cuda"
        if args.sharded_ranks and cuda:
            print(f"{size:>6} {'sharded trainer cases':<34} skipped: CPU only (gloo ranks)", flush=True)
        elif args.sharded_ranks:
            sharded_cases(
                self, size, run.workers, run.nbytes, {"broadcast": raw, "direct": run.copy_s, "ipc": run.copy_s}
            )
        self.engine_cases(size, run.copy_s)
        if args.lora_rank:
            lora_cases(self, size)
        outside_cases(self, size, run.trainer, run.workers[0], run.nbytes, run.copy_s)

    def engine_cases(self, size: str, copy_s: float) -> None:
        """The vLLM engine rows asked for (CPU only): tensor-parallel, staged."""
        cuda = self.args.device == "cuda"
        if self.args.vllm_tp and cuda:
            print(f"{size:>6} {'vllm TP cases':<34} skipped: CPU only (one GPU holds no TP pairs)", flush=True)
        elif self.args.vllm_tp:
            engine_tp_cases(self, size, copy_s)
        if self.args.vllm_staged and cuda:
            print(f"{size:>6} {'vllm staged cases':<34} skipped: CPU only (vLLM's CPU build)", flush=True)
        elif self.args.vllm_staged:
            engine_staged_cases(self, size)

    def swap_cases(self, run: SizeRun) -> None:
        """A staged worker's swap (``ModuleSink(stage=...)``): one copy of a sync's stage into
        the model, against one raw copy of its bytes; on a GPU from the device and from
        pinned host memory. Timed in the actor that holds the model (the trainer's copy)."""
        for place in ("device", "host") if self.args.device == "cuda" else ("device",):
            name = f"staged swap, stage on {place}"
            seconds, where = self.get(run.trainer.call.remote(probes.staged_swap_seconds, place, self.args.repeats))
            case = Case(run.size, name, run.nbytes, times=[seconds] * 2, limit_s=run.copy_s, note=f"stage on {where}")
            case.note += f", {seconds / run.copy_s:.2f}x one raw copy" if run.copy_s else ""
            self.cases.append(case)
            show(case)

    def push_cases(self, size: str, trainer: Any, worker: Any, nbytes: int, copy_s: float) -> None:
        """Direct in push mode: ``sync()`` as one Ray call (to the trainer), and a push from
        inside the trainer's own call (timed there: no Ray call for the sync at all)."""
        from weightsync.glue.coordinator import WeightSync

        base = self.memory_base([trainer, worker])
        ws = WeightSync(trainer, [worker], transport="direct", push=True, timeout_s=self.timeout_s)
        ws.setup()

        def by_sync() -> float:
            return ws.sync(self.next_version()).seconds

        def in_trainer() -> float:
            return float(self.get(trainer.push_seconds.remote(self.next_version())))

        self.timed(
            Case(size, "weightsync direct push, 1 Ray call", nbytes, limit_s=copy_s), by_sync, [trainer, worker], base
        )
        self.timed(
            Case(size, "weightsync direct push, in trainer", nbytes, limit_s=copy_s, note="timed in the trainer"),
            in_trainer,
            [trainer, worker],
        )
        ws.close()
