"""An engine actor's own line to each of its TP ranks, for work that must not stop generation.

vLLM reaches its worker processes only through ``collective_rpc``, which the engine core
runs between generation steps, on the thread that runs the model: a call that lasts the
whole transfer holds generation off for the whole transfer. A staged sync's receive runs
over these lines instead, on a thread of its own in each rank, while vLLM goes on stepping;
only the swap goes through ``collective_rpc``.

The actor listens on a Unix socket of this host (abstract on Linux, so no file is left
behind; elsewhere a file in a private folder); each rank connects when staging is set up,
with a random key both sides prove they hold (``multiprocessing.connection``'s challenge),
and says which TP rank it is. A job is bytes out to every rank at once, bytes back from each
(weightsync's own encoding, see ``codec.py``), numbered so that an answer that comes too late
is never taken for the next job's. Call order::

    lines = EngineLines.listen(name)                      # the actor
    lines.accept(ranks)                                   # a thread takes the ranks' calls
    collective_rpc("weightsync_stage", (..., lines.info))  # each rank: RankLine(info, ...)
    lines.accepted(timeout_s)                             # every rank connected
    replies = lines.run("call", payload, timeout_s)       # a job, on every rank at once
    lines.close()                                         # the ranks' threads end
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, wait

from weightsync import WeightSyncError

log = logging.getLogger("weightsync")
KEY_BYTES = 32


@dataclass(frozen=True)
class LineInfo:
    """Where a rank reaches its engine actor's lines, and the key it proves it holds."""

    address: str
    key: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address:
            raise ValueError(f"LineInfo.address must be a socket address, got {self.address!r}")
        if not isinstance(self.key, bytes) or len(self.key) != KEY_BYTES:
            raise ValueError(f"LineInfo.key must be {KEY_BYTES} bytes")


class LineError(WeightSyncError):
    """A TP rank's line broke (its process ended) or gave no answer in time."""


