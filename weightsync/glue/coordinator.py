"""The coordinator: what a user holds, and the order in which it runs everything else.

Call order::

    with WeightSync(trainer, [w0, w1], transport="auto") as ws:   # setup() on enter
        for step in range(n):
            ray.get(trainer.call.remote(train_step), timeout=...)
            report = ws.sync(version=step)                          # SyncReport
        ws.verify()                                                 # every worker against the trainer
    # close() on exit: tears down groups and exports, never the actors; sync() after it
    # raises ClosedError until setup() opens it again

The jobs live in their own modules: who takes part (:mod:`~weightsync.glue.membership`),
the setup sequence (:mod:`~weightsync.glue.setup`, each transport's own steps through its
plug-in), one round of a sync (:mod:`~weightsync.glue.round`), the report
(:mod:`~weightsync.glue.report`), and one failure policy for all of them
(:mod:`weightsync.core.policy`). After any failure the next sync sets up again.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import ray

from weightsync.core import registry
from weightsync.core.checking import compare_checksums
from weightsync.core.policy import judge
from weightsync.core.wire.casts import TensorCast
from weightsync.core.wire.errors import ClosedError, SettingsError, SetupError, VersionError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.report import SyncReport
from weightsync.core.wire.session import Deadlines
from weightsync.core.wire.settings import BufferBytes, DeltaBase, SyncSettings
from weightsync.glue.claims import claimed
from weightsync.glue.deltas import DeltaBook
from weightsync.glue.membership import Membership
from weightsync.glue.metrics import SyncMetrics
from weightsync.glue.ranks import TrainerRanks
from weightsync.glue.report import build_report
from weightsync.glue.round import Round, stale_members, targets
from weightsync.glue.setup import Setup
from weightsync.glue.steps import Steps

log = logging.getLogger("weightsync")


def resolve_settings(settings: SyncSettings | None, **overrides: Any) -> SyncSettings:
    """``settings`` (by default ``SyncSettings()``) with each keyword that is not None
    replacing its field; refuses anything but a SyncSettings, and unknown fields."""
    base = settings if settings is not None else SyncSettings()
    if not isinstance(base, SyncSettings):
        raise SettingsError(f"settings must be a SyncSettings, got {type(base).__name__}")
    return base.with_overrides(**overrides)


def check_options(backend: object, push: object, ranks: TrainerRanks) -> None:
    """Refuse a ``backend`` or ``push`` that WeightSync does not take, naming it."""
    if backend not in (None, "gloo", "nccl"):
        raise SettingsError(f"backend must be None, 'gloo' or 'nccl', got {backend!r}")
    if not isinstance(push, bool):
        raise SettingsError(f"push must be True or False, got {push!r}")
    if push and len(ranks.names) > 1:
        raise SettingsError("push=True takes one trainer, not the ranks of a sharded one (not supported yet)")


class WeightSync:
    """Moves a trainer actor's weights to worker actors.

    ``transport``: "auto" (per worker, the registry's best fit: with the built-ins, same
    device -> "direct" when its sink allows it, else "ipc"; otherwise "broadcast"), the name
    of a registered transport (:mod:`weightsync.core.registry`), or a mapping of worker name
    to either (a worker the mapping leaves out gets "auto"). ``settings`` (or the same fields
    as keywords, which win) fix the buffers, the timeout and per-sync verification; the
    trainer's copy is sent to every worker in the handshake. ``backend`` forces "gloo" or "nccl" for broadcast. ``push`` (one trainer,
    every worker direct): workers listen for syncs instead of taking a Ray call each, so a
    sync is one call to the trainer, and the trainer may also sync from inside its own
    methods (``TrainerMixin.weightsync_push``); see :mod:`weightsync.transports.push.pusher`. ``lora``:
    the trainer's model is a PEFT model and only its LoRA adapter travels (its config is
    agreed in the handshake; see :mod:`weightsync.core.lora`). ``delta``: send each worker
    only the elements that changed since the bytes it holds (``delta_keyframe``,
    ``delta_base``: see :class:`~weightsync.core.wire.settings.SyncSettings`). ``reply_board``:
    the parties on this host answer a sync's calls through shared memory as well as through
    Ray (:mod:`weightsync.glue.replies`; on by default).

    ``trainer`` is one actor, or the ranks of one sharded trainer in rank order (parties
    ``trainer-rank-<i>``, see :mod:`weightsync.glue.ranks`): rank 0 serves the broadcast
    workers, each colocated worker is served by the rank on its device, or by
    ``worker_ranks[name]``.

    Several WeightSyncs may share one trainer (each with workers of its own): each has its
    own session on the trainer's parties, picked by :attr:`label`, so their setups, syncs,
    failures and closes never touch each other. A worker takes part in one WeightSync at a
    time (a later setup takes it over; the earlier WeightSync's syncs then refuse it by
    name). The syncs of two WeightSyncs on one sharded trainer must not overlap: the later
    one is refused (:class:`~weightsync.core.wire.errors.ConcurrentSyncError`).
    """

    #: The session's Manifest and the version the workers hold (None before the first sync).
    manifest: Manifest | None = None
    version: int | None = None
    #: Set by close(): a sync or verify would set up again with nobody left to close it.
    _closed = False
    _seq = 0

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
        gather_bytes: int | None = None,
        backend: str | None = None,
        worker_ranks: Mapping[str, int] | None = None,
        push: bool = False,
        lora: bool | None = None,
        delta: bool | None = None,
        delta_keyframe: int | None = None,
        delta_base: DeltaBase | None = None,
        reply_board: bool | None = None,
    ) -> None:
        self.settings = resolve_settings(
            settings,
            buffer_bytes=buffer_bytes,
            num_buffers=num_buffers,
            inplace_bytes=inplace_bytes,
            alignment=alignment,
            timeout_s=timeout_s,
            verify=verify,
            gather_bytes=gather_bytes,
            lora=lora,
            delta=delta,
            delta_keyframe=delta_keyframe,
            delta_base=delta_base,
            reply_board=reply_board,
        )
        self.ranks = ranks = TrainerRanks(trainer)
        check_options(backend, push, ranks)
        self.backend = backend
        self.push = push
        self.trainer = ranks.handles[0]
        self._members = Membership(ranks, workers, transport)
        #: Which session on the trainer's parties is this coordinator's (one per WeightSync),
        #: and how errors name it; ``TrainerMixin.weightsync_push(sync=label)`` picks it.
        self.label = f"WeightSync {uuid.uuid4().hex[:8]}"
        self._build_steps(ranks.check_map(worker_ranks, list(self._members.members)))
        self._lock = threading.Lock()
        self._metrics = SyncMetrics()
        self._deltas = DeltaBook(self.settings.delta, self.settings.delta_keyframe)
        # Not at interpreter exit: the actors end with the driver then.
        weakref.finalize(self, _close_abandoned, self._members, self.label, self._life).atexit = False

    def _build_steps(self, worker_ranks: dict[str, int]) -> None:
        """The parts that run this coordinator's steps: its steps, setup and round."""
        # Nothing the parts hold refers back to this object, so a WeightSync dropped without
        # close() is collected at once and closes its sessions (see _close_abandoned).
        self._life = _Life()
        self._steps = Steps(self._members, functools.partial(Deadlines, self.settings.timeout_s), self.label)
        self._steps.on_teardown = self._life.unready
        self._setup = Setup(
            self._members,
            self._steps,
            self.settings,
            {"backend": self.backend},
            registry.mode("push") if self.push else None,
            worker_ranks,
        )
        self._round = Round(self._members, self._steps)

    @property
    def deadlines(self) -> Deadlines:
        return Deadlines(self.settings.timeout_s)

    # membership -------------------------------------------------------------------------
    def add_worker(self, handle: Any, name: str | None = None) -> str:
        """Add a worker; the next sync sets up again to include it."""
        with self._lock:
            added = self._members.add(name, handle)
            self._deltas.forget([added])
            self._life.ready = False
            return added

    def remove_worker(self, name: str) -> None:
        """Drop a worker (its transports are torn down); the next sync sets up without it."""
        with self._lock:
            if name not in self._members.members:
                raise KeyError(f"no worker named {name!r}; known: {sorted(self._members.members)}")
            self._steps.teardown(abort=False, why=f"remove_worker({name!r})")
            self._members.remove(name)
            self._deltas.forget([name])

    @property
    def workers(self) -> dict[str, Any]:
        return self._members.workers

    def transports(self) -> dict[str, str]:
        return self._members.transports()

    def casts(self) -> dict[str, tuple[TensorCast, ...]]:
        """Per worker, the tensors its sink casts on load (another floating dtype than the
        wire's), as accepted in the last setup; every SyncReport counts them per worker."""
        return {name: m.casts for name, m in self._members.members.items()}

    # setup ------------------------------------------------------------------------------
    def setup(self) -> Manifest:
        """Handshake with every worker and open the transports; refuses any mismatch first.
        After ``close()`` this opens the WeightSync again (close it again when done)."""
        with self._lock:
            self._closed = False
            return self._set_up()

    def _refuse_closed(self, what: str) -> None:
        if self._closed:
            raise ClosedError(
                f"{self.label}: {what} after close() (its with block ended, or close() was called): it would set "
                "the transports up again and leave them open; sync inside the with block, or call setup() to "
                "open it again and close() it when done"
            )

    def _set_up(self) -> Manifest:
        self._life.ready = False
        self._life.opened = True  # a failed setup leaves sessions open on the parties it reached
        manifest = self._setup.run()
        self.manifest = manifest
        self._life.ready = True
        self._seq = 0
        return manifest

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
            self._refuse_closed(f"sync(version={version})")
            if self.version is not None and version <= self.version and not force:
                raise VersionError(
                    f"version {version} is not newer than the last synced version {self.version}; "
                    "pass force=True to sync it anyway"
                )
            try:
                if not self._life.ready:
                    self._set_up()
                with claimed(self.ranks, self.label, f"sync of version {version}"):
                    report = self._sync(version, check, force)
            except Exception:
                self._metrics.failed()
                self._deltas.forget()
                raise
            self._metrics.record(report)
            # Values a worker's cast on load turned into inf are worth a warning every time.
            level = logging.WARNING if any(w.overflows for w in report.workers) else logging.INFO
            if log.isEnabledFor(level):
                log.log(level, report.summary())
            return report

    def _sync(self, version: int, verify: bool, force: bool) -> SyncReport:
        assert self.manifest is not None
        start = time.perf_counter()
        members = list(self._members.members.values())
        call = SyncCall(
            seq=self._seq,
            version=version,
            verify=verify,
            force=force,
            targets=targets(members),
            owner=self.label,
            delta_holds=self._deltas.holds(m.name for m in members),
            delta_token=self._deltas.token(),
        )
        if self.push:
            sent, results = self._round.push(call, self._set_up)
        else:
            sent, results = self._round.run(call, members)
        stale = stale_members(results, self._members)
        if stale:
            # Their tensors moved since their export: nothing was written. Export again
            # and write those workers now.
            log.info(
                "weightsync: exporting again the workers whose tensors moved: %s",
                {m.name: results[m.name].stale for m in stale},
            )
            try:
                self._setup.open(stale)
            except SetupError as exc:
                verdict = judge(
                    exc.outcomes, f"sync failed exporting again the workers whose tensors moved, version {version}"
                )
                if verdict is None:
                    raise
                self._round.fail(verdict)
            _, again = self._round.run(replace(call, targets=targets(stale)), stale)
            results.update(again)
        self._seq += 1
        self.version = version
        self._deltas.heard(results)
        return build_report(
            version, self.manifest, self._members.members.values(), results, sent, time.perf_counter() - start, verify
        )

    # checks -----------------------------------------------------------------------------
    def verify(self) -> str:
        """Compare every worker's per-tensor checksums with the trainer's; returns the digest.

        Module sinks are checked against what they hold now; load_weights sinks against the
        bytes they were handed at their last sync. :class:`VerificationError` names, per
        worker, the first tensor that differs.
        """
        with self._lock:
            self._refuse_closed("verify()")
            if self.manifest is None:
                self._set_up()
            assert self.manifest is not None
            handles = self._members.handles()
            kwargs = self._steps.trainer_kwargs
            with claimed(self.ranks, self.label, "verify()"):
                outs = self._steps.gather(
                    {(p, "checksums"): h.ws_checksums.remote(**kwargs(p)) for p, h in handles.items()}
                )
            trainer = [outs[(r, "checksums")] for r in self.ranks.names]
            workers = {n: outs[(n, "checksums")] for n in self._members.members}
            return compare_checksums(trainer, workers, self.manifest.names)

    def status(self) -> dict[str, tuple[int | None, str]]:
        """Each worker's (version, state)."""
        names = list(self._members.members)
        refs = [self._members.members[n].handle.ws_status.remote() for n in names]
        return dict(zip(names, ray.get(refs, timeout=self.deadlines.coordinator_s)))

    # teardown ---------------------------------------------------------------------------
    def close(self) -> None:
        """Tear down this WeightSync's groups and exports on every live party (its session on
        the trainer's parties is dropped; other WeightSyncs' stay); the actors stay up. A later
        ``sync()`` or ``verify()`` raises :class:`ClosedError` until ``setup()`` is called."""
        with self._lock:
            self._closed = True
            self._steps.teardown(why="close()", forget=True)
            self._life.opened = False

    def __enter__(self) -> WeightSync:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Life:
    """Where a WeightSync stands: ``ready`` (set up, nothing torn down since) and ``opened``
    (it may hold sessions on its parties: a setup began, no ``close()`` since)."""

    ready = False
    opened = False

    def unready(self) -> None:
        self.ready = False


def _close_abandoned(members: Membership, label: str, life: _Life) -> None:
    """A WeightSync garbage-collected without ``close()``: close its sessions on every party
    it may have set up (each call is sent, not awaited; a worker another coordinator set up
    since keeps that one's session)."""
    if not life.opened or not ray.is_initialized():
        return
    why = f"{label} (garbage-collected without close())"
    for party, handle in members.handles().items():
        if party in members.ranks.names:
            handle.ws_teardown.remote(True, why, owner=label, forget=True)
        else:
            handle.ws_teardown.remote(True, owner=label)
