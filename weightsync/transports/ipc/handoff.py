"""The words of the ipc transport's control block: how the producer and its consumers hand
slots over (see :mod:`weightsync.transports.ipc.halves` for the hand-off itself).

The producer (:class:`~weightsync.transports.ipc.producer.IpcSender`) and every consumer
(:class:`~weightsync.transports.ipc.consumer.IpcReceiver`) index the same words.
"""

from __future__ import annotations

import numpy as np

# Control words: chunks published, the chunk the producer waits to write (0 when not
# waiting), the producer's pid; then per consumer its acknowledged count and its pid; then
# one checksum per slot.
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
