"""What the coordinator knows of a delta session: which bytes each worker holds.

A worker may be sent a delta only onto the bytes it holds, committed. The coordinator
hears, in every worker's answer to a sync it took, the token of what it then holds (0:
nothing a delta applies to: a dense-only transport, a dirty worker), and tells the
trainer every such token with the next sync (``SyncCall.delta_holds``); the trainer
compares them with its base. Anything that leaves a worker's bytes unknown forgets them:
a failed sync (every worker: a worker that answered may still have been left dirty by a
later party's failure), a worker dropped or added. ``delta_keyframe=N`` makes every Nth
sync that completes dense for everyone (a failed sync is not counted). Call order::

    holds, token = book.holds(members), book.token()   # for the SyncCall
    book.heard(results) | book.forget()  # after the round
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from weightsync.core.delta.header import new_token
from weightsync.core.wire.messages import ReceiveResult


class DeltaBook:
    def __init__(self, enabled: bool, keyframe: int | None) -> None:
        self.enabled = enabled
        self.keyframe = keyframe
        self._held: dict[str, int] = {}
        self._syncs = 0

    def holds(self, workers: Iterable[str]) -> tuple[tuple[str, int], ...]:
        """Per worker of this sync, the token it holds; none on a keyframe (every worker dense)."""
        if not self.enabled:
            return ()
        if self.keyframe is not None and (self._syncs + 1) % self.keyframe == 0:
            return ()
        return tuple((w, self._held[w]) for w in workers if w in self._held)

    def token(self) -> int:
        """A fresh name for this sync's bytes (0 outside delta sessions)."""
        return new_token() if self.enabled else 0

    def heard(self, results: Mapping[str, ReceiveResult]) -> None:
        """A sync completed: what each of its workers now holds."""
        self._syncs += 1
        for name, result in results.items():
            if result.token:
                self._held[name] = result.token
            else:
                self._held.pop(name, None)

    def forget(self, workers: Iterable[str] | None = None) -> None:
        """Forget what ``workers`` hold (all of them when None)."""
        if workers is None:
            self._held.clear()
        for name in workers or ():
            self._held.pop(name, None)
