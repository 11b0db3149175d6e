"""One failure policy: from the parties' outcomes of a step to the error and what comes next.

Every place that sees failures applies it: each setup step, the coordinator's sync round
and push round, and a push from inside the trainer. :func:`judge` is a pure function of
the outcomes; the caller carries the verdict out::

    verdict = judge(outcomes, "sync failed during the transfer of version 7")
    if verdict is not None:
        drop verdict.dead workers            (their actors died: named, never asked again)
        settle verdict.settle(workers)       (everyone who can still answer reports its state;
                                              a worker left mid-write reports itself dirty;
                                              one whose chained commit waits for a silent
                                              party is named instead: Ray would queue it)
        tear down, skipping verdict.silent   (they gave no answer: asking again would wait again;
                                              nor a worker whose chained commit waits for one)
        raise verdict.sync_error(held, dropped)      or verdict.setup_error(dropped)

Blame comes from :func:`~weightsync.core.wire.outcome.assign_blame`: a party that died or
never answered, a failure of its own, never a consequence of another's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from weightsync.core.wire.errors import SetupError, SyncError
from weightsync.core.wire.outcome import Outcome, Status, assign_blame, describe_failure

#: A worker's (version, state) as it reports it after a failure.
Held = Mapping[str, tuple[int | None, str]]


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What one failed step means: whom to blame, who is dead, who gave no answer."""

    title: str
    outcomes: Mapping[str, Outcome]
    culprits: tuple[str, ...]
    dead: tuple[str, ...]
    """Parties whose actor (process) died."""
    silent: tuple[str, ...]
    """Parties that gave no answer in time (frozen, stuck, or far too slow)."""

    def settle(self, workers: Iterable[str]) -> list[str]:
        """Of ``workers``, those to ask for their state: all but the dead and the silent."""
        gone = {*self.dead, *self.silent}
        return [w for w in workers if w not in gone]

    def message(
        self, held: Held | None = None, dropped: Sequence[str] = (), waiting: Mapping[str, Sequence[str]] | None = None
    ) -> str:
        lines = describe_failure(self.title, self.outcomes, self.culprits)
        if dropped:
            lines += f"\n  dropped dead worker(s) {', '.join(dropped)}; the next sync sets up without them"
        if held:
            lines += "\n  workers now hold: " + ", ".join(f"{n} v{v} {s}" for n, (v, s) in sorted(held.items()))
        for name, parties in sorted((waiting or {}).items()):
            lines += (
                f"\n  {name} was not settled: its commit waits for the answer of {', '.join(parties)}, which gave "
                "none; it settles once they answer or die (ws_status() then says what it holds)"
            )
        return lines

    def sync_error(
        self, held: Held | None = None, dropped: Sequence[str] = (), waiting: Mapping[str, Sequence[str]] | None = None
    ) -> SyncError:
        message = self.message(held, dropped, waiting)
        return SyncError(message, self.outcomes, self.culprits, self.dead, held, waiting)

    def setup_error(self, dropped: Sequence[str] = ()) -> SetupError:
        return SetupError(self.message(None, dropped), self.outcomes, self.culprits, self.dead)


def judge(outcomes: Mapping[str, Outcome], title: str) -> Verdict | None:
    """The verdict on ``outcomes`` (one per party), or None when every party succeeded."""
    if all(o.ok for o in outcomes.values()):
        return None
    return Verdict(
        title=title,
        outcomes=dict(outcomes),
        culprits=tuple(assign_blame(outcomes)),
        dead=tuple(sorted(n for n, o in outcomes.items() if o.status is Status.DEAD)),
        silent=tuple(sorted(n for n, o in outcomes.items() if o.status is Status.TIMED_OUT)),
    )
