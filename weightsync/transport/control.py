"""Control blocks: a few int64 words in ``/dev/shm`` that colocated processes poll.

The colocated transports hand work over through these instead of Ray round trips: one side
writes a counter, the other spins on it. Word 0 holds a magic number (a mapping of the
wrong file is refused), word 1 the abort code: the first side to fail writes its code there
so its peers stop at once and name it, instead of waiting out their deadline.

Every wait has a deadline, and can also watch the peer's process: a peer that died without
raising the flag (SIGKILL, OOM) is noticed within milliseconds, not at the deadline.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from weightsync.spec import WeightSyncError
from weightsync.transport.shm import ShmRegion
from weightsync.transport.streams import TransferTimeout

MAGIC = 0x5753594E43  # "WSYNC"
ABORT = 1
FIRST_FREE_WORD = 2


class PeerAborted(WeightSyncError):
    """The other side of a colocated hand-off failed, or its process ended, mid-transfer."""


def create_control(words: int, tag: str) -> tuple[ShmRegion, np.ndarray]:
    """A zeroed block of ``words`` int64 words (magic set); the caller exports the region."""
    region = ShmRegion(words * 8, tag=tag)
    control = region.tensor.view(torch.int64)
    control.zero_()
    control[0] = MAGIC
    return region, control.numpy()


def view_control(mapped: torch.Tensor, who: str, path: str) -> np.ndarray:
    """The words of a mapped control block; refuses a file that is not one."""
    control = mapped.view(torch.int64)
    if control.numel() < FIRST_FREE_WORD or int(control[0]) != MAGIC:
        raise WeightSyncError(f"{who}: control block {path} is not weightsync's")
    return control.numpy()


def raise_abort(control: np.ndarray, code: int) -> None:
    """Record ``code`` as the failing side unless another side failed first."""
    if not int(control[ABORT]):
        control[ABORT] = code


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def wait_until(
    predicate: Callable[[], bool],
    deadline: float,
    control: np.ndarray,
    me: str,
    what: Callable[[], str],
    names: Sequence[str],
    peer_pid: Callable[[], int] | None = None,
) -> None:
    """Spin, then back off, until ``predicate``; raise on an abort code, a dead peer, or the deadline.

    ``names[code - 1]`` names the side that wrote abort ``code``. ``what`` is called only
    to word an error, so it names who is late at that moment. ``peer_pid`` returns the
    process to watch (0: none yet).
    """
    spins = 0
    delay = 10e-6
    next_check = 0.0
    while not predicate():
        code = int(control[ABORT])
        if code:
            who = names[code - 1] if 0 < code <= len(names) else f"peer {code}"
            raise PeerAborted(f"{me}: {who} failed during the transfer; stopped waiting for {what()}")
        spins += 1
        if spins <= 2000:
            continue
        now = time.monotonic()
        if now > deadline:
            raise TransferTimeout(
                f"{me}: timed out waiting for {what()}; that side is stuck, dead or too slow "
                "(raise timeout_s if it is only slow)"
            )
        if peer_pid is not None and now >= next_check:
            next_check = now + 0.01
            pid = peer_pid()
            if not pid_alive(pid) and not predicate():
                raise PeerAborted(f"{me}: the peer process (pid {pid}) ended while waiting for {what()}")
        time.sleep(delay)
        delay = min(delay * 2, 20e-6)
