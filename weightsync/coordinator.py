"""The coordinator: handshake, transport setup, timed sync sequencing, teardown.

Call order::

    with WeightSync(trainer, [w0, w1], transport="auto") as ws:   # setup() on enter
        for step in range(n):
            ray.get(trainer.call.remote(train_step))
            report = ws.sync(version=step)                          # SyncReport
    # close() on exit: tears down groups and exports, never the actors

Per sync, each side gets one Ray call, all started together and awaited with one timed
wait: the trainer's ``ws_send`` (direct writes, then the IPC chunks, then the broadcast)
and each worker's receive. IPC slot hand-offs run inside those calls through a shared
control block, so no Ray round trip happens per chunk. Direct workers are bracketed: told
first (they enter RECEIVING and re-export if their storage moved), then written. Every
worker commits its new version in a last, parallel call made only after the trainer's side
(and, with ``verify``, the worker's checksums) came back good.

Any failure aborts the groups, leaves the failing workers DIRTY at their last good version,
drops workers whose actor died, and raises :class:`SyncError` naming each; the next
``sync`` sets the transports up again for the remaining workers.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from weightsync.actors import EndpointInfo, GroupSpec, ReceiveResult
from weightsync.metrics import SyncMetrics
from weightsync.spec import DEFAULT_ALIGNMENT, DEFAULT_BUFFER_BYTES, DEFAULT_NUM_BUFFERS, Manifest, WeightSyncError

log = logging.getLogger("weightsync")

TRANSPORTS = ("broadcast", "ipc", "direct")


class SetupError(WeightSyncError):
    """Setup refused: a handshake mismatch or an unusable transport, named per worker."""


class SyncError(WeightSyncError):
    """A sync failed; ``failures`` maps each failing party to its error."""

    def __init__(self, message: str, failures: Mapping[str, str], dead: Sequence[str]) -> None:
        super().__init__(message)
        self.failures = dict(failures)
        self.dead = list(dead)


class VerificationError(WeightSyncError):
    """A worker's weights differ from the trainer's."""


@dataclass
class WorkerReport:
    name: str
    transport: str
    version: int | None
    state: str
    seconds: float


@dataclass
class SyncReport:
    """What one sync did: bytes, chunks, wall time, and each worker's resulting version."""

    version: int
    bytes: int
    chunks: int
    seconds: float
    gbps: float
    transports: dict[str, int]
    workers: list[WorkerReport] = field(default_factory=list)
    verified: bool = False
    #: Seconds the trainer spent inside its send call: the transfer itself. The rest of
    #: ``seconds`` is Ray hand-offs and bookkeeping.
    send_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def summary(self) -> str:
        kinds = ", ".join(f"{k}={v}" for k, v in sorted(self.transports.items()))
        return (
            f"weightsync: version {self.version} -> {len(self.workers)} worker(s) [{kinds}]: "
            f"{self.bytes / 1e6:.1f} MB in {self.seconds * 1e3:.1f} ms ({self.gbps:.2f} GB/s), "
            f"{self.chunks} chunk(s){', verified' if self.verified else ''}"
        )


@dataclass
class _Worker:
    name: str
    handle: Any
    requested: str
    transport: str = ""
    info: EndpointInfo | None = None
    ipc_index: int = -1
    rank: int = -1


