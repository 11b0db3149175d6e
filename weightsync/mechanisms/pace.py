"""When a recurring hand-off is due, so that its waiter looks without sleeping around then.

A colocated GPU sync ends with two polling waits on the host: the trainer's for its copy
kernel and the worker's for the trainer's "written". A wait that outlasts its first spins
sleeps 10-20 us between looks: on an H100 the worker saw "written" about 56 us after it
was published, and the trainer its kernel's end about 50 us later than a raw copy of the
same bytes ends (docs/benchmarks.md). Spinning through the whole copy
would hold a core for its length. A sync of one model takes about as long as the last one
did, so each waiter keeps a :class:`Pace` and spins only in a window around the moment the
last wait's length predicts::

    pace = Pace()                        # one per recurring wait (a writer's per worker, a worker's own)
    start = time.monotonic()             # when the wait begins (after the launch, the announce)
    wait(..., spin=pace.window(start))   # sleeps, looks without sleeping inside the window
    pace.record(start)                   # only after a wait that ended as it should

The window is 2% of the expected wait on each side (0.1 to 2 ms) plus a millisecond
late: a wait that ends outside it (a first sync, a slower one) sleeps as before.

A look without sleeping holds the thread's GIL, and another thread of the process (a
trainer's data loader, an engine's loop) waits for it: Python takes the GIL from a spinning
thread only after its 5 ms switch interval. So every wait spins only for its first
:data:`FIRST_SPIN_S` (a short hand-off ends within it) and inside its window, and sleeps
between: on an H100 a thread beside 16 GB pushes then woke at worst about 1 ms late per
push, against 2.5 ms when each wait's first 2000 looks and a window of a tenth of the wait
spun (docs/benchmarks.md).
"""

from __future__ import annotations

import time

#: A window that never opens (a first wait: nothing to expect yet).
NO_SPIN = (0.0, 0.0)
#: How long every wait looks without sleeping from its start.
FIRST_SPIN_S = 200e-6
_LEAD_FRACTION = 0.02
_MIN_LEAD_S = 100e-6
_MAX_LEAD_S = 2e-3
_LATE_S = 1e-3


class Pace:
    """The length of the last wait of one recurring hand-off, and the spin window it implies."""

    def __init__(self) -> None:
        self.last_s = 0.0

    def window(self, start: float) -> tuple[float, float]:
        """(from, until) in ``time.monotonic()`` seconds: where a wait begun at ``start``
        should look without sleeping; :data:`NO_SPIN` before any wait was recorded."""
        if self.last_s <= 0.0:
            return NO_SPIN
        lead = min(max(self.last_s * _LEAD_FRACTION, _MIN_LEAD_S), _MAX_LEAD_S)
        due = start + self.last_s
        return (due - lead, due + lead + _LATE_S)

    def record(self, start: float) -> None:
        """A wait begun at ``start`` ended now, as it should (a failed wait is not recorded)."""
        self.last_s = time.monotonic() - start


def spinning(window: tuple[float, float], now: float) -> bool:
    """Whether a wait at ``now`` is inside ``window`` (look again without sleeping)."""
    return window[0] <= now < window[1]
