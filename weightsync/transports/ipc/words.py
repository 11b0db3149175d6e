"""The ipc transport's control block: which word holds what (both halves read them).

Words: chunks published (counted from the session's start), the chunk the producer waits
to write (0 when not waiting), the producer's pid; then per consumer its acknowledged
count and its pid; then one checksum per slot.
"""

from __future__ import annotations

import numpy as np

PUBLISHED, WAITING, PRODUCER_PID = 0, 1, 2
FIRST_CONSUMER = 3


def ack_word(consumer: int) -> int:
    return FIRST_CONSUMER + 2 * consumer


def pid_word(consumer: int) -> int:
    return FIRST_CONSUMER + 2 * consumer + 1


def checksum_word(num_consumers: int, slot: int) -> int:
    return FIRST_CONSUMER + 2 * num_consumers + slot


def as_word(checksum: int) -> int:
    return int(np.uint64(checksum).view(np.int64))


def from_word(word: int) -> int:
    return int(np.int64(word).view(np.uint64))
