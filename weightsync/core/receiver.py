"""The worker's endpoint and the one place a worker's state moves.

:class:`WeightReceiver` checks the Manifest, holds the receiving half of the worker's
transport, and runs the worker's state machine for every transport alike. It imports no
Ray. One session::

    receiver.accept(manifest)                      refuses a mismatch, by tensor, before any byte
    open the transport: open_broadcast / attach_ipc / export_direct + seal_direct
    per sync: receiver.receive(call)               -> ReceiveResult (commits unless broadcast)
              receiver.commit(call, sent, got)     broadcast: once the trainer's side is known
    after a failed sync: receiver.settle()         -> (version, state)
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Sequence

import torch
from torch import nn

from weightsync.core.listener import Listener
from weightsync.core.sinks import ModuleSink, Sink
from weightsync.core.transport.base import ReceiveHalf, shed_traceback
from weightsync.core.transport.broadcast import BroadcastReceiver, Communicator
from weightsync.core.transport.control import Deadlines
from weightsync.core.transport.direct import DirectTarget
from weightsync.core.transport.ipc import IpcReceiver
from weightsync.core.wire.errors import ChecksumMismatch, ManifestError, PeerAborted, VersionError, WeightSyncError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import DirectExport, IpcExport, PushExport, ReceiveResult, SyncCall
from weightsync.core.wire.outcome import Outcome


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
        self.device = torch.device(device)
        self.name = name
        self._expect = (expect_buffer_bytes, expect_num_buffers, expect_inplace_bytes)
        self.manifest: Manifest | None = None
        self.version: int | None = None
        self.state = WorkerState.COMMITTED
        self.half: ReceiveHalf | None = None
        self._closed_imports = [0, 0]
        #: Held while a sync writes this worker's weights from a listener thread (push
        #: mode), and by code reading them; see :meth:`reading`.
        self.gate = threading.RLock()
        self.listener: Listener | None = None
        self._timeout_s = 60.0

    def accept(self, manifest: Manifest) -> None:
        """Check ``manifest`` against this worker; raises naming every mismatch, moves nothing."""
        if not isinstance(manifest, Manifest):
            raise ManifestError(f"{self.name}: expected a Manifest, got {type(manifest).__name__}")
        manifest.validate()
        manifest.check_buffer_expectations(self.name, *self._expect)
        local = self.sink.local_specs()
        if local is not None:
            manifest.check_against(local, self.name)
        self.close_transports()
        self.manifest = manifest

    def _manifest(self) -> Manifest:
        if self.manifest is None:
            raise WeightSyncError(f"{self.name}: no manifest accepted yet; run setup()")
        return self.manifest

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
        half = self.half
        if half is None:
            raise WeightSyncError(f"{self.name}: no transport is open; run setup()")
        failure: BaseException | None = None
        checksums: list[int] = []
        stale: tuple[str, ...] = ()
        try:
            self._check_version(call)
            checksums, stale = half.receive(self.sink, call, self._begin)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the peers know
            failure = shed_traceback(exc)
        if failure is not None:
            half.abort()
            if self.state is WorkerState.RECEIVING:
                self.state = WorkerState.DIRTY
            raise failure
        if not stale and half.knows_sender_finished:
            self._commit(call.version)
        return ReceiveResult(
            worker=self.name,
            version=self.version,
            state=self.state.value,
            checksums=checksums,
            seconds=time.perf_counter() - start,
            stale=stale,
        )

    def commit(self, call: SyncCall, sent: Outcome, received: Outcome) -> ReceiveResult:
        """Take ``call.version`` once the trainer's send (``sent``) and this worker's receive
        (``received``) are known; only when both succeeded and, with ``verify``, every
        chunk's checksum matches the trainer's."""
        if not received.ok:
            raise PeerAborted(f"{self.name}: its own receive failed; nothing to commit", blames=[self.name])
        if not sent.ok:
            self._fail()
            raise PeerAborted(
                f"{self.name}: the trainer's side failed; version {call.version} not taken", blames=["trainer"]
            )
        got: ReceiveResult = received.value
        if call.verify:
            expected = sent.value.checksums.get("broadcast", [])
            bad = [i for i, (a, b) in enumerate(zip(got.checksums, expected)) if a != b]
            if bad or len(got.checksums) != len(expected):
                self._fail()
                which = (
                    ", ".join(f"chunk {i}" for i in bad) or f"{len(got.checksums)} checksums for {len(expected)} chunks"
                )
                raise ChecksumMismatch(f"{self.name}: checksum mismatch ({which}): bytes corrupted in transit")
        self._commit(call.version)
        return ReceiveResult(
            worker=self.name, version=self.version, state=self.state.value, checksums=[], seconds=got.seconds
        )

    def settle(self) -> tuple[int | None, str]:
        """After a failed sync: a worker still receiving is dirty (its bytes may be a mix)."""
        if self.state is WorkerState.RECEIVING:
            self._fail()
        return self.status()

    def _check_version(self, call: SyncCall) -> None:
        if self.version is not None and call.version < self.version and not call.force:
            raise VersionError(
                f"{self.name}: version {call.version} is older than the version it holds "
                f"({self.version}); pass force=True to overwrite anyway"
            )

    def _begin(self) -> None:
        self.state = WorkerState.RECEIVING

    def _commit(self, version: int) -> None:
        self.version = version
        self.state = WorkerState.COMMITTED

    def _fail(self) -> None:
        self.state = WorkerState.DIRTY

    def status(self) -> tuple[int | None, str]:
        return self.version, self.state.value

    def checksums(self) -> list[int] | None:
        """Per tensor, the checksum of what this worker holds (module sinks) or last received."""
        return self.sink.checksums(self._manifest())

    # transports -------------------------------------------------------------------------
    def open_broadcast(self, comm: Communicator, members: Sequence[str], timeout_s: float) -> None:
        self.close_transports()
        self.half = BroadcastReceiver(comm, self._manifest(), timeout_s, members)

    def attach_ipc(self, export: IpcExport, consumer_index: int, timeout_s: float) -> None:
        self.close_transports()
        ipc = IpcReceiver(self._manifest(), self.device, timeout_s, self.name)
        ipc.attach(export, consumer_index)
        self.half = ipc

    @property
    def ipc(self) -> IpcReceiver | None:
        return self.half if isinstance(self.half, IpcReceiver) else None

    @property
    def direct(self) -> DirectTarget | None:
        return self.half if isinstance(self.half, DirectTarget) else None

    def export_direct(self, timeout_s: float) -> DirectExport:
        manifest = self._manifest()
        tensors = self.sink.direct_tensors(manifest)
        if tensors is None:
            raise WeightSyncError(
                f"{self.name}: its sink ({type(self.sink).__name__}) transforms tensors on load "
                "and cannot take direct writes; use transport='ipc' for this worker"
            )
        with self.gate:
            target = self.direct
            if target is None:
                self.close_transports()
                target = DirectTarget(manifest, self.device, self.name, timeout_s)
                self.half = target
            return target.export(tensors, self.sink.rebind)

    def listen(self, timeout_s: float) -> PushExport:
        """Push mode: start the listener that runs this direct worker's receive when the
        trainer rings (no Ray call per sync); returns what the trainer attaches."""
        if self.direct is None:
            raise WeightSyncError(
                f"{self.name}: push mode needs the direct transport, this worker has "
                f"{self.half.kind if self.half is not None else 'none'}; use transport='direct' or push=False"
            )
        self._stop_listener()
        self._timeout_s = timeout_s
        self.listener = Listener(self.name, self.device, self.receive, self.status, self.gate)
        return self.listener.export()

    def seal_listen(self) -> None:
        if self.listener is not None:
            self.listener.seal()

    def reading(self) -> threading.RLock:
        """Hold this (``with receiver.reading():``) while reading the weights: a pushed sync
        waits for the holder, and nobody reads while a sync writes."""
        return self.gate

    def _stop_listener(self) -> bool:
        listener, self.listener = self.listener, None
        if listener is None:
            return True
        listener.stop()
        if listener.busy and self.half is not None:
            self.half.abort()  # a sync in flight stops at once instead of at its deadline
        return listener.close(Deadlines(self._timeout_s).coordinator_s)

    def ipc_import_counts(self) -> tuple[int, int]:
        """(mappings made, mappings released) by this worker's IPC importers, all sessions."""
        maps, releases = self._closed_imports
        ipc = self.ipc
        if ipc is not None:
            maps, releases = maps + ipc.importer.maps, releases + ipc.importer.releases
        return maps, releases

    def close_transports(self, abort: bool = False) -> None:
        if not self._stop_listener():
            # Its thread still runs inside receive(): leave it the mappings it reads.
            self.half = None
            return
        half, self.half = self.half, None
        if half is None:
            return
        half.close(abort)
        if isinstance(half, IpcReceiver):
            self._closed_imports[0] += half.importer.maps
            self._closed_imports[1] += half.importer.releases
