"""The trainer as a list of ranks: names, which rank serves which worker, per-rank calls.

``WeightSync(trainer=[rank0, rank1, ...])`` takes the ranks of one sharded trainer in rank
order; a single handle is a trainer of one process (party ``"trainer"``, as before). Ranks
are parties named ``trainer-rank-<i>``. Rank 0 serves every worker of a transport served by
the lead (``Serving.LEAD``: broadcast, whose group rank 0 forms); a worker of a colocated
transport (``Serving.NEAREST``: ipc, direct) is served by one rank, the one it shares a
device with:

- ``worker_ranks={"worker-0": 1, ...}`` names it explicitly;
- by default, the lowest rank on the worker's device (its GPU; on CPU, its node), and
  rank 0 for a worker colocated with no rank.

Each rank is told only its own workers in its :class:`SyncCall` (:meth:`TrainerRanks.call_for`);
all ranks run every sync together (they gather together: :mod:`weightsync.core.sharded`).

:class:`RankSpec` is the rendezvous a rank's model factory uses to join the user's process
group (``TrainerActor.remote(factory, rank=spec)`` sets the usual ``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` before the factory runs).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from weightsync.core import registry
from weightsync.core.choice import choose_transport
from weightsync.core.placement import same_device
from weightsync.core.plugin import Serving
from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import EndpointInfo, SourceLayout, SyncCall
from weightsync.core.wire.outcome import Outcome, failed
from weightsync.core.wire.session import TRAINER_PARTY
from weightsync.glue.protocol import check_party
from weightsync.mechanisms.ports import free_port

RANK_PREFIX = "trainer-rank-"


def reserved(name: str) -> bool:
    """True for the names of trainer parties, which no worker may take."""
    return name == TRAINER_PARTY or name.startswith(RANK_PREFIX)


@dataclass(frozen=True)
class RankSpec:
    """Where rank ``rank`` of ``world_size`` meets the others (torch's ``env://`` rendezvous)."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    local_rank: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.world_size, int) and self.world_size >= 1):
            raise SettingsError(f"world_size must be a positive int, got {self.world_size!r}")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise SettingsError(f"rank must be an int in [0, {self.world_size}), got {self.rank!r}")
        if not (isinstance(self.master_port, int) and 0 < self.master_port < 65536):
            raise SettingsError(f"master_port must be a TCP port, got {self.master_port!r}")

    def env(self) -> dict[str, str]:
        local = self.rank if self.local_rank is None else self.local_rank
        return {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(local),
        }

    @classmethod
    def group(cls, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 0) -> list[RankSpec]:
        """One spec per rank; port 0 picks a free port on this host (for ranks on this node),
        outside the range the kernel hands out by itself (:mod:`weightsync.mechanisms.ports`):
        rank 0 listens on it only once its process started."""
        if master_port == 0:
            master_port = free_port(master_addr)
        return [cls(r, world_size, master_addr, master_port) for r in range(world_size)]


class TrainerRanks:
    """The trainer's parties (one, or the ranks of a sharded trainer) and their handles."""

    def __init__(self, trainer: Any) -> None:
        if isinstance(trainer, (list, tuple)):
            if not trainer:
                raise SettingsError("trainer is an empty list: pass the trainer's ranks in rank order")
            self.handles = list(trainer)
            self.names = [f"{RANK_PREFIX}{i}" for i in range(len(self.handles))]
        else:
            self.handles, self.names = [trainer], [TRAINER_PARTY]
        for name, handle in zip(self.names, self.handles):
            check_party(handle, "trainer", "the trainer" if name == TRAINER_PARTY else name)
        ids = [identity(h) for h in self.handles]
        for i, ident in enumerate(ids):
            if ident in ids[:i]:
                raise SettingsError(f"{self.names[i]} is the same actor as {self.names[ids.index(ident)]}")
        self.sharded = isinstance(trainer, (list, tuple))
        self.ids = set(ids)

    @property
    def lead(self) -> str:
        return self.names[0]

    def parties(self) -> dict[str, Any]:
        return dict(zip(self.names, self.handles))

    def check_map(self, worker_ranks: Mapping[str, int] | None, workers: Sequence[str]) -> dict[str, int]:
        explicit = dict(worker_ranks or {})
        unknown = sorted(set(explicit) - set(workers))
        if unknown:
            raise SettingsError(f"worker_ranks names unknown worker(s) {unknown}; workers: {sorted(workers)}")
        for name, rank in explicit.items():
            if not (isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < len(self.names)):
                raise SettingsError(
                    f"worker_ranks[{name!r}] = {rank!r}: the trainer has ranks 0..{len(self.names) - 1}"
                )
        return explicit

    def choose(
        self,
        worker: str,
        info: EndpointInfo,
        requested: str,
        infos: Sequence[EndpointInfo],
        explicit: Mapping[str, int],
    ) -> tuple[int, str]:
        """The rank serving ``worker`` (see the module doc) and its transport, chosen against
        that rank; a worker mapped to a rank other than 0 whose transport only the lead
        serves is refused."""
        if worker in explicit:
            rank = explicit[worker]
        else:
            near = [r for r, rank_info in enumerate(infos) if same_device(rank_info, info)]
            lead_only = requested != "auto" and registry.get(requested).serving is not Serving.NEAREST
            rank = near[0] if near and not lead_only else 0
        transport = choose_transport(infos[rank], info, requested, worker, infos)
        serving = registry.get(transport).serving
        if serving is Serving.EVERY:
            return 0, transport  # every rank serves it; rank 0 stands for them in its Session
        if serving is Serving.LEAD and rank != 0:
            raise SettingsError(
                f"{worker}: mapped to {self.names[rank]} by worker_ranks, but it needs transport {transport!r} (it "
                f"is not colocated with that rank, or asked for it), which only {self.lead} serves; map it to rank 0 "
                f"or place it with {self.names[rank]}"
            )
        return rank, transport

    def mixed_layouts(self, layouts: Mapping[str, SourceLayout]) -> dict[str, Outcome]:
        """A failed outcome per rank whose model is sharded while most ranks' are plain, or
        plain while most are sharded (a tie: those that differ from rank 0). The manifests
        of such ranks match (both describe the full model), but a plain rank never joins
        the sharded ranks' gathers: the first sync would hang to its deadline."""
        sharded = [n for n in self.names if layouts[n].sharded]
        plain = [n for n in self.names if not layouts[n].sharded]
        if not sharded or not plain:
            return {}
        lead_sharded = layouts[self.lead].sharded
        odd = plain if len(sharded) > len(plain) or (len(sharded) == len(plain) and lead_sharded) else sharded
        others = sharded if odd is plain else plain
        out: dict[str, Outcome] = {}
        for name in odd:
            mine = "holds DTensors (a sharded model)" if layouts[name].sharded else "holds no DTensors (a plain model)"
            theirs = "hold DTensors" if odd is plain else "hold plain tensors"
            why = (
                f"its model {mine}, while {', '.join(others)} {theirs}: every rank of one trainer must hold "
                "the same model, sharded the same way (did its model factory skip fully_shard?)"
            )
            out[name] = failed(name, "layout", SettingsError(why))
        return out

    def disagreeing(
        self, manifests: Mapping[str, Manifest], layouts: Mapping[str, SourceLayout] | None = None
    ) -> dict[str, Outcome]:
        """A failed outcome per rank whose model is sharded unlike the others' (``layouts``,
        see :meth:`mixed_layouts`) or whose manifest differs from the one most ranks hold,
        naming what differs. Rank 0 is blamed when it is the one that changed; when no
        manifest is held by more ranks than every other (two ranks that differ), every rank
        is named, each against another."""
        out = self.mixed_layouts(layouts) if layouts is not None else {}
        groups: list[list[str]] = []
        for name in self.names:
            for group in groups:
                if manifests[group[0]] == manifests[name]:
                    group.append(name)
                    break
            else:
                groups.append([name])
        if len(groups) == 1:
            return out
        sizes = sorted((len(g) for g in groups), reverse=True)
        majority = max(groups, key=len) if sizes[0] > sizes[1] else None
        for name in self.names:
            if majority is not None and name in majority:
                continue
            ref = (
                majority[0] if majority is not None else next(n for n in self.names if manifests[n] != manifests[name])
            )
            other, base = manifests[name], manifests[ref]
            if name in out:
                continue
            mine, theirs = {x.name: x for x in other.specs}, {x.name: x for x in base.specs}
            diff = [f"{n} only on {name}" for n in mine if n not in theirs]
            diff += [f"{n} missing on {name}" for n in theirs if n not in mine]
            diff += [
                f"{n}: {list(mine[n].shape)} {mine[n].dtype} vs {list(theirs[n].shape)} {theirs[n].dtype}"
                for n in mine
                if n in theirs and mine[n] != theirs[n]
            ]
            what = diff[0] if diff else "buffer settings"
            held = (
                f"as {len(majority)} of {len(self.names)} ranks hold it"
                if majority is not None
                else "and no model is held by more ranks than another: which one changed cannot be told"
            )
            why = f"its model differs from {ref}'s, {held} ({what}): every rank must hold the same model"
            out[name] = failed(name, "manifest", SettingsError(why))
        return out

    @staticmethod
    def call_for(call: SyncCall, mine: Iterable[str]) -> SyncCall:
        """``call`` for a rank serving the workers ``mine`` in this round: only the transports
        and workers it drives."""
        served = set(mine)
        targets = {kind: tuple(w for w in workers if w in served) for kind, workers in (call.targets or {}).items()}
        return replace(call, targets={kind: workers for kind, workers in targets.items() if workers})


def identity(handle: Any) -> object:
    actor_id = getattr(handle, "_actor_id", None)
    return actor_id.hex() if actor_id is not None else id(handle)
