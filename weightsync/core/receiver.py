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
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from weightsync.core.checking import check_commit
from weightsync.core.delta.landing import DeltaReceiving, landing_for
from weightsync.core.halves import ReceiveHalf, abort_each, shed_traceback
from weightsync.core.lora.sink import AdapterSinkFactory, session_sink
from weightsync.core.ownership import foreign, refuse_foreign
from weightsync.core.plugin import Listening
from weightsync.core.sinks import ModuleSink, Sink, taken_overflows, watch_casts
from weightsync.core.wire.casts import TensorCast
from weightsync.core.wire.errors import ChecksumMismatch, ManifestError, PeerAborted, VersionError, WeightSyncError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import ReceiveResult, SyncCall
from weightsync.core.wire.outcome import Outcome
from weightsync.core.wire.session import TRAINER_PARTY, Deadlines, Session
from weightsync.core.wire.settings import DEFAULT_TIMEOUT_S


class WorkerState(str, enum.Enum):
    COMMITTED = "committed"  # weights are exactly those of ``version``
    RECEIVING = "receiving"  # a sync is writing; weights must not be read
    DIRTY = "dirty"  # a sync failed midway; weights are a mix, ``version`` is the last good one


class WeightReceiver:
    """A worker's side: checks the Manifest, receives, and tracks its version and state."""

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
        self.adapter_sink: AdapterSinkFactory | None = None
        self._device = torch.device(device)
        self.name = name
        self._expect = (expect_buffer_bytes, expect_num_buffers, expect_inplace_bytes)
        self._session: Session | None = None
        #: The label of the coordinator that set it up last ("": none given): see
        #: :mod:`weightsync.core.ownership`.
        self.owner = ""
        #: The tensors the sink casts on load, from the last accepted Manifest.
        self.casts: tuple[TensorCast, ...] = ()
        self.version: int | None = None
        self.state = WorkerState.COMMITTED
        self.active_half: ReceiveHalf | None = None
        self._closed_imports = [0, 0]
        #: Held while a sync writes this worker's weights from a listener thread (push
        #: mode), and by code reading them; see :meth:`reading`.
        self.gate = threading.RLock()
        #: Push mode's listener (see :meth:`listen`), closed with the transports.
        self.listener: Listening | None = None
        #: The state a sync found (what a staged sync that failed before loading returns
        #: to), and whether the sync's bytes reached the model yet.
        self._before = WorkerState.COMMITTED
        self._touched = False
        #: Which part of its worker this receiver is, of how many (an engine's TP rank k of N
        #: when each rank receives on its own); set by the endpoint that makes it.
        self.part = (0, 1)
        #: Delta sessions: the token of the bytes held, committed (None: none a delta applies
        #: to), and this sync's header's (new token, whether a delta) until it commits.
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
        self.close_transports()
        self.sink = sink
        self._session = session
        self.owner = owner
        self.casts = casts
        watch_casts(self.sink, casts)
        if callable(keep := getattr(self.sink, "keep_base", None)):  # a sink that rebuilds whole tensors
            keep(manifest.agreed.delta)  # keeps the wire bytes to apply deltas to
        return casts

    @property
    def session(self) -> Session:
        if self._session is None:
            raise WeightSyncError(f"{self.name}: no manifest accepted yet; run setup()")
        return self._session

    @property
    def manifest(self) -> Manifest | None:
        """The accepted Manifest, or None before the first setup."""
        return self._session.manifest if self._session is not None else None

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
        try:
            half.start(call)
            self._check_version(call)
            if call.verify and not getattr(self.sink, "records_checksums", True):
                raise WeightSyncError(
                    f"{self.name}: verify compares what the sink holds after loading, and this sink does not "
                    "record it (LoadWeightsSink(record_checksums=False)): record checksums or sync without verify"
                )
            taken_overflows(self.sink)  # what an earlier sync that failed midway counted
            committed = self.state is WorkerState.COMMITTED
            manifest = self.session.manifest
            landing = landing_for(self.sink, manifest, half, self.held_token if committed else None, self.name)
            checksums, stale = half.receive(landing, call, self._begin)
            if isinstance(landing, DeltaReceiving) and landing.header is not None:
                self._header = (landing.header.new_token, landing.took_delta)
            if call.verify and not stale:
                held = self.sink.checksums(self.session.manifest)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the peers know
            failure = shed_traceback(exc)
        if failure is not None:
            try:
                abort_each([half], failure)
            finally:  # an interrupt raised by the abort still leaves the worker marked
                if self.state is WorkerState.RECEIVING:
                    self._fail()
                else:
                    self._discard()
            raise failure
        if not stale and half.knows_sender_finished and not call.verify and self.name not in call.chained:
            self._commit(call.version)
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
        )

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
        self._commit(call.version)
        token = self.held_token or 0
        return replace(got, version=self.version, state=self.state.value, checksums=[], held=None, token=token)

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

    def _check_version(self, call: SyncCall) -> None:
        if self.version is not None and call.version < self.version and not call.force:
            raise VersionError(
                f"{self.name}: version {call.version} is older than the version it holds "
                f"({self.version}); pass force=True to overwrite anyway"
            )

    def _stages(self) -> bool:  # the sink keeps a sync's tensors until it commits
        return bool(getattr(self.sink, "staged", False))

    def _begin(self) -> None:
        # ``receiving`` from the first byte to the commit, staged or not: an engine holds
        # generation off on it (the commit is when a staging sink loads). What a failure
        # leaves depends on whether anything reached the model: see _fail.
        self._before = self.state
        self._touched = not self._stages()
        self.state = WorkerState.RECEIVING

    def _commit(self, version: int) -> None:
        if self._stages():
            self._touched = True
            self.state = WorkerState.RECEIVING
            try:
                self.sink.land()  # type: ignore[attr-defined]
            except BaseException:
                self.state = WorkerState.DIRTY
                raise
        self.version = version
        self.state = WorkerState.COMMITTED
        self.held_token = self._header[0]

    def _discard(self) -> None:
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

    # transports (the plug-ins' WorkerSide) ---------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @device.setter
    def device(self, device: torch.device | str) -> None:
        self._device = torch.device(device)

    def half(self, kind: str) -> ReceiveHalf | None:
        return self.active_half if self.active_half is not None and self.active_half.kind == kind else None

    def install(self, half: ReceiveHalf) -> None:
        """Make ``half`` this worker's transport (a worker has one), closing the one it had."""
        if self.active_half is not half:
            self.close_transports()
        self.active_half = half

    def listen(self, start: Callable[[], Listening]) -> Listening:
        """Push mode: stop the listener this worker had, then keep the one ``start`` makes
        (a thread that runs :meth:`receive_pushed` when its server rings: no Ray call per
        sync) until the transports close; returns it."""
        if self.active_half is None:
            raise WeightSyncError(f"{self.name}: push mode needs an open transport to listen on; run setup()")
        self._stop_listener()
        self.listener = start()
        return self.listener

    def reading(self) -> threading.RLock:
        """Hold this (``with receiver.reading():``) while reading the weights: a pushed sync
        waits for the holder, and nobody reads while a sync writes."""
        return self.gate

    def _stop_listener(self) -> bool:
        listener, self.listener = self.listener, None
        if listener is None:
            return True
        listener.stop()
        if listener.busy and self.active_half is not None:
            # A sync in flight stops at once instead of at its deadline.
            self.active_half.tear_down(f"{self.name}'s teardown")
        timeout_s = self._session.timeout_s if self._session is not None else DEFAULT_TIMEOUT_S
        return listener.close(Deadlines(timeout_s).coordinator_s)

    def ipc_import_counts(self) -> tuple[int, int]:
        """(mappings made, mappings released) by this worker's IPC importers, all sessions."""
        maps, releases = self._closed_imports
        if self.active_half is not None:
            made, released = self.active_half.mappings()
            maps, releases = maps + made, releases + released
        return maps, releases

    def close_transports(self, abort: bool = False) -> None:
        if not self._stop_listener():
            # Its thread still runs inside receive(): leave it the mappings it reads.
            self.active_half = None
            return
        half, self.active_half = self.active_half, None
        self._discard()
        if half is None:
            return
        half.close(abort)
        made, released = half.mappings()
        self._closed_imports[0] += made
        self._closed_imports[1] += released
