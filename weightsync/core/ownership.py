"""Which coordinator a worker's session belongs to.

A worker takes part in one coordinator's session at a time (a trainer party keeps one per
coordinator instead): the receiver records the label of the coordinator that set it up
last (``WeightSync.label``). A later coordinator's setup takes the worker over; the
earlier one's syncs are then refused by name, and its teardown and settle leave the
worker alone. An empty label (a caller that gives none) is anyone's.
"""

from __future__ import annotations

from weightsync.core.wire.errors import SessionTornDown


def foreign(holder: str, caller: str) -> bool:
    """True when coordinator ``caller`` is not ``holder``, the one that set the worker up last."""
    return bool(caller) and bool(holder) and caller != holder


def refuse_foreign(worker: str, holder: str, caller: str) -> None:
    """Raise :class:`SessionTornDown` naming both when ``caller``'s call reached a worker
    that ``holder`` took over since."""
    if foreign(holder, caller):
        raise SessionTornDown(
            f"{worker}: set up by {holder} since, which took this worker over from {caller}: a worker takes part "
            "in one WeightSync at a time; give each WeightSync workers of its own (or close the other one), then "
            "this one's next sync sets it up again"
        )
