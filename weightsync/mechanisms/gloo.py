"""A gloo :class:`~weightsync.transports.broadcast.halves.Communicator` for CPU tensors.

The group is standalone: a ``ProcessGroupGloo`` over a ``PrefixStore`` of its own
``TCPStore``, never the default ``torch.distributed`` group, which a real trainer (FSDP,
Megatron) already owns. Rank 0 opens the store first (:func:`open_store`, port 0 picks a
free one) and the coordinator hands its address to the other ranks.

The store listens on the one address it is given, never on every interface: torch's
``TCPStore`` server ignores its host argument and binds ``*:port`` (both IPv4 and IPv6), so
:func:`open_store` binds and listens on a socket of its own and hands it over
(``master_listen_fd``). The store has no authentication: whoever can reach the address can
read and write keys, so the callers keep their keys under an unguessable prefix.

An abort must reach every peer at once. Dropping a gloo group closes its sockets (which
fails the peers' pending operations) only once the group is destroyed, and destroying it
waits for the group's own pending operations: a rank that aborts while it still waits to
receive from a live peer would keep its sockets open, and that peer waiting, until gloo's
timeout. So :meth:`GlooCommunicator.abort` also writes an abort word into the group's
store, every wait polls it, and the group is released on a background thread.

The store lives in rank 0's process: when rank 0 dies (SIGKILL, OOM) nobody can write the
abort word, and a rank waiting on another live rank (gloo relays a large broadcast through
the ranks) would not see rank 0 go. A store that stops answering therefore means rank 0
is gone, and every wait fails at once naming it.
"""

from __future__ import annotations

import datetime
import gc
import logging
import socket
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from weightsync.core.wire.errors import TransferError, TransferTimeout, WeightSyncError

log = logging.getLogger("weightsync")
_ABORT_KEY = "weightsync-abort"
#: How often a wait looks at the abort word.
_SLICE_S = 0.01


