"""Who takes part in a WeightSync: the trainer's parties and the named workers.

A :class:`Membership` holds every worker as a :class:`Member` (its handle, the transport
requested for it and, once set up, the one chosen, where it lives and the trainer rank
that serves it) next to the trainer's :class:`~weightsync.glue.ranks.TrainerRanks`.
Names are checked once, on the way in: non-empty, printable, no whitespace or ``/``, not a
trainer party's name, and no actor may be passed twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.core.choice import check_request
from weightsync.core.wire.casts import TensorCast
from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.messages import EndpointInfo
from weightsync.glue.protocol import check_party
from weightsync.glue.ranks import TrainerRanks, identity, reserved


@dataclass
class Member:
    """One worker of the WeightSync."""

    name: str
    handle: Any
    requested: str
    #: Chosen at setup: the transport, where the worker lives, the trainer rank serving it.
    transport: str = ""
    info: EndpointInfo | None = None
    rank: int = 0
    #: Accepted in the handshake: the tensors its sink casts on load.
    casts: tuple[TensorCast, ...] = ()


def check_name(name: object) -> str:
    if not isinstance(name, str) or not name or reserved(name) or "/" in name:
        raise SettingsError(
            f"worker name {name!r} cannot be used: names are non-empty strings, not 'trainer' or "
            "'trainer-rank-<i>', without '/'"
        )
    if not name.isprintable() or any(c.isspace() for c in name):
        raise SettingsError(f"worker name {name!r} cannot be used: it holds whitespace or control characters")
    return name


class Membership:
    """The trainer's parties and the workers, by name."""

    def __init__(
        self,
        ranks: TrainerRanks,
        workers: Sequence[Any] | Mapping[str, Any],
        transport: str | Mapping[str, str],
    ) -> None:
        self.ranks = ranks
        named = dict(workers) if isinstance(workers, Mapping) else {f"worker-{i}": w for i, w in enumerate(workers)}
        if not named:
            raise SettingsError("WeightSync needs at least one worker")
        if isinstance(transport, Mapping):
            unknown = sorted(set(transport) - set(named))
            if unknown:
                raise SettingsError(f"transport names unknown worker(s) {unknown}; workers: {sorted(named)}")
        self._transport = transport
        self.members: dict[str, Member] = {}
        for name, handle in named.items():
            self.add(name, handle)

    def add(self, name: str | None, handle: Any) -> str:
        """Add a worker (``name`` None: a fresh ``worker-<hex>``); returns its name."""
        name = check_name(f"worker-{uuid.uuid4().hex[:6]}" if name is None else name)
        if name in self.members:
            raise SettingsError(f"a worker named {name!r} is already registered")
        check_party(handle, "worker", f"worker {name!r}")
        mine = identity(handle)
        for other in self.members.values():
            if identity(other.handle) == mine:
                raise SettingsError(f"workers {other.name!r} and {name!r} are the same actor; pass each worker once")
        if mine in self.ranks.ids:
            raise SettingsError(f"worker {name!r} is the trainer's own actor")
        t = self._transport
        requested = check_request(t.get(name, "auto") if isinstance(t, Mapping) else t, name)
        self.members[name] = Member(name, handle, requested)
        return name

    def remove(self, name: str) -> None:
        if name not in self.members:
            raise KeyError(f"no worker named {name!r}; known: {sorted(self.members)}")
        del self.members[name]

    def drop(self, parties: Iterable[str]) -> list[str]:
        """Remove the workers among ``parties`` (their actors died); the names removed."""
        gone = [p for p in parties if p in self.members]
        for name in gone:
            del self.members[name]
        return gone

    @property
    def workers(self) -> dict[str, Any]:
        return {n: m.handle for n, m in self.members.items()}

    def handles(self) -> dict[str, Any]:
        """Every party's handle: the trainer's parties first, then the workers."""
        return {**self.ranks.parties(), **self.workers}

    def transports(self) -> dict[str, str]:
        return {n: m.transport for n, m in self.members.items()}

    def on(self, transport: str, rank: int | None = None) -> list[Member]:
        """The workers set up on ``transport`` (served by trainer rank ``rank``, when given)."""
        return [m for m in self.members.values() if m.transport == transport and (rank is None or m.rank == rank)]
