"""The CPU loops of a delta sync, compiled by numba when it is installed, and the threads
that run them.

Finding the changed elements of a gigabyte is a compaction (which elements, in order),
and torch's CPU ops do it in several passes over the data (a cast, ``ne``, ``nonzero``, a
gather, a scatter into the base), each waking torch's OpenMP threads, which on a loaded
machine costs more than the work. The loops of :mod:`weightsync.core.delta.numba_loops`
read the trainer's tensor and the base once, block by block in cache: the fp32 -> bf16 cast
(torch's rounding), the compare as 64-bit words, and, for the few words that differ, their
elements and the base's update. On the 2-core development machine that is about 1 ns an
element of an fp32 source, against 0.6 ns for the cast alone (docs/benchmarks.md).

:class:`Tasks` runs ranges of tensors on :func:`threads` threads (this one included), each
writing outputs of its own; the loops release the GIL. Without numba (:func:`kernels`
returns None) the same results come from torch ops (:mod:`weightsync.core.delta.diff`).
Compiling takes a few seconds per process the first time (cached on disk where the
package's folder is writable).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("weightsync")


@functools.cache
def kernels() -> Any:
    """The compiled loops (:mod:`weightsync.core.delta.numba_loops`), or None where numba
    does not import (torch ops then serve)."""
    try:
        from weightsync.core.delta import numba_loops
    except ImportError:
        log.info("weightsync: numba is not installed; delta syncs on CPU use torch ops (slower)")
        return None
    return numba_loops


def threads() -> int:
    """How many threads the loops run on: torch's intra-op count (what the caller allows
    torch), at most the machine's cores."""
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


class Tasks:
    """A queue of callables run on this thread and ``count - 1`` helper threads.

    Call order: :meth:`add` any number of times (helpers start taking tasks at once),
    :meth:`help` to run queued tasks on this thread while adding (keeps the queue short
    when tasks are made one tensor at a time), then :meth:`finish`, which runs what is left,
    waits for the helpers and raises the first task's exception, if any. Helpers are
    threads of their own that end with :meth:`finish`.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self._queue: deque[Callable[[], None]] = deque()
        self._cond = threading.Condition()
        self._busy = 0
        self._closed = False
        self._error: BaseException | None = None
        self._helpers = [
            threading.Thread(target=self._serve, name="weightsync-delta", daemon=True) for _ in range(count - 1)
        ]
        for helper in self._helpers:
            helper.start()

    def add(self, task: Callable[[], None]) -> None:
        with self._cond:
            self._queue.append(task)
            self._cond.notify()

    def help(self, keep: int = 0) -> None:
        """Run queued tasks on this thread until at most ``keep`` are queued."""
        while True:
            with self._cond:
                if len(self._queue) <= keep:
                    return
                task = self._queue.popleft()
                self._busy += 1
            self._run(task)

    def finish(self) -> None:
        self.help(0)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._busy:
                self._cond.wait()
        for helper in self._helpers:
            helper.join()
        if self._error is not None:
            raise self._error

    def _run(self, task: Callable[[], None]) -> None:
        try:
            if self._error is None:
                task()
        except BaseException as exc:  # noqa: BLE001 - raised by finish() on the caller's thread
            self._error = self._error or exc
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                task = self._queue.popleft()
                self._busy += 1
            self._run(task)