def open_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store, listening on ``host:port`` only (0 picks a free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise TransferError(
            f"cannot listen on {host}:{port} for the broadcast rendezvous store ({exc}); "
            "the address must be one of this host's own"
        ) from exc
    bound = int(sock.getsockname()[1])
    # The store owns the descriptor from here on (it closes it with its server).
    return dist.TCPStore(
        host,
        bound,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
        use_libuv=True,
    )


class _GlooWork:
    def __init__(self, work: dist.Work, rank: int, timeout_s: float, aborted: Callable[[], str | None]) -> None:
        self._work = work
        self._rank = rank
        self._timeout_s = timeout_s
        self._aborted = aborted

    def wait(self, deadline: float) -> None:
        """Poll until the operation completed, a peer wrote the abort word or the store's host
        is gone (looked at every 10 ms), or ``deadline``. Polling, not a wait with a timeout: a gloo work's timed wait
        is not safe to give up on and repeat."""
        spins = 0
        delay = 10e-6
        next_check = time.monotonic() + _SLICE_S
        while not self._work.is_completed():
            spins += 1
            if spins <= 1000:
                continue
            now = time.monotonic()
            if now >= deadline:
                raise TransferTimeout(
                    f"rank {self._rank}: gloo collective did not complete within {self._timeout_s:.1f}s; "
                    "a peer is dead or stuck (raise timeout_s for slow links)"
                )
            if now >= next_check:
                next_check = now + _SLICE_S
                why = self._aborted()
                if why is not None:
                    raise TransferError(f"rank {self._rank}: {why}; stopped waiting")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        try:
            self._work.wait()
        except RuntimeError as exc:
            self._failed(exc, deadline)

    def _failed(self, exc: RuntimeError, deadline: float) -> None:
        # A deadline that has passed tells a timeout from a peer that left; the text of
        # gloo's message is not read.
        if time.monotonic() >= deadline - 0.01:
            raise TransferTimeout(
                f"rank {self._rank}: gloo collective did not complete within "
                f"{self._timeout_s:.1f}s; a peer is dead or stuck (raise timeout_s for "
                f"slow links): {exc}"
            ) from exc
        raise TransferError(
            f"rank {self._rank}: gloo collective failed, a peer left the group or crashed: {exc}"
        ) from exc


class GlooCommunicator:
    """One rank of a standalone gloo group.

    Construction blocks until every rank has joined (gloo connects a full mesh), so all
    ranks must construct it at the same time, within ``timeout_s``.
    """

    def __init__(
        self,
        store_host: str,
        store_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        timeout_s: float,
        bind_host: str = "127.0.0.1",
        store: dist.TCPStore | None = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cpu")
        timeout = datetime.timedelta(seconds=timeout_s)
        self._timeout_s = timeout_s
        if store is None:
            store = dist.TCPStore(
                store_host,
                store_port,
                world_size,
                is_master=False,
                timeout=timeout,
                use_libuv=True,
            )
        self._store = store
        self._flags = dist.PrefixStore(f"{group_name}/flags", store)
        self._store_gone = False
        self._aborted_by: int | None = None
        self._probe: threading.Thread | None = None
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        self._pg: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
            dist.PrefixStore(group_name, store), rank, world_size, options
        )

    def _group(self) -> dist.ProcessGroupGloo:
        if self._pg is None:
            raise WeightSyncError(f"rank {self.rank}: the gloo group was closed or aborted; run setup() again")
        return self._pg

    def stopped_by(self) -> str | None:
        """Why this group's operations should stop, as last seen: a rank wrote the abort
        word, or the store stopped answering (its host, rank 0, is gone); None while neither.
        Never blocks: the store is asked on a thread of its own, one question at a time, so
        a store whose host is frozen cannot hold a wait past its deadline."""
        if self._aborted_by is not None:
            return f"rank {self._aborted_by} of the gloo group failed and aborted it"
        if self._store_gone:
            return "rank 0 of the gloo group is gone (the group's store, which its process hosts, stopped answering)"
        probe = self._probe
        if probe is None or not probe.is_alive():
            self._probe = threading.Thread(target=self._look, name=f"weightsync-gloo-probe-{self.rank}", daemon=True)
            self._probe.start()
        return None

    def _look(self) -> None:
        try:
            if self._flags.check([_ABORT_KEY]):
                self._aborted_by = int(self._flags.get(_ABORT_KEY))
        except Exception as exc:  # noqa: BLE001 - the store's host died; stop asking it
            log.debug("weightsync: rank %d: the group's store stopped answering: %s", self.rank, exc)
            self._store_gone = True

    def _work(self, work: dist.Work) -> _GlooWork:
        return _GlooWork(work, self.rank, self._timeout_s, self.stopped_by)

    def agree(self, refuse: bool, deadline: float) -> list[int]:
        flags = torch.zeros(self.world_size, dtype=torch.int64)
        if refuse:
            flags[self.rank] = 1
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        opts.timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        self._work(self._group().allreduce([flags], opts)).wait(deadline)  # type: ignore[attr-defined]
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]

    def broadcast(self, tensor: torch.Tensor, src: int, stream_pointer: int = 0) -> _GlooWork:
        self._group()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.timeout = datetime.timedelta(seconds=self._timeout_s)
        return self._work(self._group().broadcast([tensor], opts))  # type: ignore[attr-defined]

    def abort(self) -> None:
        """Write the abort word (every peer's wait sees it within a slice) and drop the group
        on a background thread: once it is destroyed its sockets close too, but destroying it
        waits for its own pending operations, which must not hold this caller."""
        pg, self._pg = self._pg, None
        if pg is None:
            return
        if not self._store_gone:
            # On a thread of its own: a store whose host is frozen must not hold the abort.
            threading.Thread(target=self._tell, name=f"weightsync-gloo-tell-{self.rank}", daemon=True).start()
        # Not a daemon: the interpreter waits for it at exit (a group destroyed while Python
        # finalizes aborts the process), at most gloo's timeout, as a synchronous drop would.
        threading.Thread(target=_release, args=(pg,), name=f"weightsync-gloo-abort-{self.rank}").start()

    def _tell(self) -> None:
        try:
            self._flags.set(_ABORT_KEY, str(self.rank))
        except Exception as exc:  # noqa: BLE001 - the store's host died; its sockets tell the peers
            log.debug("weightsync: rank %d could not write the abort word: %s", self.rank, exc)

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.shutdown()


def _release(pg: dist.ProcessGroupGloo) -> None:
    """Abort and drop ``pg``; its sockets close once it and its works are gone."""
    pg.abort()
    del pg
    gc.collect()
