"""A sharded trainer rank as the sync source: DTensor shards gathered bucket by bucket.

Each rank of an FSDP2 (or any DTensor) trainer holds a slice of every parameter. The
manifest is the full model (global shapes, wire dtypes); at each sync every rank walks the
tensors in manifest order and gathers one *bucket* (consecutive tensors holding at most
``buffer_bytes`` of the trainer's bytes, or one larger tensor) at a time, with the DTensors'
own mesh; the bucket is dropped before the next one is gathered. So no rank holds more
than about one bucket of gathered tensors beyond its shards, whatever the model's size.

Every rank must issue the same collectives in the same order, even when the ranks drive
different transports (rank 0 broadcasts to remote workers, each rank writes its own
colocated workers, a rank may have no worker at all). The rule, per sync::

    checks          the model still matches the manifest (else: refused)
    agreement       one all-reduce (MAX) of [walks this rank needs, refused]: every rank
                    learns the sync's number of walks W, or that a rank refused (all stop)
    W walks         each a pass over every bucket in order; the rank's halves consume
                    walks as they read ``sources.tensors[i]`` (direct, ipc, broadcast in
                    turn, one or more walks each), and the rank finishes with blank walks
                    (gather, drop) up to W, also after a failure of its own halves, so no
                    peer is left inside a gather

A walk a half needs is one pass in manifest order; each half says how many it makes
(``SendHalf.walks``): broadcast and ipc one each, direct one per direct worker written;
with ``verify`` the sender first makes one more, for the checksum of every tensor (what
each worker's destination is compared with, against rank 0's: a replicated tensor that
differs between ranks is caught there, naming it).

Waits: the agreement and the common gathers (``Shard(0)`` on a 1-D mesh, as FSDP2 lays
out, and ``Replicate``) are issued as async collectives and waited with the sync's
deadline, so a stalled rank ends the sync on its peers within the timeout (a
:class:`TransferTimeout` naming the other ranks; the coordinator's own deadline names the
rank that never answered). Other layouts go through ``full_tensor()``, bounded only by the
user's group timeout. A rank that dies closes its gloo sockets, and its peers' gathers fail
at once. After a failed or timed-out gather the user's group is in an unknown state (a
collective may still be pending on it): treat it as torch treats any collective failure and
rebuild it before training on; the rank actors, their model shards and optimizer state are
untouched.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from weightsync.core.packing import read_checksums, word_sum
from weightsync.core.sender import WeightSender
from weightsync.core.transport.base import Sources, shed_traceback
from weightsync.core.wire.errors import (
    ModelChangedError,
    PeerAborted,
    SettingsError,
    TransferError,
    TransferTimeout,
    WeightSyncError,
)
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import SendResult, SourceLayout, SyncCall
from weightsync.core.wire.settings import SyncSettings
from weightsync.core.wire.sizing import BufferHints


def plan_buckets(nbytes: Sequence[int], budget: int) -> list[range]:
    """Consecutive tensor indices holding at most ``budget`` bytes each (or one larger tensor)."""
    buckets: list[range] = []
    start, size = 0, 0
    for index, n in enumerate(nbytes):
        if index > start and size + n > budget:
            buckets.append(range(start, index))
            start, size = index, 0
        size += n
    if nbytes:
        buckets.append(range(start, len(nbytes)))
    return buckets


def has_dtensors(module: torch.nn.Module) -> bool:
    return any(isinstance(t, DTensor) for t in (*module.parameters(), *module.buffers()))


def _fast(t: DTensor) -> bool:
    return t.device_mesh.ndim == 1 and tuple(t.placements) in ((Shard(0),), (Replicate(),))


class _Wait:
    """Waits on async collectives with one deadline; names what it waited for when it fails."""

    def __init__(self, until: float, name: str, peers: Sequence[str]) -> None:
        self.until, self.name, self.peers = until, name, tuple(peers)

    def __call__(self, work: Any, what: str) -> None:
        left = max(0.001, self.until - time.monotonic())
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))
        except Exception as exc:
            if not work.is_completed():
                raise TransferTimeout(
                    f"{self.name}: {what} did not complete by the sync's deadline: a trainer rank "
                    f"({', '.join(self.peers)}) is stalled or not in this sync; the trainer's process "
                    "group now holds a pending collective: rebuild it before training on",
                    blames=self.peers,
                ) from exc
            raise TransferError(
                f"{self.name}: {what} failed on the trainer's process group ({type(exc).__name__}: "
                f"{str(exc)[:300]}): a trainer rank ({', '.join(self.peers)}) failed or died",
                blames=self.peers,
            ) from exc


class GatheredTensors(Sequence[torch.Tensor]):
    """``sources.tensors`` of a sharded rank: full tensors, gathered as they are read.

    Reading index ``i`` gathers (in order, on every rank) each bucket up to the one holding
    ``i``; reading an earlier index ends the walk (gathering its remaining buckets) and
    starts the next. :meth:`finish` completes the agreed number of walks. Only the current
    bucket is held.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        buckets: Sequence[range],
        walks: int,
        wait: _Wait,
        on_bucket: Callable[[int], None] | None = None,
    ) -> None:
        self._tensors = tensors
        self._buckets = buckets
        self._bucket_of = [b for b, r in enumerate(buckets) for _ in r]
        self.walks = walks
        self.started = 0
        self._current: int | None = None  # bucket of the walk in progress, None: no walk
        self._held: dict[int, torch.Tensor] = {}
        self._wait = wait
        self._on_bucket = on_bucket
        self.broken = False
        self.gathered = 0  # buckets gathered this sync
        self.peak_bytes = 0  # most bytes of gathered tensors held at once

    def __len__(self) -> int:
        return len(self._tensors)

    @overload
    def __getitem__(self, index: int) -> torch.Tensor: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[torch.Tensor]: ...
    def __getitem__(self, index: int | slice) -> torch.Tensor | Sequence[torch.Tensor]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        bucket = self._bucket_of[index]
        if self._current is not None and bucket < self._current:
            self._end_walk()
        if self._current is None:
            if self.started >= self.walks:
                raise WeightSyncError(
                    f"{self._wait.name}: a transport read the tensors more often than the {self.walks} "
                    "walk(s) the ranks agreed on (a weightsync bug: report it)"
                )
            self.started += 1
            self._current = -1
        while self._current < bucket:
            self._current += 1
            self._gather(self._current)
        return self._held[index]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    def _end_walk(self) -> None:
        assert self._current is not None
        while self._current < len(self._buckets) - 1:
            self._current += 1
            self._gather(self._current)
        self._current = None
        self._release()

    def finish(self) -> None:
        """Complete the walk in progress and blank walks up to the agreed number; a no-op
        once a gather failed (the group cannot gather any more)."""
        try:
            if self.broken:
                return
            if self._current is not None:
                self._end_walk()
            while self.started < self.walks:
                self.started += 1
                self._current = -1
                self._end_walk()
        finally:
            self._release()

    def _release(self) -> None:
        if any(t.is_cuda for t in self._held.values()):
            # The packing streams may still read them; their memory must not be reused first.
            torch.cuda.synchronize()
        self._held = {}

    def _gather(self, bucket: int) -> None:
        self._release()
        if self.broken:
            raise WeightSyncError(f"{self._wait.name}: an earlier gather of this sync failed")
        try:
            self._held = gather_bucket(self._tensors, self._buckets[bucket], self._wait)
        except BaseException:
            self.broken = True
            raise
        self.gathered += 1
        held = sum(t.untyped_storage().nbytes() for t in self._held.values())
        self.peak_bytes = max(self.peak_bytes, held)
        if self._on_bucket is not None:
            self._on_bucket(bucket)


