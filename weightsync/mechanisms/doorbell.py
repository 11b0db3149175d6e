"""A listening worker's doorbell: a datagram socket on this host that wakes its listener.

The doorbell only shortens the listener's sleep: what to do is in the worker's mailbox (an
owner-only ``/dev/shm`` file), and the listener looks there at least every few hundred
milliseconds anyway. Since any local process can send to a Unix socket, a doorbell

* counts a ring only when the datagram carries the session's key (random, handed to the
  trainer in the :class:`~weightsync.core.wire.messages.PushExport`) and, on Linux, the
  kernel-attested sender is of this user (``SO_PASSCRED``); anything else is read, counted
  in :attr:`Doorbell.ignored` and otherwise ignored, so a flood costs a wake-up, not a sync;
* is rung without ever blocking past a deadline (:func:`ring`): a listener that does not
  drain its queue (stalled, or flooded by another process) makes the ring fail by its
  deadline with an error naming the worker, instead of blocking the ringing thread forever.

On Linux the socket is abstract (no file to leak); elsewhere a socket file in the temp
directory.
"""

from __future__ import annotations

import errno
import hmac
import os
import select
import socket
import struct
import sys
import tempfile
import time
import uuid

from weightsync.core.wire.errors import TransferTimeout

KEY_BYTES = 16
_CRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
_PASSCRED = getattr(socket, "SO_PASSCRED", None)
_SCM_CREDENTIALS = getattr(socket, "SCM_CREDENTIALS", None)
#: How often a ring whose peer's queue is full looks again, at most (poll wakes it sooner).
_RETRY_S = 0.05


class Doorbell:
    """The listener's end: a datagram socket it sleeps on; :func:`ring` wakes it."""

    def __init__(self) -> None:
        name = f"weightsync-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.key = os.urandom(KEY_BYTES)
        self.ignored = 0
        self._file: str | None = None
        if sys.platform.startswith("linux"):
            self.address = "\0" + name
        else:
            self._file = self.address = os.path.join(tempfile.gettempdir(), name + ".sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._creds = False
        if _PASSCRED is not None and _SCM_CREDENTIALS is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, _PASSCRED, 1)
            self._creds = True
        self.sock.bind(self.address)

    def wait(self, timeout_s: float) -> bool:
        """Sleep until a genuine ring (True) or ``timeout_s`` passed (False). The queue is
        drained (until empty or the deadline, so a flood cannot keep it here); datagrams that
        are not a genuine ring are counted and dropped."""
        deadline = time.monotonic() + timeout_s
        rung = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return rung
            if rung:
                self.sock.setblocking(False)
            else:
                self.sock.settimeout(left)
            try:
                data, ancillary, _, _ = self.sock.recvmsg(KEY_BYTES + 1, socket.CMSG_SPACE(_CRED.size))
            except (TimeoutError, BlockingIOError):
                return rung
            if self._genuine(data, ancillary):
                rung = True
            else:
                self.ignored += 1

    def drain(self) -> bool:
        """Read every queued datagram without waiting; whether one was a genuine ring."""
        self.sock.setblocking(False)
        rung = False
        while True:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(KEY_BYTES + 1, socket.CMSG_SPACE(_CRED.size))
            except BlockingIOError:
                return rung
            if self._genuine(data, ancillary):
                rung = True
            else:
                self.ignored += 1

    def _genuine(self, data: bytes, ancillary: list[tuple[int, int, bytes]]) -> bool:
        if not hmac.compare_digest(data, self.key):
            return False
        if not self._creds:
            return True
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == _SCM_CREDENTIALS and len(payload) >= _CRED.size:
                _, uid, _ = _CRED.unpack_from(payload)
                return bool(uid == os.getuid())
        return False

    def close(self) -> None:
        self.sock.close()
        if self._file is not None and os.path.exists(self._file):
            os.unlink(self._file)


class Bell:
    """The ringing end of one listener's doorbell, kept connected between rings.

    A push rings every listening worker each sync; a socket made, connected and closed per
    ring costs several times the send itself. Call order: ``Bell(address, key, who)``, then
    :meth:`ring` once per sync, :meth:`close` when the worker is forgotten. Not safe for two
    threads at once: the pusher rings and forgets under its own lock.
    """

    def __init__(self, address: str, key: bytes, who: str) -> None:
        self.address = address
        self.key = key
        self.who = who
        self._sock: socket.socket | None = None

    def ring(self, deadline: float) -> bool:
        """Wake the listener; False when nobody listens at the address any more.

        Never blocks past ``deadline`` (``time.monotonic()``): while the listener's queue is
        full the ring waits for room, and at the deadline raises :class:`TransferTimeout`
        naming the worker. A kept socket whose peer went away is closed and the address
        connected afresh once, so the answer is the same as a new socket's would be.
        """
        fresh = self._sock is None
        sock = self._sock or self._connect()
        if sock is None:
            return False
        while True:
            try:
                sock.send(self.key)
                return True
            except BlockingIOError:
                pass
            except OSError as exc:
                if not _peer_gone(exc):
                    raise
                self.close()
                if fresh:
                    return False
                fresh = True
                sock = self._connect()
                if sock is None:
                    return False
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(
                    f"{self.who}: its doorbell's queue stayed full until the deadline (its listener is stalled, "
                    "or another process floods its doorbell); the ring was given up",
                    blames=[self.who],
                )
            select.select([], [sock], [], min(left, _RETRY_S))

    def _connect(self) -> socket.socket | None:
        """A socket connected to the listener's address, kept for later rings; None when
        nobody listens there."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            # Connected, so a full peer queue reads as "not writable" to select.
            sock.connect(self.address)
        except OSError as exc:
            sock.close()
            if not _peer_gone(exc):
                raise
            return None
        self._sock = sock
        return sock

    @property
    def connected(self) -> bool:
        """Whether the bell holds a socket connected to the listener (from its first ring on)."""
        return self._sock is not None

    def close(self) -> None:
        """Let the socket go; a later ring connects afresh."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _peer_gone(exc: OSError) -> bool:
    """Whether ``exc`` says nobody listens at the address (any more): refused, no such
    file, or, on systems that disconnect a datagram socket whose peer closed, not connected."""
    return isinstance(exc, (ConnectionError, FileNotFoundError)) or exc.errno in (errno.ENOTCONN, errno.EDESTADDRREQ)


def ring(address: str, key: bytes, deadline: float, who: str) -> bool:
    """Ring the doorbell at ``address`` once (see :meth:`Bell.ring`), with a socket of its own."""
    bell = Bell(address, key, who)
    try:
        return bell.ring(deadline)
    finally:
        bell.close()
