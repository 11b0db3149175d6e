"""The reply connections: how each TP rank of a vLLM server answers a ServerWorker's calls.

vLLM's RL route ``/update_weights`` answers only "Weights updated", so the answer of a
weightsync call made through it (an :class:`~weightsync.core.wire.outcome.Outcome`, a
checksum list) travels back on a TCP connection of its own. Each TP rank opens one to the
ServerWorker while ``/init_weight_transfer_engine`` runs, says who it is in a sealed hello,
and writes one sealed reply per call, tagged with the call's sequence number. The
ServerWorker listens only while that init runs. Call order::

    listener = ReplyListener(host)                  # the ServerWorker, before the init
    ...  POST /init_weight_transfer_engine           # each rank: ReplyLine(host, port), .send(hello)
    lines = listener.accept(key, session, size, deadline); listener.close()
    ...  POST /update_weights                        # each rank: line.send(sealed reply for seq)
    body = lines[k].read(key, session, seq, deadline)

Frames are a 4-byte big-endian length and a sealed message (:mod:`weightsync.vllm.sealing`);
a connection whose hello is not sealed under the key, or names another session, is closed
and ignored.
"""

from __future__ import annotations

import logging
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from weightsync import WeightSyncError
from weightsync.vllm.sealing import SealError, unseal

log = logging.getLogger("weightsync")
_LENGTH = struct.Struct(">I")
#: The largest frame read (a reply carrying per-tensor checksums of a large model fits).
MAX_FRAME_BYTES = 256 << 20
#: How long one connection may take to say hello before the listener moves on.
HELLO_S = 10.0


class ReplyError(WeightSyncError):
    """A reply connection closed, stayed silent past its deadline, or carried a bad frame."""


@dataclass(frozen=True, kw_only=True)
class Hello:
    """What a TP rank says first on its reply connection (its sealed header)."""

    rank: int
    size: int
    pid: int
    #: The rank's fresh random nonce for this session: every call must name it.
    nonce: str
    #: Whether vLLM's weight-update session (start ... finish) is open on this rank.
    updating: bool
    #: The weightsync version the server runs.
    version: str

    def __post_init__(self) -> None:
        ints = (self.rank, self.size, self.pid)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints) or not 0 <= self.rank < self.size:
            raise ValueError(f"a hello names rank, size and pid as ints with 0 <= rank < size, got {ints}")
        if not isinstance(self.nonce, str) or len(self.nonce) < 32:
            raise ValueError("a hello carries a nonce of at least 16 random bytes, as hex")
        if not isinstance(self.updating, bool) or not isinstance(self.version, str):
            raise ValueError("a hello says whether an update session is open and which weightsync version runs")

    @classmethod
    def of(cls, header: dict[str, Any]) -> Hello:
        fields = ("rank", "size", "pid", "nonce", "updating", "version")
        values: dict[str, Any] = {f: header.get(f) for f in fields}
        return cls(**values)


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(data)) + data)


def recv_frame(sock: socket.socket, deadline: float, who: str) -> bytes:
    """One frame from ``sock``, waiting until ``deadline`` (``time.monotonic()``)."""
    (length,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size, deadline, who))
    if length > MAX_FRAME_BYTES:
        raise ReplyError(f"{who}: a frame of {length} bytes announced, more than the {MAX_FRAME_BYTES} allowed")
    return _recv_exactly(sock, length, deadline, who)


def _recv_exactly(sock: socket.socket, n: int, deadline: float, who: str) -> bytes:
    parts, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ReplyError(f"{who}: no reply within the deadline (its connection stays silent)")
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - got, 1 << 20))
        except TimeoutError:
            continue  # the loop raises, having checked the deadline once more
        except OSError as exc:
            raise ReplyError(f"{who}: its reply connection failed ({exc}); did the process end?") from exc
        if not chunk:
            raise ReplyError(f"{who}: closed its reply connection (its process ended, or the server stopped)")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