def gather_bucket(tensors: Sequence[torch.Tensor], indices: range, wait: _Wait) -> dict[int, torch.Tensor]:
    """The full tensors of ``indices``: plain tensors as they are, DTensors gathered.

    ``Shard(0)`` tensors of a 1-D mesh are padded to equal chunks (torch.chunk's split, as
    DTensor and FSDP2 use) and all-gathered asynchronously, all of the bucket's at once,
    then waited for; other layouts go through ``full_tensor()`` in the same order.
    """
    out: dict[int, torch.Tensor] = {}
    pending: list[tuple[int, Any, torch.Tensor, int]] = []
    with torch.no_grad():
        for i in indices:
            t = tensors[i]
            if not isinstance(t, DTensor):
                out[i] = t.detach()
            elif not _fast(t):
                out[i] = t.full_tensor()
            elif t.placements[0] == Replicate():
                out[i] = t.to_local().detach()
            else:
                n = t.shape[0]
                mesh = t.device_mesh
                world = mesh.size(0)
                rows = -(-n // world)
                local = t.to_local()
                if n == 0 or rows == 0:
                    out[i] = local.new_empty(t.shape)
                    continue
                piece = local.new_zeros((rows, *t.shape[1:]))
                piece[: local.shape[0]].copy_(local)
                full = local.new_empty((world * rows, *t.shape[1:]))
                work = dist.all_gather_into_tensor(full, piece, group=mesh.get_group(0), async_op=True)
                pending.append((i, work, full, n))
        for i, work, full, n in pending:
            wait(work, f"gathering tensor {i} from the trainer's ranks")
            out[i] = full[:n]
        if pending and pending[0][2].is_cuda:
            # gloo stages CUDA tensors through host memory and orders its copy back only
            # before the current stream; the packing streams read the bucket too.
            torch.cuda.current_stream(pending[0][2].device).synchronize()
    return dict(sorted(out.items()))


@dataclass
class ShardedSender(WeightSender):
    """One rank of a sharded trainer: the manifest of the full model, sends from gathers.

    Call order per session is :class:`WeightSender`'s, plus :meth:`bind` (the coordinator's
    names of every rank, in rank order) before the manifest. ``on_bucket(index)``, when set,
    is called after each bucket is gathered (progress hooks, fault injection in tests).
    """

    ranks: tuple[str, ...] = ()
    on_bucket: Callable[[int], None] | None = None
    last_walk: GatheredTensors | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transform is not None or self.source is not None:
            raise SettingsError(f"{self.name}: a sharded trainer sends its module's tensors; no transform or source")
        self._buckets: list[range] = []

    def _dtensors(self) -> list[DTensor]:
        return [t for _, t in self.named_tensors() if isinstance(t, DTensor)]

    def bind(self, name: str, ranks: Sequence[str]) -> None:
        """Take this rank's party name; refuse a list of ranks not in the mesh's rank order."""
        self.name, self.ranks = name, tuple(ranks)
        group = self._group()
        if group is None:
            return
        world, me = dist.get_world_size(group), dist.get_rank(group)
        if world != len(self.ranks) or self.ranks[me] != name:
            raise SettingsError(
                f"{name}: its model is sharded over {world} rank(s) and it is rank {me} of them, but "
                f"WeightSync was given {len(self.ranks)} rank(s) with it at position "
                f"{self.ranks.index(name) if name in self.ranks else '?'}: pass every rank, in rank order"
            )

    def _group(self) -> Any:
        found = self._dtensors()
        if not found:
            return None
        mesh = found[0].device_mesh
        return mesh.get_group(0) if mesh.ndim == 1 else dist.group.WORLD

    def layout(self) -> SourceLayout:
        group = self._group()
        return SourceLayout(sharded=True, mesh_size=dist.get_world_size(group), mesh_rank=dist.get_rank(group))

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(r for r in self.ranks if r != self.name)

    def manifest(self, settings: SyncSettings, hints: BufferHints | None = None, owner: str = "") -> Manifest:
        manifest = super().manifest(settings, hints, owner)
        sizes = [t.numel() * t.element_size() for _, t in self.named_tensors()]
        self._buckets = plan_buckets(sizes, manifest.agreed.buffer_bytes)
        return manifest

    def checked_sources(self) -> Sources:
        """This sync's tensors (DTensors as they are, not gathered), checked against the manifest."""
        manifest = self.current_manifest
        pairs = self.named_tensors()
        problems = self._changes(manifest, pairs)
        if problems:
            raise ModelChangedError(
                f"{self.name}: the model changed since setup (nothing was sent): {'; '.join(problems)}; "
                "run WeightSync.setup() again once every worker holds the same model"
            )
        return Sources([t for _, t in pairs], None)

    def _agree(self, walks: int, refused: bool, wait: _Wait) -> int:
        """Every rank's [walks, refused] reduced with MAX; raises if another rank refused."""
        group = self._group()
        if group is None:
            return walks
        device = self._dtensors()[0].to_local().device
        flags = torch.tensor([walks, int(refused)], dtype=torch.int64, device=device)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
        wait(work, "the sync's agreement between the trainer's ranks")
        agreed, anyone_refused = (int(v) for v in flags.tolist())
        if anyone_refused and not refused:
            raise PeerAborted(
                f"{self.name}: another trainer rank refused this sync before any byte moved", blames=self.peers
            )
        return agreed

    def _walk(self, sources: Sources, walks: int, start: float) -> GatheredTensors:
        wait = _Wait(self.session.deadlines.follower(start), self.name, self.peers)
        agreed = self._agree(walks, False, wait)
        gathered = GatheredTensors(sources.tensors, self._buckets, agreed, wait, self.on_bucket)
        self.last_walk = gathered
        return gathered

    def send(self, call: SyncCall) -> SendResult:
        """This rank's side of one sync; every rank of the trainer runs it at the same time."""
        began = time.monotonic()
        start = time.perf_counter()
        deadline = self.session.deadlines.leader(began)
        call = self.resolve(call)
        checksums: dict[str, list[int]] = {}
        stale: tuple[str, ...] = ()
        failure: BaseException | None = None
        gathered: GatheredTensors | None = None
        streamed: Sources | None = None
        try:
            self.start_halves(call)
            try:
                sources = self.checked_sources()
            except ModelChangedError:
                self._agree(0, True, _Wait(self.session.deadlines.follower(began), self.name, self.peers))
                raise
            gathered = self._walk(sources, self.walks(call), began)
            streamed = Sources(gathered, None, streamed=True)
            checksums, stale = self.drive(streamed, call, deadline)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the peers know
            failure = shed_traceback(exc)
        if gathered is not None:
            try:
                gathered.finish()
            except BaseException as exc:  # noqa: BLE001 - the first failure is the one raised
                failure = failure or shed_traceback(exc)
        if failure is not None:
            self.abort_halves(call)
            raise failure
        sums = streamed.checksums if streamed is not None and streamed.checksums else []
        return SendResult(checksums=checksums, stale=stale, seconds=time.perf_counter() - start, tensor_checksums=sums)

    def checksums(self) -> list[int]:
        """Per tensor, the checksum of the full tensor as it travels (every rank calls it)."""
        manifest = self.current_manifest
        sources = self.checked_sources()
        gathered = self._walk(sources, 1, time.monotonic())
        try:
            with torch.no_grad():
                return read_checksums([word_sum(gathered[i].to(s.torch_dtype)) for i, s in enumerate(manifest.specs)])
        finally:
            gathered.finish()
