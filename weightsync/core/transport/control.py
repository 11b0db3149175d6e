"""The colocated control block and the one wait-with-deadline helper.

The colocated transports (ipc, direct) hand work over through a few int64 words in
``/dev/shm`` that both processes poll, instead of Ray round trips. Word layout::

    word 0   MAGIC           a mapping of the wrong file is refused
    word 1   abort word      0, or the code of the first side that failed (low 16 bits)
                             and the sync it failed in (the epoch, above them)
    word 2.. the transport's own words (counters, pids, checksums)

Abort codes are named by the transport: :data:`TRAINER` is always 1, and
:func:`worker_code` gives each worker of an export its own. The first side to fail writes
its code, so its peers stop at once and name it instead of waiting out their deadline.
Each side sets :attr:`ControlBlock.epoch` at the start of every sync (``seq + 1``): an
abort is recorded with the epoch it happened in, and an abort of an earlier sync is stale,
so it neither stops this sync nor keeps this sync's first failure from being recorded.

Every wait has a deadline (:class:`~weightsync.core.wire.session.Deadlines` decides them
all, the coordinator's too), and can watch the peer's process: a peer that died without raising the flag (SIGKILL,
OOM) is noticed within milliseconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from weightsync.core.transport.shm import ShmRegion, pid_alive
from weightsync.core.transport.streams import precise_sleeps
from weightsync.core.wire.errors import PeerAborted, TransferTimeout, WeightSyncError
from weightsync.core.wire.messages import ShmHandle

MAGIC = 0x5753594E43  # "WSYNC"
_ABORT = 1
FIRST_FREE_WORD = 2
TRAINER = 1
_CODE_BITS = 16


def worker_code(index: int) -> int:
    """The abort code of the ``index``-th worker of an export (the trainer is 1)."""
    return 2 + index


class ControlBlock:
    """A few shared int64 words; ``words`` is the numpy view both sides read and write."""

    def __init__(self, words: np.ndarray, path: str, region: ShmRegion | None = None) -> None:
        self.words = words
        self.path = path
        self._region = region
        #: This side's current sync (seq + 1; 0: no sync started, every abort counts).
        self.epoch = 0
        #: Whether a wait that falls back to sleeping shortens its thread's timer slack
        #: (:func:`~weightsync.core.transport.streams.precise_sleeps`): set by the GPU
        #: transports, whose copies leave the host idle; on a CPU the more frequent
        #: wake-ups would take time from the peer doing the copying.
        self.precise = False

    @classmethod
    def create(cls, nwords: int, tag: str) -> ControlBlock:
        """A zeroed block of ``nwords`` words (magic set), owned by this process."""
        region = ShmRegion((FIRST_FREE_WORD + nwords) * 8, tag=tag)
        words = region.tensor.view(torch.int64)
        words.zero_()
        words[0] = MAGIC
        return cls(words.numpy(), region.path, region)

    @classmethod
    def attach(cls, mapped: torch.Tensor, who: str, path: str) -> ControlBlock:
        """The block behind a mapping of another process's export; refuses a foreign file."""
        words = mapped.view(torch.int64)
        if words.numel() < FIRST_FREE_WORD or int(words[0]) != MAGIC:
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
        return int(self.words[FIRST_FREE_WORD + word])

    def __setitem__(self, word: int, value: int) -> None:
        self.words[FIRST_FREE_WORD + word] = value

    def abort(self, code: int) -> None:
        """Record ``code`` as the failing side of this epoch's sync unless another side
        failed first in it (an abort of an earlier sync is overwritten)."""
        if not self.aborted_by:
            self.words[_ABORT] = code | (self.epoch << _CODE_BITS)

    @property
    def aborted_by(self) -> int:
        """The code of the side that failed this sync (or a later one), or 0."""
        word = int(self.words[_ABORT])
        if word >> _CODE_BITS < self.epoch:
            return 0
        return word & ((1 << _CODE_BITS) - 1)

    def wait(
        self,
        predicate: Callable[[], bool],
        deadline: float,
        me: str,
        what: Callable[[], str],
        names: Sequence[str],
        peer_pid: Callable[[], int] | None = None,
        late: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        """Spin, then back off, until ``predicate``; raise on an abort code, a dead peer, or the deadline.

        ``names[code - 1]`` names the side that wrote abort ``code``. ``what`` words the
        error (called only then, so it names who is late at that moment); ``late`` returns
        the parties that are late, which the timeout blames; ``peer_pid`` the process to
        watch (0: none yet).
        """
        spins = 0
        delay = 10e-6
        next_check = 0.0
        while not predicate():
            code = self.aborted_by
            if code:
                who = names[code - 1] if 0 < code <= len(names) else f"peer {code}"
                raise PeerAborted(f"{me}: {who} failed during the transfer; stopped waiting for {what()}", blames=[who])
            spins += 1
            if spins <= 2000:
                continue
            if spins == 2001 and self.precise:
                precise_sleeps()
            now = time.monotonic()
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
            time.sleep(delay)
            delay = min(delay * 2, 20e-6)
