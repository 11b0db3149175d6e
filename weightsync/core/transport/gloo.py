"""A gloo :class:`~weightsync.core.transport.broadcast.Communicator` for CPU tensors.

The group is standalone: a ``ProcessGroupGloo`` over a ``PrefixStore`` of its own
``TCPStore``, never the default ``torch.distributed`` group, which a real trainer (FSDP,
Megatron) already owns. Rank 0 opens the store first (:func:`open_store`, port 0 picks a
free one) and the coordinator hands its address to the other ranks.

The store listens on the one address it is given, never on every interface: torch's
``TCPStore`` server ignores its host argument and binds ``*:port`` (both IPv4 and IPv6), so
:func:`open_store` binds and listens on a socket of its own and hands it over
(``master_listen_fd``). The store has no authentication: whoever can reach the address can
read and write keys, so the callers keep their keys under an unguessable prefix.
"""

from __future__ import annotations

import datetime
import gc
import socket
import time

import torch
import torch.distributed as dist

from weightsync.core.wire.errors import TransferError, TransferTimeout, WeightSyncError


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
    def __init__(self, work: dist.Work, rank: int, timeout_s: float) -> None:
        self._work = work
        self._rank = rank
        self._timeout_s = timeout_s

    def wait(self, deadline: float) -> None:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            self._work.wait(datetime.timedelta(seconds=left))
        except RuntimeError as exc:
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

    def agree(self, refuse: bool, deadline: float) -> list[int]:
        flags = torch.zeros(self.world_size, dtype=torch.int64)
        if refuse:
            flags[self.rank] = 1
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        opts.timeout = datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        _GlooWork(self._group().allreduce([flags], opts), self.rank, self._timeout_s).wait(deadline)  # type: ignore[attr-defined]
        return [rank for rank, flag in enumerate(flags.tolist()) if flag]

    def broadcast(self, tensor: torch.Tensor, src: int, stream_pointer: int = 0) -> _GlooWork:
        self._group()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.timeout = datetime.timedelta(seconds=self._timeout_s)
        return _GlooWork(self._group().broadcast([tensor], opts), self.rank, self._timeout_s)  # type: ignore[attr-defined]

    def abort(self) -> None:
        """Drop the group: once its last reference (and its works') is gone, its sockets close
        and every peer's pending operation fails at once ("connection closed by peer")."""
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.abort()
            del pg
            gc.collect()

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            pg.shutdown()