def _error_text(exc: BaseException) -> str:
    if isinstance(exc, RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        return f"{type(cause).__name__}: {cause}".replace("\n", "\n    ") if str(cause) else type(cause).__name__
    return f"{type(exc).__name__}: {exc}"


class WeightSync:
    """Moves a trainer actor's weights to worker actors.

    ``transport``: "auto" (per worker: same device -> "direct" when its sink allows it,
    else "ipc"; otherwise "broadcast"), one of "broadcast", "ipc", "direct", or a mapping of
    worker name to transport. ``buffer_bytes``/``num_buffers``/``alignment`` are fixed here,
    on the trainer's side, and sent to workers in the handshake. ``timeout_s`` bounds every
    wait. ``verify`` adds per-chunk checksums to every sync.
    """

    def __init__(
        self,
        trainer: Any,
        workers: Sequence[Any] | Mapping[str, Any],
        transport: str | Mapping[str, str] = "auto",
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        alignment: int = DEFAULT_ALIGNMENT,
        timeout_s: float = 120.0,
        verify: bool = False,
        backend: str | None = None,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.trainer = trainer
        named = dict(workers) if isinstance(workers, Mapping) else {f"worker-{i}": w for i, w in enumerate(workers)}
        if not named:
            raise ValueError("WeightSync needs at least one worker")
        self._workers: dict[str, _Worker] = {}
        self._transport = transport
        for name, handle in named.items():
            self._add(name, handle)
        self.buffer_bytes = buffer_bytes
        self.num_buffers = num_buffers
        self.alignment = alignment
        self.timeout_s = timeout_s
        self.verify_each_sync = verify
        self.backend = backend
        self.manifest: Manifest | None = None
        self.version: int | None = None
        self._ready = False
        self._sync_seq = 0
        self._lock = threading.Lock()
        self._metrics = SyncMetrics()

    # membership ---------------------------------------------------------------------
    def _add(self, name: str, handle: Any) -> None:
        if name in self._workers:
            raise ValueError(f"a worker named {name!r} is already registered")
        t = self._transport
        requested = t.get(name, "auto") if isinstance(t, Mapping) else t
        if requested not in ("auto", *TRANSPORTS):
            raise ValueError(f"transport for {name} must be auto, {', '.join(TRANSPORTS)}; got {requested!r}")
        self._workers[name] = _Worker(name, handle, requested)

    def add_worker(self, handle: Any, name: str | None = None) -> str:
        """Add a worker; the next sync re-forms the groups to include it."""
        with self._lock:
            name = name or f"worker-{uuid.uuid4().hex[:6]}"
            self._add(name, handle)
            self._invalidate()
            return name

    def remove_worker(self, name: str) -> None:
        """Drop a worker; the next sync re-forms the groups without it."""
        with self._lock:
            if name not in self._workers:
                raise KeyError(f"no worker named {name!r}; known: {sorted(self._workers)}")
            del self._workers[name]
            self._invalidate()

    @property
    def workers(self) -> dict[str, Any]:
        return {n: w.handle for n, w in self._workers.items()}

    def transports(self) -> dict[str, str]:
        return {n: w.transport for n, w in self._workers.items()}

    # timed waits --------------------------------------------------------------------------
    def _get(self, refs: Any, what: str, error: type[WeightSyncError] = WeightSyncError) -> Any:
        """``ray.get`` with the timeout, re-raising a remote failure as ``error`` naming ``what``."""
        try:
            return ray.get(refs, timeout=self._ray_timeout())
        except GetTimeoutError as exc:
            raise error(f"{what} did not answer within {self._ray_timeout():.0f}s (raise timeout_s)") from exc
        except (RayTaskError, RayActorError) as exc:
            raise error(f"{what} failed: {_error_text(exc)}") from exc

    def _ray_timeout(self) -> float:
        # Actor-side waits end at timeout_s; this margin lets their own error come back.
        return self.timeout_s * 1.5 + 10.0

    def _handle_of(self, party: str) -> Any:
        if party == "trainer":
            return self.trainer
        w = self._workers.get(party)
        return w.handle if w is not None else None

    def _died_itself(self, party: str, exc: RayActorError) -> bool:
        """True when ``exc`` is ``party``'s own death, not that of an actor it depended on."""
        handle = self._handle_of(party.split("/")[0])
        died = getattr(exc, "actor_id", None)
        mine = getattr(handle, "_actor_id", None)
        if died is None or mine is None:
            return True
        return str(died) == mine.hex()

    def _gather(self, calls: Mapping[str, Any], timeout: float) -> tuple[dict[str, Any], dict[str, str], list[str]]:
        """Wait for every named call together; returns results, errors and dead parties.

        Names are ``party`` or ``party/phase``; a call that failed because another actor it
        depended on died is an error, not a death of its own party.
        """
        by_ref = {ref: name for name, ref in calls.items()}
        refs = list(by_ref)
        deadline = time.monotonic() + timeout
        results: dict[str, Any] = {}
        errors: dict[str, str] = {}
        dead: list[str] = []
        try:  # the common case, in one call
            values = ray.get(refs, timeout=timeout)
            return {by_ref[ref]: value for ref, value in zip(refs, values)}, errors, dead
        except Exception:  # noqa: BLE001 - a failure or a timeout; told apart per call below
            pass
        # Something failed: let the other calls finish (each has its own deadline) so
        # every party's outcome is known, then sort them.
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
        for ref in ready:
            name = by_ref[ref]
            try:
                results[name] = ray.get(ref, timeout=1.0)
            except RayActorError as exc:
                if self._died_itself(name, exc):
                    errors[name] = f"actor died ({_error_text(exc)})"
                    dead.append(name)
                else:
                    errors[name] = f"stopped: an actor it depended on died ({_error_text(exc)})"
            except Exception as exc:  # noqa: BLE001 - collected per party, re-raised as SyncError
                errors[name] = _error_text(exc)
        for ref in pending:
            errors[by_ref[ref]] = f"no answer within {timeout:.0f}s"
        return results, errors, dead

    # setup --------------------------------------------------------------------------------
    def setup(self) -> Manifest:
        """Handshake with every worker and open the transports; refuses any mismatch first."""
        with self._lock:
            return self._setup()

    def _setup(self) -> Manifest:
        self._teardown(abort=True)
        names = list(self._workers)
        infos = self._get(
            [self.trainer.ws_describe.remote()] + [self._workers[n].handle.ws_describe.remote() for n in names],
            "describing the trainer and workers",
            SetupError,
        )
        trainer_info: EndpointInfo = infos[0]
        for name, info in zip(names, infos[1:]):
            w = self._workers[name]
            w.info = info
            w.transport = self._choose(trainer_info, w)
        manifest = self._get(
            self.trainer.ws_manifest.remote(self.buffer_bytes, self.num_buffers, self.alignment),
            "the trainer's manifest",
            SetupError,
        )
        _, errors, _ = self._gather(
            {n: self._workers[n].handle.ws_accept.remote(manifest, n) for n in names}, self._ray_timeout()
        )
        if errors:
            raise SetupError(
                "setup refused before any byte moved:\n  " + "\n  ".join(f"{n}: {e}" for n, e in sorted(errors.items()))
            )
        self._open_broadcast(trainer_info)
        self._open_ipc()
        self._open_direct()
        self.manifest = manifest
        self._ready = True
        self._sync_seq = 0
        log.info(
            "weightsync: set up %d worker(s) %s, %d tensors, %.1f MB, %d chunk(s) of %d bytes",
            len(names),
            self.transports(),
            len(manifest.specs),
            manifest.total_bytes / 1e6,
            len(manifest.chunks),
            manifest.buffer_bytes,
        )
        return manifest

    def _choose(self, trainer: EndpointInfo, w: _Worker) -> str:
        assert w.info is not None
        same_node = (
            trainer.node_id == w.info.node_id
            if trainer.node_id and w.info.node_id
            else trainer.hostname == w.info.hostname
        )
        same_device = (
            same_node
            and trainer.device == w.info.device
            and (trainer.device == "cpu" or trainer.gpu_uuid == w.info.gpu_uuid)
        )
        if w.requested == "auto":
            if same_device:
                return "direct" if w.info.sink_allows_direct else "ipc"
            return "broadcast"
        if w.requested in ("ipc", "direct") and not same_device:
            raise SetupError(
                f"{w.name}: transport {w.requested!r} needs the worker on the trainer's device "
                f"(trainer: node {trainer.node_id[:8]} {trainer.device} {trainer.gpu_uuid or ''}; "
                f"{w.name}: node {w.info.node_id[:8]} {w.info.device} {w.info.gpu_uuid or ''}); "
                "use transport='broadcast' for it"
            )
        if w.requested == "direct" and not w.info.sink_allows_direct:
            raise SetupError(f"{w.name}: its sink transforms tensors on load; use transport='ipc' for it")
        if w.requested == "broadcast" and same_device and trainer.device == "cuda":
            raise SetupError(
                f"{w.name}: shares GPU {trainer.gpu_uuid} with the trainer, and NCCL refuses two "
                "ranks on one GPU; use transport='ipc' or 'direct' (or 'auto')"
            )
        return w.requested

    def _members(self, transport: str) -> list[_Worker]:
        return [w for w in self._workers.values() if w.transport == transport]

    def _open_broadcast(self, trainer: EndpointInfo) -> None:
        members = self._members("broadcast")
        if not members:
            return
        world = len(members) + 1
        backend = self.backend or ("nccl" if trainer.device == "cuda" else "gloo")
        group = f"weightsync-{uuid.uuid4().hex[:8]}"
        host, port = self._get(
            self.trainer.ws_open_store.remote(world, self.timeout_s, trainer.node_ip),
            "opening the rendezvous store",
            SetupError,
        )
        nccl_id = (
            self._get(self.trainer.ws_nccl_id.remote(), "making the NCCL id", SetupError) if backend == "nccl" else None
        )
        calls = {
            "trainer": self.trainer.ws_join_broadcast.remote(
                GroupSpec(group, host, port, 0, world, self.timeout_s, backend, nccl_id)
            )
        }
        for rank, w in enumerate(members, start=1):
            w.rank = rank
            calls[w.name] = w.handle.ws_join_broadcast.remote(
                GroupSpec(group, host, port, rank, world, self.timeout_s, backend, nccl_id)
            )
        _, errors, _ = self._gather(calls, self._ray_timeout())
        if errors:
            self._teardown(abort=True)
            raise SetupError(
                "forming the broadcast group failed:\n  " + "\n  ".join(f"{n}: {e}" for n, e in sorted(errors.items()))
            )

    def _open_ipc(self) -> None:
        members = self._members("ipc")
        if not members:
            return
        export = self._get(
            self.trainer.ws_export_ipc.remote([w.name for w in members], self.timeout_s),
            "exporting IPC slots",
            SetupError,
        )
        for index, w in enumerate(members):
            w.ipc_index = index
        _, errors, _ = self._gather(
            {w.name: w.handle.ws_attach_ipc.remote(export, w.ipc_index, self.timeout_s) for w in members},
            self._ray_timeout(),
        )
        if errors:
            self._teardown(abort=True)
            raise SetupError(
                "attaching IPC slots failed:\n  " + "\n  ".join(f"{n}: {e}" for n, e in sorted(errors.items()))
            )
        self._get(self.trainer.ws_seal_ipc.remote(), "sealing IPC exports", SetupError)

    def _open_direct(self) -> None:
        members = self._members("direct")
        if members:
            self._export_direct(members, SetupError)

    def _export_direct(self, members: Sequence[_Worker], error: type[WeightSyncError]) -> None:
        """Each worker exports its tensors, the trainer maps the exports, the workers seal."""
        exports, errors, _ = self._gather(
            {w.name: w.handle.ws_export_direct.remote(self.timeout_s) for w in members}, self._ray_timeout()
        )
        if errors:
            self._teardown(abort=True)
            raise error(
                "exporting direct targets failed:\n  " + "\n  ".join(f"{n}: {e}" for n, e in sorted(errors.items()))
            )
        self._get(
            [self.trainer.ws_map_direct.remote(exports[w.name], self.timeout_s) for w in members],
            "mapping direct targets",
            error,
        )
        self._get([w.handle.ws_seal_direct.remote() for w in members], "sealing direct exports", error)

    # sync ---------------------------------------------------------------------------------
    def sync(self, version: int, verify: bool | None = None, force: bool = False) -> SyncReport:
        """Move the trainer's current weights to every worker as ``version``.

        Concurrent calls on one WeightSync are serialized. ``version`` must be newer than
        the last synced one unless ``force``.
        """
        with self._lock:
            if self.version is not None and version <= self.version and not force:
                raise WeightSyncError(
                    f"version {version} is not newer than the last synced version {self.version}; "
                    "pass force=True to sync it anyway"
                )
            if not self._ready:
                self._setup()
            try:
                report = self._sync(version, self.verify_each_sync if verify is None else verify, force)
            except Exception:
                self._metrics.failed()
                raise
            self._metrics.record(report)
            if log.isEnabledFor(logging.INFO):
                log.info(report.summary())
            return report

    def _sync(self, version: int, verify: bool, force: bool) -> SyncReport:
        """Submit the whole sync at once and wait for it once.

        The trainer's ``ws_send`` and every worker's receive start together: colocated
        workers (direct, ipc) meet the trainer through shared control blocks, broadcast
        receivers through the collective. A colocated worker commits inside its receive,
        once it saw the trainer finish its part (every chunk published, or the write
        done). A broadcast receiver commits in ``ws_commit``, which takes the trainer's and
        the worker's results as Ray object refs, so Ray starts it once both succeeded and
        the coordinator makes no round trip in between.
        """
        assert self.manifest is not None
        start = time.perf_counter()
        results, send = self._transfer(version, verify, force, self._members("direct"))
        moved = {n: r.moved for n, r in results.items() if isinstance(r, ReceiveResult) and r.moved}
        if moved:
            # Their tensors moved since their export: nothing was written. Export again
            # and write those workers now; ``ws_send`` skips the rest this time.
            log.info("weightsync: re-exporting direct targets whose tensors moved: %s", moved)
            stale = [self._workers[n] for n in moved]
            try:
                self._export_direct(stale, SyncError)
            except WeightSyncError as exc:
                self._fail({n: str(exc) for n in moved}, [], "re-exporting moved direct targets")
            again, _ = self._transfer(version, verify, force, stale, only_direct=True)
            results.update(again)
        self._sync_seq += 1
        self.version = version
        seconds = time.perf_counter() - start
        total = self.manifest.total_bytes
        counts: dict[str, int] = {}
        reports = []
        for w in self._workers.values():
            counts[w.transport] = counts.get(w.transport, 0) + 1
            r: ReceiveResult = results[w.name]
            reports.append(WorkerReport(w.name, w.transport, r.version, r.state, r.seconds))
        chunked = any(w.transport != "direct" for w in self._workers.values())
        return SyncReport(
            version=version,
            bytes=total,
            chunks=len(self.manifest.chunks) if chunked else 0,
            seconds=seconds,
            gbps=total / seconds / 1e9 if seconds > 0 else 0.0,
            transports=counts,
            workers=reports,
            verified=verify,
            send_seconds=float(send["seconds"]),
        )

    def _transfer(
        self, version: int, verify: bool, force: bool, direct: Sequence[_Worker], only_direct: bool = False
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """One round of calls; returns each worker's final result and the trainer's."""
        ipc = [] if only_direct else self._members("ipc")
        bcast = [] if only_direct else self._members("broadcast")
        seq = self._sync_seq
        # The trainer first: its own checks and setup (source checks, the copy plan, the
        # first IPC chunk's packing) then overlap the workers' calls being started.
        trainer_ref = self.trainer.ws_send.remote(
            bool(bcast), [w.ipc_index for w in ipc], seq, [w.name for w in direct], verify
        )
        calls: dict[tuple[str, str], Any] = {}
        for w in direct:
            calls[(w.name, "receive")] = w.handle.ws_receive_direct.remote(version, seq, force)
        for w in ipc:
            calls[(w.name, "receive")] = w.handle.ws_receive_ipc.remote(version, seq, verify, force)
        for w in bcast:
            calls[(w.name, "receive")] = w.handle.ws_receive_broadcast.remote(version, verify, force)
        calls[("trainer", "send")] = trainer_ref
        for w in bcast:
            args = (version, w.transport, verify, trainer_ref, calls[(w.name, "receive")])
            calls[(w.name, "commit")] = w.handle.ws_commit.remote(*args)
        results, errors, dead = self._gather(
            {f"{n}/{phase}": ref for (n, phase), ref in calls.items()}, self._ray_timeout()
        )
        if errors:
            self._fail(*self._attribute(errors, dead), "during the transfer")
        final = {w.name: results[f"{w.name}/receive"] for w in [*direct, *ipc]}
        final.update({w.name: results[f"{w.name}/commit"] for w in bcast})
        return final, results["trainer/send"]

    def _attribute(self, errors: Mapping[str, str], dead: Sequence[str]) -> tuple[dict[str, str], list[str]]:
        """Per party, the failure it caused. A commit that failed only because the trainer's
        send or the party's own receive failed is a consequence, and is left out."""
        causes: dict[str, str] = {}
        for key, msg in errors.items():
            party, phase = key.split("/")
            if phase != "commit":
                causes.setdefault(party, msg)
        for key, msg in errors.items():
            party, phase = key.split("/")
            if phase == "commit" and "trainer" not in causes and party not in causes:
                causes[party] = msg
        if not causes:
            causes = {key.split("/")[0]: msg for key, msg in errors.items()}
        workers_dead = sorted({key.split("/")[0] for key in dead} & set(self._workers))
        return causes, workers_dead

    def _fail(self, errors: Mapping[str, str], dead: Sequence[str], when: str) -> None:
        """Abort the groups, mark survivors dirty, drop the dead, and raise SyncError."""
        for name in dead:
            self._workers.pop(name, None)
        # Every live worker still RECEIVING becomes DIRTY (also those whose own call
        # returned: their data may be incomplete when the trainer failed). A party that
        # gave no answer is still busy; asking it anything would only wait.
        busy = {n for n, m in errors.items() if m.startswith("no answer")}
        marks = {n: w.handle.ws_mark_dirty.remote() for n, w in self._workers.items() if n not in busy}
        _, mark_errors, _ = self._gather(marks, self._ray_timeout())
        for name, msg in mark_errors.items():
            log.warning("weightsync: could not mark %s dirty: %s", name, msg)
        self._teardown(abort=True, skip=busy)
        lines = [f"{name}: {msg}" for name, msg in sorted(errors.items())]
        if dead:
            lines.append(f"dropped dead worker(s) {', '.join(dead)}; the next sync re-forms the groups without them")
        raise SyncError(f"sync failed {when}:\n  " + "\n  ".join(lines), errors, dead)

    # checks -------------------------------------------------------------------------------
    def verify(self) -> str:
        """Compare a full digest of every worker with the trainer's; returns the digest."""
        with self._lock:
            names = list(self._workers)
            digests = self._get(
                [self.trainer.ws_digest.remote()] + [self._workers[n].handle.ws_digest.remote() for n in names],
                "computing digests",
            )
            bad = [n for n, d in zip(names, digests[1:]) if d != digests[0]]
            if bad:
                raise VerificationError(f"weights differ from the trainer's on: {', '.join(bad)}")
            return str(digests[0])

    def status(self) -> dict[str, tuple[int | None, str]]:
        """Each worker's (version, state)."""
        names = list(self._workers)
        return dict(zip(names, self._get([self._workers[n].handle.ws_status.remote() for n in names], "worker status")))

    # teardown ------------------------------------------------------------------------------
    def _invalidate(self) -> None:
        self._ready = False

    def _teardown(self, abort: bool = False, skip: frozenset[str] | set[str] = frozenset()) -> None:
        self._ready = False
        parties = {"trainer": self.trainer, **{n: w.handle for n, w in self._workers.items()}}
        parties = {n: h for n, h in parties.items() if n not in skip}
        refs = {n: h.ws_teardown.remote(abort) for n, h in parties.items()}
        _, errors, dead = self._gather(refs, self._ray_timeout())
        for name in dead:
            self._workers.pop(name, None)
        for name, msg in errors.items():
            log.warning("weightsync: teardown on %s failed: %s", name, msg)

    def close(self) -> None:
        """Tear down groups and exports on every live party; the actors stay up."""
        with self._lock:
            self._teardown()

    def __enter__(self) -> WeightSync:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