class RankLine:
    """One TP rank's reply connection, as the ServerWorker holds it."""

    def __init__(self, sock: socket.socket, hello: Hello, peer: str, who: str) -> None:
        self.sock = sock
        self.hello = hello
        #: The rank's address as this side sees it (where it connected from).
        self.peer = peer
        self.who = who

    def read(self, key: bytes, session: str, seq: int, deadline: float) -> bytes:
        """The body of this rank's reply to call ``seq``; replies to earlier calls (left by
        a call that failed after the rank answered) are skipped."""
        while True:
            try:
                header, body = unseal(key, recv_frame(self.sock, deadline, self.who), "reply")
            except SealError as exc:
                raise ReplyError(f"{self.who}: a reply was refused: {exc}") from exc
            if header.get("session") != session or header.get("rank") != self.hello.rank:
                raise ReplyError(f"{self.who}: a reply of another session or rank arrived: {header}")
            got = header.get("seq")
            if not isinstance(got, int) or got > seq:
                raise ReplyError(f"{self.who}: a reply to call {got!r} arrived while call {seq} was awaited")
            if got == seq:
                return body

    def alive(self) -> bool:
        """False once the rank closed its connection (the server's process ended)."""
        self.sock.setblocking(False)  # a socket with a timeout would wait for data instead
        try:
            data = self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        finally:
            self.sock.setblocking(True)
        return bool(data)  # a stale reply waiting to be skipped, or end of stream

    def close(self) -> None:
        self.sock.close()


class ReplyListener:
    """Where the TP ranks connect while the init runs: ``host`` only, a free port."""

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.bind((host, 0))
            self._sock.listen(16)
        except OSError as exc:
            self._sock.close()
            raise WeightSyncError(
                f"cannot listen on {host} for the vLLM server's replies ({exc}); give the ServerWorker "
                "reply_host=, an address of this node that the server can reach"
            ) from exc
        self.host = host
        self.port = int(self._sock.getsockname()[1])

    def accept(self, key: bytes, session: str, size: int, deadline: float, who: str) -> list[RankLine]:
        """A line for each of the ``size`` ranks of ``session``, by rank, before ``deadline``."""
        lines: dict[int, RankLine] = {}
        try:
            while len(lines) < size:
                conn, peer = self._accept_one(deadline, size, lines, who)
                line = self._greet(conn, peer[0], key, session, size, min(deadline, time.monotonic() + HELLO_S), who)
                if line is not None and line.hello.rank not in lines:
                    lines[line.hello.rank] = line
                elif line is not None:
                    line.close()
                    log.warning("weightsync: %s: TP rank %d connected twice; kept the first", who, line.hello.rank)
        except BaseException:
            for line in lines.values():
                line.close()
            raise
        return [lines[rank] for rank in range(size)]

    def _accept_one(
        self, deadline: float, size: int, lines: dict[int, RankLine], who: str
    ) -> tuple[socket.socket, Any]:
        left = deadline - time.monotonic()
        if left > 0:
            self._sock.settimeout(left)
            try:
                return self._sock.accept()
            except TimeoutError:
                pass
        missing = sorted(set(range(size)) - set(lines))
        raise ReplyError(
            f"{who}: TP rank(s) {missing} of the server never connected back to {self.host}:{self.port}; the "
            "server's processes must reach that address (pass reply_host= to the ServerWorker otherwise)"
        )

    @staticmethod
    def _greet(
        conn: socket.socket, peer: str, key: bytes, session: str, size: int, deadline: float, who: str
    ) -> RankLine | None:
        try:
            header, _ = unseal(key, recv_frame(conn, deadline, f"{who} (connection from {peer})"), "hello")
            hello = Hello.of(header)
            if header.get("session") != session or hello.size != size:
                raise ValueError(f"session {header.get('session')!r} of {hello.size} rank(s) is not this one")
        except (ReplyError, SealError, ValueError, TypeError) as exc:
            conn.close()
            log.warning("weightsync: %s: a connection from %s was refused: %s", who, peer, exc)
            return None
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return RankLine(conn, hello, peer, f"{who} (TP rank {hello.rank})")

    def close(self) -> None:
        self._sock.close()


class ReplyLine:
    """A TP rank's end of its reply connection (inside the vLLM server's worker process)."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise WeightSyncError(
                f"cannot connect back to the ServerWorker at {host}:{port} ({exc}); this server must reach that "
                "address (the ServerWorker's reply_host=)"
            ) from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(timeout_s)

    def send(self, data: bytes) -> None:
        try:
            send_frame(self._sock, data)
        except OSError as exc:
            raise WeightSyncError(f"the ServerWorker's reply connection failed ({exc}); it must connect again") from exc

    def close(self) -> None:
        self._sock.close()


__all__ = ["Hello", "RankLine", "ReplyError", "ReplyLine", "ReplyListener", "recv_frame", "send_frame"]
