"""The coordinator: membership, setup, and the sequencing of every sync.

Call order::

    with WeightSync(trainer, [w0, w1], transport="auto") as ws:   # setup() on enter
        for step in range(n):
            ray.get(trainer.call.remote(train_step), timeout=...)
            report = ws.sync(version=step)                          # SyncReport
        ws.verify()                                                 # every worker against the trainer
    # close() on exit: tears down groups and exports, never the actors

Setup: every party describes itself, :func:`~weightsync.core.choice.choose_transport` picks each
worker's transport, the trainer's Manifest goes to every worker (a mismatch is refused by
name before any byte moves), then each transport is opened. Per sync: one Ray call per
party, submitted together and awaited once (:func:`~weightsync.glue.calls.gather`); a broadcast
worker's commit is chained on the trainer's and its own answers by object refs, so it costs
no round trip. Every answer is an Outcome; on a failure the coordinator blames from the
outcomes (:func:`~weightsync.core.wire.outcome.assign_blame`), settles every worker that
answered (a worker left mid-write is dirty), drops the workers whose actor died (reporting
them), tears the transports down, and raises :class:`SyncError`. The next sync sets up again.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray

from weightsync.core.checking import compare_checksums
from weightsync.core.choice import REQUESTS
from weightsync.core.transport.control import Deadlines
from weightsync.core.wire.errors import SettingsError, SetupError, SyncError, VersionError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import EndpointInfo, ReceiveResult, SendResult, SyncCall
from weightsync.core.wire.outcome import Outcome, Status, assign_blame, describe_failure, failed
from weightsync.core.wire.report import SyncReport, WorkerReport
from weightsync.core.wire.settings import BufferBytes, SyncSettings
from weightsync.core.wire.sizing import BufferHints
from weightsync.glue.calls import gather
from weightsync.glue.metrics import SyncMetrics
from weightsync.glue.opening import open_broadcast, open_direct, open_ipc, open_push
from weightsync.glue.ranks import TrainerRanks, identity, reserved

log = logging.getLogger("weightsync")
Calls = dict[tuple[str, str], Any]


@dataclass
class _Worker:
    name: str
    handle: Any
    requested: str
    transport: str = ""
    info: EndpointInfo | None = None
    rank: int = 0  # the trainer rank serving it


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name or reserved(name) or "/" in name:
        raise SettingsError(
            f"worker name {name!r} cannot be used: names are non-empty strings, not 'trainer' or "
            "'trainer-rank-<i>', without '/'"
        )
    if not name.isprintable() or any(c.isspace() for c in name):
        raise SettingsError(f"worker name {name!r} cannot be used: it holds whitespace or control characters")
    return name


class WeightSync:
    """Moves a trainer actor's weights to worker actors.

    ``transport``: "auto" (per worker: same device -> "direct" when its sink allows it,
    else "ipc"; otherwise "broadcast"), one of "broadcast", "ipc", "direct", or a mapping of
    worker name to transport. ``settings`` (or the same fields as keywords, which win) fix
    the buffers, the timeout and per-sync verification; the trainer's copy is sent to every
    worker in the handshake. ``backend`` forces "gloo" or "nccl" for broadcast. ``push``
    (one trainer, every worker direct): workers listen for syncs instead of taking a Ray
    call each, so a sync is one call to the trainer, and the trainer may also sync from
    inside its own methods (``TrainerMixin.weightsync_push``); see :mod:`weightsync.core.pusher`.

    ``trainer`` is one actor, or the ranks of one sharded trainer in rank order (parties
    ``trainer-rank-<i>``, see :mod:`weightsync.glue.ranks`): rank 0 serves the broadcast workers,
    each colocated worker is served by the rank on its device, or by ``worker_ranks[name]``.
    """

    def __init__(
        self,
        trainer: Any,
        workers: Sequence[Any] | Mapping[str, Any],
        transport: str | Mapping[str, str] = "auto",
        *,
        settings: SyncSettings | None = None,
        buffer_bytes: BufferBytes | None = None,
        num_buffers: int | None = None,
        inplace_bytes: int | None = None,
        alignment: int | None = None,
        timeout_s: float | None = None,
        verify: bool | None = None,
        backend: str | None = None,
        worker_ranks: Mapping[str, int] | None = None,
        push: bool = False,
    ) -> None:
        base = settings if settings is not None else SyncSettings()
        if not isinstance(base, SyncSettings):
            raise SettingsError(f"settings must be a SyncSettings, got {type(base).__name__}")
        self.settings = base.with_overrides(
            buffer_bytes=buffer_bytes,
            num_buffers=num_buffers,
            inplace_bytes=inplace_bytes,
            alignment=alignment,
            timeout_s=timeout_s,
            verify=verify,
        )
        if backend not in (None, "gloo", "nccl"):
            raise SettingsError(f"backend must be None, 'gloo' or 'nccl', got {backend!r}")
        self.backend = backend
        if not isinstance(push, bool):
            raise SettingsError(f"push must be True or False, got {push!r}")
        self.push = push
        self.ranks = TrainerRanks(trainer)
        if push and len(self.ranks.names) > 1:
            raise SettingsError("push=True takes one trainer, not the ranks of a sharded one (not supported yet)")
        self.trainer = self.ranks.handles[0]
        named = dict(workers) if isinstance(workers, Mapping) else {f"worker-{i}": w for i, w in enumerate(workers)}
        if not named:
            raise SettingsError("WeightSync needs at least one worker")
        if isinstance(transport, Mapping):
            unknown = sorted(set(transport) - set(named))
            if unknown:
                raise SettingsError(f"transport names unknown worker(s) {unknown}; workers: {sorted(named)}")
        self._transport = transport
        self._worker_ranks = self.ranks.check_map(worker_ranks, list(named))
        self._workers: dict[str, _Worker] = {}
        for name, handle in named.items():
            self._add(name, handle)
        self.manifest: Manifest | None = None
        self.version: int | None = None
        self._ready = False
        self._seq = 0
        self._lock = threading.Lock()
        self._metrics = SyncMetrics()

    @property
    def deadlines(self) -> Deadlines:
        return Deadlines(self.settings.timeout_s)

    # membership -------------------------------------------------------------------------
    def _add(self, name: str, handle: Any) -> None:
        _check_name(name)
        if name in self._workers:
            raise SettingsError(f"a worker named {name!r} is already registered")
        mine = identity(handle)
        for other in self._workers.values():
            if identity(other.handle) == mine:
                raise SettingsError(f"workers {other.name!r} and {name!r} are the same actor; pass each worker once")
        if mine in self.ranks.ids:
            raise SettingsError(f"worker {name!r} is the trainer's own actor")
        t = self._transport
        requested = t.get(name, "auto") if isinstance(t, Mapping) else t
        if requested not in REQUESTS:
            raise SettingsError(f"transport for {name} must be one of {', '.join(REQUESTS)}; got {requested!r}")
        self._workers[name] = _Worker(name, handle, requested)

    def add_worker(self, handle: Any, name: str | None = None) -> str:
        """Add a worker; the next sync sets up again to include it."""
        with self._lock:
            name = name or f"worker-{uuid.uuid4().hex[:6]}"
            self._add(name, handle)
            self._ready = False
            return name

    def remove_worker(self, name: str) -> None:
        """Drop a worker (its transports are torn down); the next sync sets up without it."""
        with self._lock:
            if name not in self._workers:
                raise KeyError(f"no worker named {name!r}; known: {sorted(self._workers)}")
            self._teardown(abort=False)
            del self._workers[name]

    @property
    def workers(self) -> dict[str, Any]:
        return {n: w.handle for n, w in self._workers.items()}

    def transports(self) -> dict[str, str]:
        return {n: w.transport for n, w in self._workers.items()}

    def _handles(self) -> dict[str, Any]:
        return {**self.ranks.parties(), **self.workers}

    def _gather(self, calls: Calls, timeout_s: float | None = None) -> dict[tuple[str, str], Outcome]:
        return gather(calls, timeout_s or self.deadlines.coordinator_s, self._handles())

    # setup ------------------------------------------------------------------------------
    def setup(self) -> Manifest:
        """Handshake with every worker and open the transports; refuses any mismatch first."""
        with self._lock:
            return self._setup()

    def _step(self, calls: Calls, when: str, timeout_s: float | None = None) -> dict[str, Outcome]:
        """One setup step: every call's outcome by party; SetupError naming each failure."""
        outs: dict[str, Outcome] = {}
        for (party, _), o in self._gather(calls, timeout_s).items():
            if party not in outs or not o.ok:
                outs[party] = o
        if not all(o.ok for o in outs.values()):
            # Parties that failed still answer and close what they opened; only those that
            # died or gave no answer are not asked again.
            self._teardown(abort=True, skip={p for p, o in outs.items() if o.status in (Status.DEAD, Status.TIMED_OUT)})
            culprits = assign_blame(outs)
            raise SetupError(describe_failure(f"setup failed {when}", outs, culprits), outs, culprits)
        return outs

    def _setup(self) -> Manifest:
        self._ready = False
        self._step(
            {(p, "teardown"): h.ws_teardown.remote(True) for p, h in self._handles().items()},
            "closing the last session",
            self.deadlines.startup_s,
        )
        outs = self._step(
            {(p, "describe"): h.ws_describe.remote() for p, h in self._handles().items()}, "describing the parties"
        )
        ranks = self.ranks
        infos: list[EndpointInfo] = [outs[r].value for r in ranks.names]
        choices: dict[str, Outcome] = {}
        for w in self._workers.values():
            w.info = outs[w.name].value
            try:
                w.rank, w.transport = ranks.choose(w.name, w.info, w.requested, infos, self._worker_ranks)
            except SettingsError as exc:
                choices[w.name] = failed(w.name, "choose", exc)
        if self.push:
            for w in self._workers.values():
                if w.transport != "direct" and w.name not in choices:
                    why = SettingsError(
                        f"push=True needs every worker on the direct transport; {w.name} would use "
                        f"{w.transport!r} (its sink or placement rules direct out): drop push or move the worker"
                    )
                    choices[w.name] = failed(w.name, "choose", why)
        if choices:
            culprits = sorted(choices)
            raise SetupError(describe_failure("setup refused a transport", choices, culprits), choices, culprits)
        made = self._step(
            {
                (r, "manifest"): h.ws_manifest.remote(self.settings, r, ranks.names, self._hints(infos))
                for r, h in ranks.parties().items()
            },
            "building the manifest",
        )
        manifest: Manifest = made[ranks.lead].value
        layouts = None
        if ranks.sharded:
            laid = self._step(
                {(r, "layout"): h.ws_layout.remote(r) for r, h in ranks.parties().items()},
                "describing the trainer's ranks",
            )
            layouts = {r: laid[r].value for r in ranks.names}
        refused = ranks.disagreeing({r: made[r].value for r in ranks.names}, layouts)
        if refused:
            self._teardown(abort=True)
            culprits = sorted(refused)
            raise SetupError(
                describe_failure("setup refused the trainer's ranks", refused, culprits), refused, culprits
            )
        self._step(
            {(w.name, "accept"): w.handle.ws_accept.remote(manifest, w.name) for w in self._workers.values()},
            "in the handshake, before any byte moved",
        )
        lead = (ranks.lead, self.trainer)
        open_broadcast(self._step, lead, infos[0], self._members("broadcast"), self.settings, self.backend)
        self._open_colocated(("ipc", "direct"), list(self._workers.values()))
        if self.push:
            open_push(self._step, (self.ranks.lead, self.trainer), self._members("direct"), self.settings)
        self.manifest = manifest
        self._ready = True
        self._seq = 0
        log.info(
            "weightsync: set up %d worker(s) %s, %d tensors, %.1f MB, %d chunk(s) of %d bytes",
            len(self._workers),
            self.transports(),
            len(manifest.specs),
            manifest.total_bytes / 1e6,
            len(manifest.chunks),
            manifest.buffer_bytes,
        )
        return manifest

    def _hints(self, ranks: Sequence[EndpointInfo]) -> BufferHints:
        """What ``buffer_bytes="auto"`` is sized from: the trainer's device, every party's free memory."""
        infos = [*ranks, *(w.info for w in self._workers.values() if w.info is not None)]
        return BufferHints(
            device=ranks[0].device, free_bytes=tuple(i.free_bytes for i in infos if i.free_bytes is not None)
        )

    def _members(self, transport: str) -> list[tuple[str, Any]]:
        return [(w.name, w.handle) for w in self._workers.values() if w.transport == transport]

    def _open_colocated(self, kinds: Sequence[str], workers: Sequence[_Worker]) -> None:
        """Each trainer rank opens ipc, then direct, for the colocated ``workers`` it serves."""
        for r, party in enumerate(self.ranks.parties().items()):
            for kind, opener in (("ipc", open_ipc), ("direct", open_direct)):
                if kind in kinds:
                    mine = [(w.name, w.handle) for w in workers if w.transport == kind and w.rank == r]
                    opener(self._step, party, mine, self.settings)

    # sync -------------------------------------------------------------------------------
    def sync(self, version: int, verify: bool | None = None, force: bool = False) -> SyncReport:
        """Move the trainer's current weights to every worker as ``version``.

        Concurrent calls on one WeightSync are serialized. ``version`` must be newer than
        the last fully synced one unless ``force``; after a failed sync the same version
        may be retried (workers that already took it take it again). ``verify`` (default:
        the settings') checks the bytes on every worker before it commits.
        """
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"version must be an int, got {version!r} ({type(version).__name__})")
        check = self.settings.verify if verify is None else verify
        if not isinstance(check, bool):
            raise SettingsError(f"verify must be True or False, got {verify!r}")
        with self._lock:
            if self.version is not None and version <= self.version and not force:
                raise VersionError(
                    f"version {version} is not newer than the last synced version {self.version}; "
                    "pass force=True to sync it anyway"
                )
            if not self._ready:
                self._setup()
            try:
                report = self._sync(version, check, force)
            except Exception:
                self._metrics.failed()
                raise
            self._metrics.record(report)
            if log.isEnabledFor(logging.INFO):
                log.info(report.summary())
            return report

    def _sync(self, version: int, verify: bool, force: bool) -> SyncReport:
        assert self.manifest is not None
        start = time.perf_counter()
        workers = list(self._workers.values())
        kinds = tuple(sorted({w.transport for w in workers}))
        direct = tuple(w.name for w in workers if w.transport == "direct")
        call = SyncCall(seq=self._seq, version=version, verify=verify, force=force, direct=direct, kinds=kinds)
        sent, results = self._round(call, workers)
        stale = [self._workers[n] for n, r in results.items() if r.stale]
        if stale:
            # Their tensors moved since their export: nothing was written. Export again
            # and write those workers now.
            log.info(
                "weightsync: re-exporting direct targets whose tensors moved: %s",
                {w.name: results[w.name].stale for w in stale},
            )
            try:
                self._open_colocated(("direct",), stale)
            except SetupError as exc:
                self._fail(exc.outcomes, f"re-exporting the direct targets of version {version}")
            retry = replace(call, direct=tuple(w.name for w in stale), kinds=("direct",))
            _, again = self._round(retry, stale)
            results.update(again)
        self._seq += 1
        self.version = version
        seconds = time.perf_counter() - start
        total = self.manifest.total_bytes
        counts: dict[str, int] = {}
        reports = []
        for w in self._workers.values():
            counts[w.transport] = counts.get(w.transport, 0) + 1
            r = results[w.name]
            reports.append(
                WorkerReport(name=w.name, transport=w.transport, version=r.version, state=r.state, seconds=r.seconds)
            )
        return SyncReport(
            version=version,
            bytes=total,
            chunks=len(self.manifest.broadcast_chunks if "broadcast" in counts else self.manifest.chunks),
            inplace=self.manifest.inplace_count if "broadcast" in counts else 0,
            seconds=seconds,
            gbps=total / seconds / 1e9 if seconds > 0 else 0.0,
            transports=counts,
            workers=reports,
            verified=verify,
            send_seconds=sent.seconds,
        )

    def _round(self, call: SyncCall, workers: Sequence[_Worker]) -> tuple[SendResult, dict[str, ReceiveResult]]:
        """One call per party, submitted together (the trainer's ranks first: their checks and
        first chunk overlap the workers' calls being started), awaited once. Every rank is
        told its own workers; rank 0's answer decides the broadcast workers' commits. In push
        mode one call, to the trainer, which wakes the listening workers itself."""
        if self.push:
            return self._push_round(call)
        lead = self.ranks.lead
        calls: Calls = {}
        for r, (rank, handle) in enumerate(self.ranks.parties().items()):
            mine = {w.name: w.transport for w in workers if w.rank == r}
            calls[(rank, "send")] = handle.ws_send.remote(TrainerRanks.call_for(call, mine))
        trainer_ref = calls[(lead, "send")]
        for w in workers:
            calls[(w.name, "receive")] = w.handle.ws_receive.remote(call)
        for w in workers:
            if w.transport == "broadcast":
                calls[(w.name, "commit")] = w.handle.ws_commit.remote(call, trainer_ref, calls[(w.name, "receive")])
        outs = self._gather(calls)
        final = {rank: outs[(rank, "send")] for rank in self.ranks.names}
        for w in workers:
            received = outs[(w.name, "receive")]
            final[w.name] = outs[(w.name, "commit")] if w.transport == "broadcast" and received.ok else received
        if not all(o.ok for o in final.values()):
            self._fail(final, f"during the transfer of version {call.version}")
        return final[lead].value, {w.name: final[w.name].value for w in workers}

    def _push_round(self, call: SyncCall) -> tuple[SendResult, dict[str, ReceiveResult]]:
        when = f"during the push of version {call.version}"
        for attempt in range(2):
            lead = self.ranks.lead
            o = self._gather({(lead, "push"): self.trainer.ws_push.remote(call)})[(lead, "push")]
            if not o.ok:
                self._fail({lead: o}, when)
            if not o.value.setup_needed or attempt:
                break
            self._setup()  # an earlier push from inside the trainer failed
        result = o.value
        if result.setup_needed:
            raise SyncError(f"the trainer still refuses pushes after a new setup {when}", {lead: o}, [lead])
        final = {lead: result.sent, **{n: a.outcome for n, a in result.workers.items()}}
        if not all(x.ok for x in final.values()):
            self._fail(final, when)
        return result.sent.value, {n: a.outcome.value for n, a in result.workers.items()}

    def _fail(self, outcomes: Mapping[str, Outcome], when: str) -> None:
        """Blame, settle every worker that answered, drop the dead, tear down, raise SyncError."""
        culprits = assign_blame(outcomes)
        dead = sorted(n for n, o in outcomes.items() if o.status is Status.DEAD)
        for name in dead:
            self._workers.pop(name, None)
        busy = {n for n, o in outcomes.items() if o.status is Status.TIMED_OUT}
        settled = self._gather(
            {(w.name, "settle"): w.handle.ws_settle.remote() for w in self._workers.values() if w.name not in busy}
        )
        held: dict[str, tuple[int | None, str]] = {}
        for (name, _), o in settled.items():
            if o.ok:
                held[name] = o.value
            else:
                log.warning("weightsync: could not settle %s after a failed sync: %s", name, o.line())
        self._teardown(abort=True, skip=busy)
        lines = describe_failure(f"sync failed {when}", outcomes, culprits)
        gone = [n for n in dead if n not in self.ranks.names]
        if gone:
            lines += f"\n  dropped dead worker(s) {', '.join(gone)}; the next sync sets up without them"
        if held:
            lines += "\n  workers now hold: " + ", ".join(f"{n} v{v} {s}" for n, (v, s) in sorted(held.items()))
        raise SyncError(lines, outcomes, culprits, dead, held)

    # checks -----------------------------------------------------------------------------
    def verify(self) -> str:
        """Compare every worker's per-tensor checksums with the trainer's; returns the digest.

        Module sinks are checked against what they hold now; load_weights sinks against the
        bytes they were handed at their last sync. :class:`VerificationError` names, per
        worker, the first tensor that differs.
        """
        with self._lock:
            if self.manifest is None:
                self._setup()
            assert self.manifest is not None
            outs = self._gather({(p, "checksums"): h.ws_checksums.remote() for p, h in self._handles().items()})
            trainer = [outs[(r, "checksums")] for r in self.ranks.names]
            workers = {w.name: outs[(w.name, "checksums")] for w in self._workers.values()}
            return compare_checksums(trainer, workers, self.manifest.names)

    def status(self) -> dict[str, tuple[int | None, str]]:
        """Each worker's (version, state)."""
        names = list(self._workers)
        refs = [self._workers[n].handle.ws_status.remote() for n in names]
        return dict(zip(names, ray.get(refs, timeout=self.deadlines.coordinator_s)))

    # teardown ---------------------------------------------------------------------------
    def _teardown(self, abort: bool = False, skip: set[str] | frozenset[str] = frozenset()) -> None:
        """Close every transport on every party not in ``skip``; failures are logged (a party
        that died is dropped only by the sync that saw it die, or named by the next setup)."""
        self._ready = False
        calls = {(p, "teardown"): h.ws_teardown.remote(abort) for p, h in self._handles().items() if p not in skip}
        for (party, _), o in self._gather(calls).items():
            if not o.ok:
                log.warning("weightsync: teardown on %s: %s", party, o.line())

    def close(self) -> None:
        """Tear down groups and exports on every live party; the actors stay up."""
        with self._lock:
            self._teardown()

    def __enter__(self) -> WeightSync:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
