"""The transport end of a worker's receiver: its one transport half and push mode's listener.

What a transport plug-in's worker actions see of a worker (its
:class:`~weightsync.core.plugin.WorkerSide`): the device, the half it installs,
the gate, and in push mode the listener thread that runs the worker's receive when its
server rings (``transports/push``). :class:`~weightsync.core.receiver.WeightReceiver` builds on it; the state
machine lives there, and :meth:`TransportEnd.close_transports` asks it, through
``_discard``, to drop what a staged sync kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from weightsync.core.halves import ReceiveHalf
from weightsync.core.plugin import Listening
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import ReceiveResult, SyncCall
from weightsync.core.wire.session import Deadlines, Session
from weightsync.core.wire.settings import DEFAULT_TIMEOUT_S


class TransportEnd:
    """A worker's transport half, gate and push-mode listener (see the module doc)."""

    name: str
    _session: Session | None

    def __init__(self, device: torch.device | str) -> None:
        self._device = torch.device(device)
        self.active_half: ReceiveHalf | None = None
        self._closed_imports = [0, 0]
        #: Held while a sync writes this worker's weights from a listener thread (push
        #: mode) or swaps a staged sync in, and by code reading them; see :meth:`reading`.
        self.gate = threading.RLock()
        #: Push mode's listener (see :meth:`listen`), closed with the transports.
        self.listener: Listening | None = None

    @property
    def session(self) -> Session:
        """What the last accepted set-up fixed (its Manifest, server, timeout)."""
        if self._session is None:
            raise WeightSyncError(f"{self.name}: no manifest accepted yet; run setup()")
        return self._session

    @property
    def manifest(self) -> Manifest | None:
        """The accepted Manifest, or None before the first setup."""
        return self._session.manifest if self._session is not None else None

    def receive_pushed(self, call: SyncCall) -> ReceiveResult:
        raise NotImplementedError

    def status(self) -> tuple[int | None, str]:
        raise NotImplementedError

    def _discard(self) -> None:
        """Drop what a staged sync kept (the receiver's)."""

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
