"""What one set-up fixes for a party, handed to every transport half it opens.

A :class:`Session` holds the facts every half needs and that must not travel hop by hop:
the Manifest (with the settings both sides agreed on), the timeout and the deadlines
derived from it, this party's own name, and the name of the party that serves it (for a
worker, the trainer or the trainer rank that feeds it: the one to blame when the other
side fails). Call order, once per set-up::

    trainer rank   ws_manifest(settings, party, ...)  builds the Manifest, then
                   Session(manifest, party=rank, server=rank, timeout_s)
    worker         ws_accept(Session(manifest, party=name, server=serving rank, timeout_s))
    every half     made from its party's Session by the transport's setup actions

:class:`Deadlines` is the one deadline policy: every wait of a sync, the coordinator's too,
is derived from ``timeout_s`` here.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.settings import check_timeout

#: The party name of a trainer of one process (a sharded trainer's ranks are
#: ``trainer-rank-<i>``, see weightsync.glue.ranks).
TRAINER_PARTY = "trainer"


@dataclass(frozen=True)
class Deadlines:
    """When each kind of wait gives up, from one ``timeout_s``.

    The side that can name a late peer (the trainer waiting for acknowledgements, a writer
    waiting for an announcement) gives up at ``timeout_s``; the sides waiting on it get a
    short grace more, so they learn of its failure through the abort word instead of timing
    out themselves; the coordinator's wait on the Ray calls gets the whole grace, so every
    party's own error comes back before it gives up on a party that never answers.
    """

    timeout_s: float

    @property
    def grace_s(self) -> float:
        return min(10.0, 1.0 + 0.1 * self.timeout_s)

    def leader(self, start: float) -> float:
        return start + self.timeout_s

    def follower(self, start: float) -> float:
        return start + self.timeout_s + self.grace_s / 2

    @property
    def coordinator_s(self) -> float:
        return self.timeout_s + self.grace_s

    @property
    def startup_s(self) -> float:
        """The first call of a setup also waits for actors still being constructed (a process
        to start, torch to import, a model to build: a minute on a loaded machine)."""
        return max(2 * self.timeout_s + self.grace_s, 60.0)


@dataclass(frozen=True, kw_only=True)
class Session:
    """One party's view of one set-up; every field is checked on construction."""

    manifest: Manifest
    """The trainer's Manifest: tensors, wire dtypes, the agreed settings, the chunk plans."""

    party: str
    """This party's own name (``worker-0``, ``trainer``, ``trainer-rank-1``)."""

    server: str
    """The party serving this one: a worker's trainer (rank); a trainer rank itself."""

    timeout_s: float
    """Bound on every wait; see :class:`Deadlines`."""

    def __post_init__(self) -> None:
        if not isinstance(self.manifest, Manifest):
            raise SettingsError(f"a session needs a Manifest, got {type(self.manifest).__name__}")
        for label in ("party", "server"):
            value = getattr(self, label)
            if not isinstance(value, str) or not value:
                raise SettingsError(f"a session's {label} must be a non-empty name, got {value!r}")
        object.__setattr__(self, "timeout_s", check_timeout(self.timeout_s))

    @property
    def deadlines(self) -> Deadlines:
        return Deadlines(self.timeout_s)
