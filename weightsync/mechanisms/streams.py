"""Per-slot execution streams: CUDA streams on a GPU, plain host execution on a CPU.

The packed engines run each buffer slot's work (pack, send or receive, unpack) on that
slot's stream so slots overlap. Streams are created once per (device, count) for the life
of the process: fresh streams on every call strand the caching allocator's blocks, which
are keyed by stream (vLLM gh-52950 grew ~2 GB per sync that way).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator

import torch

from weightsync.core.wire.errors import StreamTimeout, TransferTimeout
from weightsync.mechanisms.pace import FIRST_SPIN_S, NO_SPIN, spinning

log = logging.getLogger("weightsync")
_PR_SET_TIMERSLACK = 29
_PR_GET_TIMERSLACK = 30
_this_thread = threading.local()


@functools.cache
def _libc() -> ctypes.CDLL:
    """The C library, loaded once (each load costs a dlopen and a new class)."""
    return ctypes.CDLL(None, use_errno=True)


@contextlib.contextmanager
def precise_sleeps() -> Iterator[None]:
    """Within the block, let the calling thread's short sleeps end on time (Linux; elsewhere
    nothing); on leaving it, the thread's timer slack is what it was.

    The polling waits of a sync sleep 10-20 us between looks, and Linux lengthens every
    sleep of a thread by its timer slack, 50 us by default: a hand-off that lands while a
    wait sleeps was seen up to ~70 us late (a 20 us sleep measured 87 us at the median,
    34 us with a slack of 1 ns). The slack is restored because the thread is the caller's
    (a Ray actor's, an engine's): with 1 ns, every other sleep and timeout it runs after
    the sync would wake it on the dot, which costs wake-ups and buys nothing. Blocks nest
    (the outermost one restores).
    """
    if getattr(_this_thread, "precise", False) or not sys.platform.startswith("linux"):
        yield
        return
    libc = _libc()
    before = libc.prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    if before < 0 or libc.prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0) != 0:
        log.debug("weightsync: could not shorten this thread's timer slack (errno %d)", ctypes.get_errno())
        yield
        return
    _this_thread.precise = True
    try:
        yield
    finally:
        _this_thread.precise = False
        if libc.prctl(_PR_SET_TIMERSLACK, before, 0, 0, 0) != 0:
            log.debug("weightsync: could not restore this thread's timer slack (errno %d)", ctypes.get_errno())


@functools.cache
def _cuda_streams(device_index: int, count: int) -> tuple[torch.cuda.Stream, ...]:
    return tuple(torch.cuda.Stream(device=device_index) for _ in range(count))


class SlotStreams:
    """One execution context per buffer slot on ``device``.

    Call order for a slot: ``with streams.use(slot): streams.wait_for(caller)`` then the
    slot's work; ``drain(deadline)`` before returning to the caller.
    """

    def __init__(self, device: torch.device, count: int) -> None:
        self.device = device
        self._streams = (
            _cuda_streams(device.index if device.index is not None else torch.cuda.current_device(), count)
            if device.type == "cuda"
            else ()
        )

    @property
    def is_cuda(self) -> bool:
        return bool(self._streams)

    def caller_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.device) if self._streams else None

    @contextlib.contextmanager
    def use(self, slot: int) -> Iterator[None]:
        if not self._streams:
            yield
            return
        with torch.cuda.stream(self._streams[slot]):
            yield

    def wait_for(self, slot: int, caller: torch.cuda.Stream | None) -> None:
        """Order the slot's next work after everything queued on ``caller`` so far.

        The packing stream must not read parameters the caller's stream is still writing
        (vllm-ascend #12713 packed half-written weights without this).
        """
        if self._streams and caller is not None:
            self._streams[slot].wait_stream(caller)

    def stream(self, slot: int) -> torch.cuda.Stream:
        return self._streams[slot]

    def stream_pointer(self, slot: int) -> int:
        return int(self._streams[slot].cuda_stream) if self._streams else 0

    def drain_slot(self, slot: int, deadline: float, on_timeout: str, own: bool = False) -> None:
        """Wait, up to ``deadline``, for one slot's queued work only."""
        if self._streams:
            wait_for_stream(self._streams[slot], deadline, on_timeout, own)

    def drain(self, deadline: float, on_timeout: str, own: bool = False, spin: tuple[float, float] = NO_SPIN) -> None:
        """Wait, up to ``deadline`` (time.monotonic), for every slot's queued work; ``spin``:
        when it is due (see :func:`wait_for_stream`)."""
        for stream in self._streams:
            wait_for_stream(stream, deadline, on_timeout, own, spin)


def wait_for_stream(
    stream: torch.cuda.Stream, deadline: float, on_timeout: str, own: bool = False, spin: tuple[float, float] = NO_SPIN
) -> None:
    """Synchronize ``stream`` without blocking past ``deadline``.

    ``stream.synchronize()`` would wait forever on a collective whose peer died, so the
    stream is polled and the caller gets a :class:`TransferTimeout` it can act on (abort
    the communicator) instead. It polls without sleeping for its first
    :data:`~weightsync.mechanisms.pace.FIRST_SPIN_S` and inside ``spin``
    (:class:`~weightsync.mechanisms.pace.Pace`: when the work is due to end).
    """
    # ``own``: the stream holds only this process's copies, so a late stream is this party's
    # failure; otherwise (a collective on it) it waits on a peer.
    _poll(stream.query, deadline, StreamTimeout if own else TransferTimeout, on_timeout, spin, precise=True)


def wait_for_event(event: torch.cuda.Event, deadline: float, on_timeout: str) -> None:
    """Wait, up to ``deadline``, for the work recorded before ``event`` (this process's own
    copies: a late event is this party's failure, a :class:`StreamTimeout`)."""
    _poll(event.query, deadline, StreamTimeout, on_timeout, NO_SPIN, precise=False)


def _poll(
    done: Callable[[], bool],
    deadline: float,
    late: type[Exception],
    on_timeout: str,
    spin: tuple[float, float],
    precise: bool,
) -> None:
    """Look at ``done`` without sleeping for the first
    :data:`~weightsync.mechanisms.pace.FIRST_SPIN_S` and inside ``spin``, in short sleeps
    otherwise (with ``precise``, sleeps that end on time); past ``deadline`` raise
    ``late(on_timeout)``."""
    began = time.monotonic()
    sleeping = False
    delay = 10e-6
    with contextlib.ExitStack() as slack:
        while not done():
            now = time.monotonic()
            if now - began < FIRST_SPIN_S:
                continue
            if not sleeping:
                sleeping = True
                if precise:
                    slack.enter_context(precise_sleeps())
            if now > deadline:
                raise late(on_timeout)
            if spinning(spin, now):
                continue
            time.sleep(delay)
            delay = min(delay * 2, 20e-6)
