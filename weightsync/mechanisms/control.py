"""The colocated control block and the one wait-with-deadline helper.

The colocated transports (ipc, direct) hand work over through a few int64 words in
``/dev/shm`` that both processes poll, instead of Ray round trips. Word layout::

    word 0            MAGIC      a mapping of the wrong file is refused
    word 1            PARTIES    P, the number of sides that may abort (codes 1..P)
    words 2+2(c-1),   abort      per abort code c: the sync that side failed in (the epoch)
          3+2(c-1)               and when (its monotonic clock in ns; 0: never failed)
    word 2+2P..       the transport's own words (counters, pids, checksums)

Abort codes are named by the transport: :data:`TRAINER` is always 1, and
:func:`worker_code` gives each worker of an export its own. A side that fails writes only
its own pair of words, so two sides failing at once never overwrite each other (a single
shared word would need a compare-and-swap across processes, which Python lacks): every
reader sees each failure and names the earliest one (the side that failed first; the
parties of a control block share the host's monotonic clock), then the others.
Each side sets :attr:`ControlBlock.epoch` at the start of every sync (``seq + 1``): an
abort is recorded with the epoch it happened in, and an abort of an earlier sync is stale,
so it neither stops this sync nor hides this sync's failures.

Every wait has a deadline (:class:`~weightsync.core.wire.session.Deadlines` decides them
all, the coordinator's too), and can watch the peer's process: a peer that died without raising the flag (SIGKILL,
OOM) is noticed within milliseconds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from weightsync.core.wire.errors import PeerAborted, TransferTimeout, WeightSyncError
from weightsync.core.wire.messages import ShmHandle
from weightsync.mechanisms.pace import FIRST_SPIN_S, NO_SPIN, spinning
from weightsync.mechanisms.shm import ShmRegion, pid_alive
from weightsync.mechanisms.streams import precise_sleeps

MAGIC = 0x5753594E43  # "WSYNC"
_PARTIES = 1
_HEADER = 2  # words before the abort pairs
TRAINER = 1
#: The clock abort stamps are read from (shared by every process of one host).
_clock = time.monotonic_ns


def worker_code(index: int) -> int:
    """The abort code of the ``index``-th worker of an export (the trainer is 1)."""
    return 2 + index


class ControlBlock:
    """A few shared int64 words; ``words`` is the numpy view both sides read and write."""

    def __init__(self, words: np.ndarray, path: str, region: ShmRegion | None = None) -> None:
        self.words = words
        self.path = path
        self._region = region
        #: How many sides may abort (codes 1..parties).
        self.parties = int(words[_PARTIES])
        #: The first word of the transport's own (``self[0]``).
        self.first = _HEADER + 2 * self.parties
        self._pairs = words[_HEADER : self.first]
        self._aborting = threading.Lock()  # two threads of one side abort once
        #: This side's current sync (seq + 1; 0: no sync started, every abort counts).
        self.epoch = 0
        #: Whether a wait that falls back to sleeping shortens its thread's timer slack
        #: (:func:`~weightsync.mechanisms.streams.precise_sleeps`): set by the GPU
        #: transports, whose copies leave the host idle; on a CPU the more frequent
        #: wake-ups would take time from the peer doing the copying.
        self.precise = False

    @classmethod
    def create(cls, nwords: int, tag: str, parties: int = 0) -> ControlBlock:
        """A zeroed block of ``nwords`` words for the transport (magic set) and an abort
        pair for each of ``parties`` sides, owned by this process."""
        if parties < 0:
            raise ValueError(f"a control block needs parties >= 0, got {parties}")
        region = ShmRegion((_HEADER + 2 * parties + nwords) * 8, tag=tag)
        words = region.tensor.view(torch.int64)
        words.zero_()
        words[0] = MAGIC
        words[_PARTIES] = parties
        return cls(words.numpy(), region.path, region)

    @classmethod
    def attach(cls, mapped: torch.Tensor, who: str, path: str) -> ControlBlock:
        """The block behind a mapping of another process's export; refuses a foreign file."""
        words = mapped.view(torch.int64)
        if (
            words.numel() < _HEADER
            or int(words[0]) != MAGIC
            or not 0 <= int(words[_PARTIES]) <= (words.numel() - _HEADER) // 2
        ):
            raise WeightSyncError(f"{who}: control block {path} is not weightsync's")
        return cls(words.numpy(), path)

    def handle(self) -> ShmHandle:
        assert self._region is not None, "only the owner exports a control block"
        return self._region.handle()

    def unlink(self) -> None:
        if self._region is not None:
            self._region.unlink()

    def close(self) -> None:
        if self._region is not None:
            self._region.close()
            self._region = None

    def __getitem__(self, word: int) -> int:
        return int(self.words[self.first + word])

    def __setitem__(self, word: int, value: int) -> None:
        self.words[self.first + word] = value

    def abort(self, code: int) -> None:
        """Record that side ``code`` failed in this epoch's sync; its first failure in it
        stands (an abort of an earlier sync is replaced). Only this side's own words are
        written, so no other side's failure is ever overwritten."""
        if not 0 < code <= self.parties:
            raise WeightSyncError(
                f"control block {self.path}: abort code {code} is not one of its {self.parties} parties' "
                f"(1..{self.parties}); the transport counted its parties wrong"
            )
        at = _HEADER + 2 * (code - 1)
        with self._aborting:
            if self.words[at + 1] and self.words[at] >= self.epoch:
                return
            # The stamp before the epoch, which readers read first: a reader that sees
            # this epoch sees this stamp.
            self.words[at + 1] = _clock()
            self.words[at] = self.epoch

    @property
    def aborts(self) -> list[int]:
        """The codes of the sides that failed this sync (or a later one), earliest first."""
        pairs = self._pairs.tolist()  # one read of every pair, epochs before stamps
        # Polled in the waits' spin loops: the common answers (none, only stale) come first.
        if not any(pairs[1::2]) or max(pairs[0::2]) < self.epoch:
            return []
        failed = [
            (stamp, code)
            for code, (epoch, stamp) in enumerate(zip(pairs[0::2], pairs[1::2]), start=1)
            if stamp and epoch >= self.epoch
        ]
        return [code for _, code in sorted(failed)]

    @property
    def aborted_by(self) -> int:
        """The code of the side that failed first in this sync (or a later one), or 0."""
        failed = self.aborts
        return failed[0] if failed else 0

    def wait(
        self,
        predicate: Callable[[], bool],
        deadline: float,
        me: str,
        what: Callable[[], str],
        names: Sequence[str],
        peer_pid: Callable[[], int] | None = None,
        late: Callable[[], Sequence[str]] | None = None,
        spin: tuple[float, float] = NO_SPIN,
    ) -> None:
        """Spin, then back off, until ``predicate``; raise on an abort code, a dead peer, or the deadline.

        ``names[code - 1]`` names the side that wrote abort ``code``. ``what`` words the
        error (called only then, so it names who is late at that moment); ``late`` returns
        the parties that are late, which the timeout blames; ``peer_pid`` the process to
        watch (0: none yet). The wait looks without sleeping for its first
        :data:`~weightsync.mechanisms.pace.FIRST_SPIN_S`, and with :attr:`precise` inside
        ``spin`` (:class:`~weightsync.mechanisms.pace.Pace`: when the hand-off is due).
        """
        began = time.monotonic()
        sleeping = False
        delay = 10e-6
        next_check = 0.0
        with contextlib.ExitStack() as slack:  # the thread's timer slack is restored on leaving
            while not predicate():
                failed = self.aborts
                if failed:
                    who, *others = [names[c - 1] if 0 < c <= len(names) else f"peer {c}" for c in failed]
                    then = f" (then {', '.join(others)} too)" if others else ""
                    raise PeerAborted(
                        f"{me}: {who} failed during the transfer{then}; stopped waiting for {what()}", blames=[who]
                    )
                now = time.monotonic()
                if now - began < FIRST_SPIN_S:
                    continue
                if not sleeping:
                    sleeping = True
                    if self.precise:
                        slack.enter_context(precise_sleeps())
                if now > deadline:
                    blamed = list(late()) if late is not None else []
                    raise TransferTimeout(
                        f"{me}: timed out waiting for {what()}; that side is stuck, dead or too slow "
                        "(raise timeout_s if it is only slow)",
                        blames=blamed,
                    )
                if peer_pid is not None and now >= next_check:
                    next_check = now + 0.01
                    pid = peer_pid()
                    if not pid_alive(pid) and not predicate():
                        blamed = list(late()) if late is not None else []
                        raise PeerAborted(
                            f"{me}: the peer process (pid {pid}) ended while waiting for {what()}", blames=blamed
                        )
                if self.precise and spinning(spin, now):
                    continue
                time.sleep(delay)
                delay = min(delay * 2, 20e-6)
