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

    checks          the model still matches the manifest, each rank's own shards included
                    (their local shapes and offsets as at setup); else: refused
    agreement       one all-reduce (MAX) of [walks this rank needs, refused, whose sync]:
                    every rank learns the sync's number of walks W, that a rank refused,
                    or that the ranks run syncs of different WeightSyncs (all stop)
    W walks         each a pass over every bucket in order; the rank's halves consume
                    walks as they read ``sources.tensors[i]`` (direct, ipc, broadcast in
                    turn, one or more walks each), and the rank finishes with blank walks
                    (gather, drop) up to W, also after a failure of its own halves, so no
                    peer is left inside a gather

A walk a half needs is one pass in manifest order; each half says how many it makes
(``SendHalf.walks``): broadcast, ipc and direct one each (direct writes every worker of
the rank from the same pass, and rides the pass of broadcast or ipc when the rank drives
one of them too: :mod:`weightsync.core.riders`), owner sends and owner writes
none (each rank sends from its own shards); with
``verify`` the sender first makes one more, for the checksum of every tensor (what each
worker's destination is compared with, against rank 0's: a replicated tensor that differs
between ranks is caught there, naming it), which the halves reuse.

Several WeightSyncs may share the ranks, each with its own session (its ``owner``), but
their syncs take turns: one WeightSync's sync on rank 0 met by another's on rank 1 would
pair their collectives on the trainer's group. The agreement carries a hash of the owner
(its largest and, negated, its smallest value), so ranks that find themselves in different
WeightSyncs' syncs all refuse there, before any byte moves, leaving the group intact
(:class:`~weightsync.core.wire.errors.ConcurrentSyncError`, naming both).

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

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from weightsync.core.dtensors import is_dtensor
from weightsync.core.gathering import GatheredTensors, Wait, plan_buckets
from weightsync.core.halves import Sources, shed_traceback
from weightsync.core.owned_plan import OwnedLayout, layout_of
from weightsync.core.packing import read_checksums, word_sum
from weightsync.core.sender import WeightSender
from weightsync.core.wire.errors import (
    ConcurrentSyncError,
    ModelChangedError,
    PeerAborted,
    SettingsError,
)
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import SendResult, SourceLayout, SyncCall
from weightsync.core.wire.settings import SyncSettings
from weightsync.core.wire.sizing import BufferHints

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def has_dtensors(module: torch.nn.Module) -> bool:
    """True when ``module`` holds DTensors: its sender is a :class:`ShardedSender`."""
    return any(is_dtensor(t) for t in (*module.parameters(), *module.buffers()))


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
    #: The labels of every coordinator with a session on this rank (to name the other one
    #: when the ranks are found in different coordinators' syncs).
    known_owners: Callable[[], Sequence[str]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transform is not None or self.source is not None:
            raise SettingsError(f"{self.name}: a sharded trainer sends its module's tensors; no transform or source")
        self._buckets: list[range] = []
        #: Per manifest tensor, this rank's shard of it as set up (None: a plain tensor).
        self._shards: list[LocalShard | None] = []

    def _dtensors(self) -> list[DTensor]:
        return [t for _, t in self.named_tensors() if is_dtensor(t)]

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

    def owned_layout(self) -> OwnedLayout:
        """What owner sends need of this rank's tensors (:func:`~weightsync.core.owned_plan.layout_of`)."""
        group = self._group()
        return layout_of(self.name, self.named_tensors(), dist.get_world_size(group), dist.get_rank(group))

    def shards(self) -> str:
        """``"owned"`` when every rank can send what it holds (:meth:`owned_layout`), else ``"other"``."""
        try:
            self.owned_layout()
        except SettingsError:
            return "other"
        return "owned"

    def manifest(self, settings: SyncSettings, hints: BufferHints | None = None, owner: str = "") -> Manifest:
        manifest = super().manifest(settings, hints, owner)
        pairs = self.named_tensors()
        sizes = [t.numel() * t.element_size() for _, t in pairs]
        budget = settings.gather_bytes if settings.gather_bytes is not None else manifest.agreed.buffer_bytes
        self._buckets = plan_buckets(sizes, budget)
        self._shards = [LocalShard.of(t) for _, t in pairs]
        return manifest

    def _changes(self, manifest: Manifest, pairs: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
        """Also each shard this rank holds: a local shape or offset that moved since setup
        (a shard replaced under an unchanged global shape) would send, or gather, rows the
        workers' plan does not describe."""
        problems = super()._changes(manifest, pairs)
        if problems or len(self._shards) != len(pairs):
            return problems
        with torch.no_grad():  # to_local() outside autograd costs a third
            moved = [
                (name, tensor, then)
                for (name, tensor), then in zip(pairs, self._shards)
                if not (then.holds(tensor) if then is not None else not is_dtensor(tensor))
            ]
        for name, tensor, then in moved:
            now = LocalShard.of(tensor)
            was = then.describe() if then is not None else "a plain tensor"
            problems.append(
                f"{name}'s part on this rank is now {now.describe() if now is not None else 'a plain tensor'}, was {was}"
            )
        return problems

    def checked_sources(self) -> Sources:
        """This sync's tensors (DTensors as they are, not gathered), checked against the manifest."""
        return Sources([t for _, t in self.checked_pairs(self.current_manifest)], None)

    def _agree(self, walks: int, refused: bool, wait: Wait) -> int:
        """Every rank's [walks, refused, owner hash, -owner hash] reduced with MAX; raises if
        the ranks run different coordinators' syncs, or if another rank refused."""
        group = self._group()
        if group is None:
            return walks
        device = self._dtensors()[0].to_local().device
        mine = owner_hash(self.owner)
        flags = torch.tensor([walks, int(refused), mine, -mine], dtype=torch.int64, device=device)
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, async_op=True)
        wait(work, "the sync's agreement between the trainer's ranks")
        agreed, anyone_refused, highest, lowest = (int(v) for v in flags.tolist())
        if highest != -lowest:
            other = highest if highest != mine else -lowest
            labels = {owner_hash(o): o for o in (self.known_owners() if self.known_owners is not None else ())}
            raise ConcurrentSyncError(
                f"{self.name}: the trainer's ranks are running syncs of different WeightSyncs at once (this rank: "
                f"{self.owner or 'an unlabelled one'}; another rank: {labels.get(other, 'another WeightSync')}), so "
                "every rank refused before any byte moved. Its ranks gather on the trainer's own process group one "
                "sync at a time: sync the WeightSyncs of one sharded trainer one after the other"
            )
        if anyone_refused and not refused:
            raise PeerAborted(
                f"{self.name}: another trainer rank refused this sync before any byte moved", blames=self.peers
            )
        return agreed

    def _walk(self, sources: Sources, walks: int, start: float) -> GatheredTensors:
        wait = Wait(self.session.deadlines.follower(start), self.name, self.peers)
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
                self._agree(0, True, Wait(self.session.deadlines.follower(began), self.name, self.peers))
                raise
            gathered = self._walk(sources, self.walks(call), began)
            streamed = Sources(gathered, None, streamed=True, local=sources.tensors)
            checksums, stale = self.drive(streamed, call, deadline)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the peers know
            failure = shed_traceback(exc)
        if gathered is not None:
            try:
                gathered.finish()
            except BaseException as exc:  # noqa: BLE001 - the first failure is the one raised
                failure = failure or shed_traceback(exc)
        if failure is not None:
            self.abort_halves(call, failure)
            raise failure
        sums = streamed.checksums if streamed is not None and streamed.checksums else []
        return SendResult(
            checksums=checksums,
            stale=stale,
            seconds=time.perf_counter() - start,
            tensor_checksums=sums,
            sent_bytes=self.sent_bytes(call),
        )

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


def owner_hash(owner: str) -> int:
    """A coordinator's label as a non-negative int below 2**56, the same in every process."""
    return int.from_bytes(hashlib.blake2b(owner.encode(), digest_size=7).digest(), "big")


@dataclass(frozen=True)
class LocalShard:
    """What one rank holds of one DTensor: its local shape, where its shard starts in the
    global tensor, and the placements and mesh that put it there."""

    shape: tuple[int, ...]
    offset: tuple[int, ...]
    placements: tuple[Any, ...]
    mesh: Any

    @classmethod
    def of(cls, tensor: torch.Tensor) -> LocalShard | None:
        """``tensor``'s shard on this rank; None for a plain tensor."""
        if not is_dtensor(tensor):
            return None
        placements = tuple(tensor.placements)
        return cls(tuple(tensor.to_local().shape), _offset(tensor), placements, tensor.device_mesh)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is still laid out so on this rank (the offset follows from the
        global shape, checked on its own, the placements and the mesh)."""
        if not is_dtensor(tensor):
            return False
        return (
            tuple(tensor.to_local().shape) == self.shape
            and tuple(tensor.placements) == self.placements
            and (tensor.device_mesh is self.mesh or tensor.device_mesh == self.mesh)
        )

    def describe(self) -> str:
        at = f" at offset {list(self.offset)}" if self.offset else ""
        return f"a shard of {list(self.shape)}{at} ({', '.join(map(str, self.placements))})"


def _offset(tensor: DTensor) -> tuple[int, ...]:
    """Where this rank's shard of ``tensor`` starts in the global tensor, as its placements
    put it (torch's own rule; () on a torch without it: the message then gives shapes only)."""
    try:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:
        return ()
    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tuple(tensor.placements))
    return tuple(int(o) for o in offset)
