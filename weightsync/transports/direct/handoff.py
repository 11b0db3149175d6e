"""What the direct transport's two halves share: the words of an export's control block,
and the record of a teardown that ends both sides' waits.

One export is read by its worker (:class:`~weightsync.transports.direct.target.DirectTarget`)
and written by every trainer party that writes into it
(:class:`~weightsync.transports.direct.writer.DirectWriter`); both index the same words.
"""

from __future__ import annotations

from collections.abc import Callable

from weightsync.core.wire.errors import SessionTornDown

# Control words: the target's announcement (seq + 1 when ready, -(seq + 1) when stale) and
# pid, then per writer its completion (seq + 1) and pid, then one checksum per tensor
# (verify). Abort codes: writer w is w + 1 (one writer: TRAINER), the target the next one.
ANNOUNCED, TARGET_PID = 0, 1


def written_word(writer: int) -> int:
    return 2 + 2 * writer


def writer_pid_word(writer: int) -> int:
    return 3 + 2 * writer


def first_checksum_word(writers: int) -> int:
    return 2 + 2 * writers


class TornDown:
    """A direct half's record of a teardown (:meth:`SendHalf.tear_down`), shared by both sides.

    The flag is set before the abort words are written: a sync whose ``start()`` has not
    seen it set its epoch first, so those words carry that epoch and end its waits (and its
    peer's); a ``start()`` that sees it writes them again and fails the sync at once.
    """

    name: str
    _torn_down = ""  # who tore the session down; "" while it is open
    _whose = "the session"
    abort: Callable[[], None]

    def tear_down(self, by: str) -> None:
        self._torn_down = by
        self.abort()

    def _torn_down_error(self, seq: int, when: str) -> SessionTornDown:
        return SessionTornDown(
            f"{self.name}: {self._whose} was torn down ({self._torn_down}) when sync {seq} {when}; "
            "run WeightSync.setup() from the driver before the next sync"
        )
