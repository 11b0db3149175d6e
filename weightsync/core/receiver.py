"""The worker's endpoint and the one place a worker's state moves.

:class:`WeightReceiver` checks the Manifest, holds the receiving half of the worker's
transport, and runs the worker's state machine for every transport alike. It imports no
Ray and names no transport: the plug-ins' setup actions install its half (it is their
:class:`~weightsync.core.plugin.WorkerSide`). One session::

    receiver.accept(manifest, server, timeout_s, owner)   refuses a mismatch, by tensor, before
                                                   any byte; the receiver's Session starts here
    the plug-in's worker actions                   -> receiver.install(half)
    per sync: receiver.receive(call)               -> ReceiveResult (commits at once when the
                                                      half knows the sender finished)
              receiver.commit(call, got, ref, *sent)  otherwise: once every serving side (and,
                                                      with verify, the reference's) is known
    after a failed sync: receiver.settle()         -> (version, state)
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from weightsync.core.checking import check_commit
from weightsync.core.delta.landing import DeltaReceiving, landing_for
from weightsync.core.halves import ReceiveHalf, abort_each, shed_traceback
from weightsync.core.lora.sink import AdapterSinkFactory, session_sink
from weightsync.core.ownership import foreign, refuse_foreign
from weightsync.core.sinks import ModuleSink, Sink, taken_overflows, watch_casts
from weightsync.core.wire.casts import TensorCast
from weightsync.core.wire.errors import (
    ChecksumMismatch,
    ManifestError,
    PeerAborted,
    SyncInFlight,
    VersionError,
    WeightSyncError,
)
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import ReceiveResult, SyncCall
from weightsync.core.wire.outcome import Outcome
from weightsync.core.wire.session import TRAINER_PARTY, Session
from weightsync.core.wire.settings import DEFAULT_TIMEOUT_S
from weightsync.core.worker_side import TransportEnd


class WorkerState(str, enum.Enum):
    COMMITTED = "committed"  # weights are exactly those of ``version``
    RECEIVING = "receiving"  # a sync is writing; weights must not be read
    DIRTY = "dirty"  # a sync failed midway; weights are a mix, ``version`` is the last good one


class WeightReceiver(TransportEnd):
    """A worker's side: checks the Manifest, receives, and tracks its version and state
    (its transport and push-mode listener: :class:`~weightsync.core.worker_side.TransportEnd`)."""

    def __init__(
        self,
        sink: Sink | nn.Module,
        device: torch.device | str = "cpu",
        name: str = "worker",
        expect_buffer_bytes: int | None = None,
        expect_num_buffers: int | None = None,
        expect_inplace_bytes: int | None = None,
    ) -> None:
        self.sink: Sink = ModuleSink(sink) if isinstance(sink, nn.Module) else sink
        #: The sink given here; a session whose Manifest carries a LoRA adapter receives into
        #: the sink :func:`~weightsync.core.lora.sink.session_sink` picks instead, made by
        #: ``adapter_sink`` when set (None: a ModuleSink of a PEFT model takes it, else refused).
        self.model_sink = self.sink
        #: The label of the coordinator that set it up last ("": none given): see
        #: :mod:`weightsync.core.ownership`.
        self.owner = ""
        self.adapter_sink: AdapterSinkFactory | None = None
        self.name = name
        self._expect = (expect_buffer_bytes, expect_num_buffers, expect_inplace_bytes)
        self._session: Session | None = None
        #: The tensors the sink casts on load, from the last accepted Manifest.
        self.casts: tuple[TensorCast, ...] = ()
        self.version: int | None = None
        self.state = WorkerState.COMMITTED
        TransportEnd.__init__(self, device)
        #: The state a sync found (what a staged sync that failed before loading returns
        #: to), and whether the sync's bytes reached the model yet.
        self._before = WorkerState.COMMITTED
        self._touched = False
        #: Which part of its worker this receiver is, of how many (an engine's TP rank k of N
        #: when each rank receives on its own); set by the endpoint that makes it.
        self.part = (0, 1)
        #: A staging sink's commit only marks the sync ready (:attr:`ready`) and the owner
        #: swaps it in later with :meth:`swap` (an engine, between its generation steps).
        self.swap_later = False
        #: The version staged, checked and waiting for :meth:`swap` (None: none).
        self.ready: int | None = None
        self._incoming: int | None = None  # the version of the sync received last
        #: (owner, seq) of the last sync whose receive began here (see weightsync.core.abandon).
        self.began: tuple[str, int] | None = None
        #: Leaves a pushed sync's answer early (see WorkerSide.answer_early).
        self.answer_early: Callable[[SyncCall, Any], None] | None = None
        #: Delta sessions: the token of the bytes held, committed (None: none a delta applies
        #: to; always None for a staging sink, whose stage holds no base), and this sync's
        #: header's (new token, whether a delta) until it commits.
        self.held_token: int | None = None
        self._header: tuple[int | None, bool | None] = (None, None)

    def accept(
        self,
        manifest: Manifest,
        server: str = TRAINER_PARTY,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        owner: str = "",
    ) -> tuple[TensorCast, ...]:
        """Check ``manifest`` against this worker; raises naming every mismatch, moves nothing.

        Starts this set-up's Session: ``server`` is the trainer party that feeds this
        worker (named when it fails), ``timeout_s`` bounds every wait, ``owner`` labels the
        coordinator setting it up. Returns the tensors this worker's sink casts on load (held
        in another floating dtype than the wire's; only a sink with ``casts_on_load`` may),
        also kept as :attr:`casts` and handed to the sink (which may count overflows).
        """
        if not isinstance(manifest, Manifest):
            raise ManifestError(f"{self.name}: expected a Manifest, got {type(manifest).__name__}")
        manifest.validate()
        manifest.check_buffer_expectations(self.name, *self._expect)
        sink = session_sink(self.model_sink, manifest, self.name, self.adapter_sink)
        local = sink.local_specs()
        casts: tuple[TensorCast, ...] = ()
        if local is not None:
            casts = manifest.check_against(local, self.name, bool(getattr(sink, "casts_on_load", False)))
        session = Session(manifest=manifest, party=self.name, server=server, timeout_s=timeout_s)
        if self.state is WorkerState.RECEIVING:
            self._fail()  # a new session abandons a sync the last one left in flight
        self.close_transports()
        self.sink = sink
        self._session = session
        self.owner = owner
        self.casts = casts
        watch_casts(self.sink, casts)
        if callable(keep := getattr(self.sink, "keep_base", None)):  # a sink that rebuilds whole tensors
            keep(manifest.agreed.delta)  # keeps the wire bytes to apply deltas to
        return casts

    # the state machine ----------------------------------------------------------------
    #
    #   committed(v) --receive(v')--> checks --begin()--> receiving(v') --bytes in--> committed(v')
    #        |                          |                      |
    #        |                          +-- failure: committed(v), nothing was written
    #        |                                                 +-- failure: dirty(v)
    #   broadcast: receiving(v') stays until commit(): committed(v') once the trainer's side
    #   and this side both succeeded (and checksums match), else dirty(v).
    #   direct, tensors moved since the export: committed(v), reported stale, nothing written.
    #
    # Every failure of this side is told to the transport's peers (half.abort()) before it
    # is raised, so none of them waits out a deadline for a cause already known here.

    def receive(self, call: SyncCall) -> ReceiveResult:
        """This worker's side of sync ``call``: check, take the bytes, commit (not broadcast)."""
        start = time.perf_counter()
        refuse_foreign(self.name, self.owner, call.owner)
        half = self.active_half
        if half is None:
            raise WeightSyncError(f"{self.name}: no transport is open; run setup()")
        failure: BaseException | None = None
        checksums: list[int] = []
        stale: tuple[str, ...] = ()
        held: list[int] | None = None
        self._header = (None, None)
        # A staged sync still in flight here (received into the stage, its commit or swap
        # not done) is never mixed with this one: this one is refused, that one left as it is.
        in_flight = self.state is WorkerState.RECEIVING and self._stages()
        self.began = (call.owner, call.seq)
        try:
            half.start(call)
            self._check_call(call, in_flight)
            taken_overflows(self.sink)  # what an earlier sync that failed midway counted
            checksums, stale = self._take(half, call)
            if call.verify and not stale:
                held = self.sink.checksums(self.session.manifest)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the peers know
            failure = shed_traceback(exc)
        if failure is not None:
            try:
                abort_each([half], failure)
            finally:  # an interrupt raised by the abort still leaves the worker marked
                if self.state is WorkerState.RECEIVING and not in_flight:
                    self._fail()
                elif not in_flight:
                    self._discard()
            raise failure
        swapped = 0.0
        if not stale and half.knows_sender_finished and not call.verify and self.name not in call.chained:
            swapped = self._commit(call.version)
        return ReceiveResult(
            worker=self.name,
            version=self.version,
            state=self.state.value,
            checksums=checksums,
            seconds=time.perf_counter() - start,
            stale=stale,
            transport=half.kind,
            held=held,
            overflows=taken_overflows(self.sink),
            delta=self._header[1],
            token=self.held_token or 0,
            **self._staged_result(swapped),
        )

    def _check_call(self, call: SyncCall, in_flight: bool) -> None:
        """Refuse ``call`` before any byte moves: a staged sync still in flight here, an older
        version, a verify this sink cannot answer."""
        if in_flight:
            raise SyncInFlight(
                f"{self.name}: version {call.version}'s sync refused: the sync of version {self._incoming} is "
                "still in flight here (received, not yet committed); one sync at a time per worker: wait for "
                "it to commit or fail"
            )
        if self.version is not None and call.version < self.version and not call.force:
            raise VersionError(
                f"{self.name}: version {call.version} is older than the version it holds "
                f"({self.version}); pass force=True to overwrite anyway"
            )
        self._incoming = call.version
        if call.verify and not getattr(self.sink, "records_checksums", True):
            raise WeightSyncError(
                f"{self.name}: verify compares what the sink holds after loading, and this sink does not "
                "record it (LoadWeightsSink(record_checksums=False)): record checksums or sync without verify"
            )

    def _take(self, half: ReceiveHalf, call: SyncCall) -> tuple[list[int], tuple[str, ...]]:
        """The bytes of ``call`` into the sink (a delta's through its header's landing); a stage sealed."""
        # A stage is fresh every sync: nothing to apply a delta to, whatever was held before.
        base = self.held_token if self.state is WorkerState.COMMITTED and not self._stages() else None
        landing = landing_for(self.sink, self.session.manifest, half, base, self.name)
        checksums, stale = half.receive(landing, call, self._begin)
        if isinstance(landing, DeltaReceiving) and landing.header is not None:
            self._header = (landing.header.new_token, landing.took_delta)
        if self._stages() and not stale:
            self.sink.seal()  # type: ignore[attr-defined]
        return checksums, stale

    def receive_pushed(self, call: SyncCall) -> ReceiveResult:
        """Push mode's receive: no commit call follows, so with ``verify`` the worker commits
        here, on its half's own check of its destination against its one trainer (direct
        compares every tensor this worker holds with the trainer's checksum of it)."""
        got = self.receive(call)
        half = self.active_half
        if call.verify and not got.stale and half is not None and half.knows_sender_finished:
            self._commit(call.version)
            got = replace(got, version=self.version, state=self.state.value)
        return got

    def commit(self, call: SyncCall, received: Outcome, reference: Outcome | None, *sent: Outcome) -> ReceiveResult:
        """Take ``call.version`` once this worker's receive (``received``) and the send of
        every trainer party serving it (``sent``, in rank order: one, or every rank with
        owner sends) are known; only when all succeeded and, with ``verify``, every chunk's
        checksum matches the senders' (theirs concatenated in rank order) and every tensor
        this worker's sink holds matches ``reference``'s checksum of it (the trainer's, or
        rank 0's for every worker of a sharded trainer: a replica that differs on a rank
        serving this worker is named)."""
        if not received.ok:
            raise PeerAborted(f"{self.name}: its own receive failed; nothing to commit", blames=[self.name])
        refuse_foreign(self.name, self.owner, call.owner)
        if not sent:
            raise WeightSyncError(f"{self.name}: asked to commit without any sender's answer (a weightsync bug)")
        failed_senders = [o.party for o in sent if not o.ok]
        if failed_senders:
            self._fail()
            raise PeerAborted(
                f"{self.name}: {', '.join(failed_senders)} failed; version {call.version} not taken",
                blames=failed_senders,
            )
        if reference is not None and not reference.ok:
            self._fail()
            raise PeerAborted(
                f"{self.name}: {reference.party}'s side failed; version {call.version} not taken",
                blames=[reference.party],
            )
        got: ReceiveResult = received.value
        if got.parts:  # a worker fed part by part: this part checks what it received itself
            got = got.parts[self.part[0]]
        if got.stale:
            return got  # nothing was written: the coordinator exports it again
        if call.verify:
            half = self.active_half
            try:
                check_commit(
                    self.name, self.session.manifest.names, got, half.own_senders(sent) if half else sent, reference
                )
            except ChecksumMismatch:
                self._fail()
                raise
        swapped = self._commit(call.version)
        return replace(
            got,
            version=self.version,
            state=self.state.value,
            checksums=[],
            held=None,
            token=self.held_token or 0,
            **self._staged_result(swapped),
        )

    def settle(self, owner: str = "") -> tuple[int | None, str]:
        """After a failed sync of coordinator ``owner``: a worker still receiving is dirty
        (its bytes may be a mix); a staging sink drops what it kept (its model was never
        touched). A worker another coordinator took over since only says what it holds."""
        if foreign(self.owner, owner):
            return self.status()
        if self.state is WorkerState.RECEIVING:
            self._fail()
        else:
            self._discard()
        return self.status()

    def _stages(self) -> bool:  # the sink keeps a sync's tensors until it commits
        return bool(getattr(self.sink, "staged", False))

    def _begin(self) -> None:
        # ``receiving`` from the first byte to the commit, staged or not: an engine holds
        # generation off on it (the commit is when a staging sink loads). What a failure
        # leaves depends on whether anything reached the model: see _fail.
        self._before = self.state
        self._touched = not self._stages()
        self.state = WorkerState.RECEIVING

    def _commit(self, version: int) -> float:
        """Take ``version``; returns the seconds a staging sink's swap held the gate (0 when
        it does not stage, or swaps later: see :attr:`swap_later`)."""
        if self._stages():
            self.held_token = None  # a stage is released after its swap: nothing to patch next time
            if self.swap_later:
                self.ready = version
                return 0.0
            return self._swap(version)
        self.version = version
        self.state = WorkerState.COMMITTED
        self.held_token = self._header[0]
        return 0.0

    def swap(self) -> float:
        """Swap in the staged sync that committed with :attr:`swap_later` (an engine does it
        between its generation steps); returns the seconds it took."""
        version, self.ready = self.ready, None
        if version is None:
            raise WeightSyncError(f"{self.name}: no staged sync waits for its swap")
        return self._swap(version)

    def _swap(self, version: int) -> float:
        """Land the stage under the gate (readers wait only for this); a load that fails
        midway leaves the worker dirty."""
        self._touched = True
        self.state = WorkerState.RECEIVING
        try:
            with self.gate:
                start = time.perf_counter()
                self.sink.land()  # type: ignore[attr-defined]
                held = time.perf_counter() - start
        except BaseException:
            self.state = WorkerState.DIRTY
            raise
        self.version = version
        self.state = WorkerState.COMMITTED
        return held

    def _staged_result(self, swapped: float) -> dict[str, Any]:
        """A staging worker's ReceiveResult fields: its stage, and its swap's hold in this call."""
        staging = getattr(self.sink, "staging", None) if self._stages() else None
        stage = staging.report() if staging is not None else None
        return {"stage": stage, "held_off_s": swapped if swapped else None}

    def _discard(self) -> None:
        self.ready = None
        if self._stages():
            self.sink.discard()  # type: ignore[attr-defined]

    def _fail(self) -> None:
        """A sync is refused: the worker is dirty if bytes reached its tensors; a staging
        sink's model was never touched, so it goes back to what it was before the sync
        (its version, committed). Either way it takes no delta until a dense sync."""
        self.held_token = None
        self._discard()
        if self._stages() and not self._touched:
            if self.state is WorkerState.RECEIVING:
                self.state = self._before
            return
        self.state = WorkerState.DIRTY

    def status(self) -> tuple[int | None, str]:
        return self.version, self.state.value

    def checksums(self) -> list[int] | None:
        """Per tensor, the checksum of what this worker holds (module sinks) or last received."""
        return self.sink.checksums(self.session.manifest)