class EngineLines:
    """The actor's end: one connection per TP rank, in rank order."""

    def __init__(self, name: str, listener: Listener, info: LineInfo, folder: str | None) -> None:
        self.name = name
        self.info = info
        self._listener: Listener | None = listener
        self._folder = folder
        self._conns: list[Connection] = []
        self._taking: concurrent.futures.Future[list[Connection]] = concurrent.futures.Future()
        self._seq = 0

    @classmethod
    def listen(cls, name: str) -> EngineLines:
        key = os.urandom(KEY_BYTES)
        folder = None
        if sys.platform.startswith("linux"):
            address = f"\0weightsync-lines-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        else:
            folder = tempfile.mkdtemp(prefix="weightsync-lines-")
            address = os.path.join(folder, "lines.sock")
        listener = Listener(address, family="AF_UNIX", authkey=key)
        return cls(name, listener, LineInfo(address, key), folder)

    @property
    def ranks(self) -> int:
        return len(self._conns)

    def accept(self, ranks: int) -> None:
        """Start taking ``ranks`` connections on a thread of its own (the ranks connect while
        the caller's RPC into them runs); :meth:`accepted` waits for them."""
        listener = self._listener
        assert listener is not None, "accept once, before any job"
        self._taking = future = concurrent.futures.Future[list[Connection]]()

        def take() -> None:
            by_rank: dict[int, Connection] = {}
            try:
                while len(by_rank) < ranks:
                    try:
                        conn = listener.accept()
                    except (AuthenticationError, EOFError) as exc:  # a caller without the key
                        log.warning("weightsync: %s: refused a connection to its staging lines: %s", self.name, exc)
                        continue
                    rank = conn.recv()
                    if not isinstance(rank, int) or not 0 <= rank < ranks or rank in by_rank:
                        conn.close()
                        raise LineError(f"{self.name}: a line said it is TP rank {rank!r} of {ranks}")
                    by_rank[rank] = conn
                future.set_result([by_rank[k] for k in range(ranks)])
            except BaseException as exc:  # noqa: BLE001 - handed to accepted()
                for conn in by_rank.values():
                    conn.close()
                future.set_exception(exc)

        threading.Thread(target=take, name=f"weightsync-lines-{self.name}", daemon=True).start()

    def accepted(self, timeout_s: float) -> None:
        """Wait for every rank's connection; past ``timeout_s`` stop listening and raise."""
        try:
            self._conns = self._taking.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self.close()  # ends the accept
            raise LineError(
                f"{self.name}: its TP ranks did not all connect their staging lines within {timeout_s:.0f}s (a "
                "rank on another host cannot: a staged engine keeps its ranks on the actor's host)"
            ) from None

    def run(self, kind: str, payload: bytes, timeout_s: float) -> list[bytes]:
        """Job ``kind`` with ``payload`` on every rank at once; each rank's answer, in rank
        order. A rank whose line broke, or that gives no answer within ``timeout_s``, fails
        the job naming it (the other ranks' answers are then dropped)."""
        if not self._conns:
            raise LineError(f"{self.name}: no staging lines to its TP ranks (staging was never set up)")
        self._seq += 1
        seq = self._seq
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((seq, kind, payload))
            except OSError as exc:
                raise LineError(f"{self.name} (TP rank {rank}): its staging line broke ({exc})") from exc
        answers: dict[int, bytes] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < len(self._conns):
            waiting = [c for k, c in enumerate(self._conns) if k not in answers]
            ready = wait(waiting, max(0.0, deadline - time.monotonic()))
            if not ready:
                late = [k for k in range(len(self._conns)) if k not in answers]
                raise LineError(
                    f"{self.name}: TP rank(s) {late} gave no answer to the staged {kind} within {timeout_s:.0f}s"
                )
            for rank, conn in enumerate(self._conns):
                if conn not in ready:
                    continue
                try:
                    got, reply = conn.recv()
                except (EOFError, OSError) as exc:
                    raise LineError(
                        f"{self.name} (TP rank {rank}): its staging line closed during the staged {kind} "
                        f"(the rank's process ended?): {type(exc).__name__}"
                    ) from exc
                if got == seq:
                    answers[rank] = reply
        return [answers[k] for k in range(len(self._conns))]

    def close(self) -> None:
        """Close every line (each rank's thread ends) and stop listening."""
        conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


class RankLine:
    """A TP rank's end: a thread that runs ``serve(kind, payload) -> reply`` for each job,
    one at a time, until the actor closes the line. ``serve`` never raises (it encodes any
    failure in its reply). ``busy`` while a job runs."""

    def __init__(self, info: LineInfo, tp_rank: int, serve: Callable[[str, bytes], bytes], name: str) -> None:
        self._conn = Client(info.address, family="AF_UNIX", authkey=info.key)
        self._conn.send(tp_rank)
        self._serve = serve
        self.busy = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"weightsync-line-{name}-{tp_rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                try:
                    seq, kind, payload = self._conn.recv()
                except (EOFError, OSError):
                    return  # the line was closed at either end (or the actor died)
                self.busy.set()
                try:
                    reply = self._serve(kind, payload)
                finally:
                    self.busy.clear()
                try:
                    self._conn.send((seq, reply))
                except OSError:
                    return
        finally:
            self._conn.close()  # this thread's alone: closed under a blocked read, it would raise

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a running job to end; True when none runs."""
        deadline = time.monotonic() + timeout_s
        while self.busy.is_set() and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self.busy.is_set()

    def close(self) -> None:
        """End the line: its socket is shut down, so the thread's read (or its reply to a job
        still running) ends and the thread closes the connection as it returns."""
        try:
            end = socket.socket(fileno=os.dup(self._conn.fileno()))
        except OSError:
            return  # the thread already closed it
        with end:
            with contextlib.suppress(OSError):  # the actor's end may be gone first
                end.shutdown(socket.SHUT_RDWR)
