"""What both halves of the owners transport share: the kind, and how a group's failure
names the party behind it."""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.core.wire.errors import PeerAborted, TransferError, TransferTimeout, WeightSyncError

KIND = "owners"


def rebrand(exc: WeightSyncError, blames: Sequence[str], where: str) -> WeightSyncError:
    """``exc`` (a group's failure, which cannot name the party behind it) blaming ``blames``,
    of the same kind (a timeout stays a timeout, a peer's abort a peer's abort)."""
    cls: type[WeightSyncError] = TransferError
    for kind in (TransferTimeout, PeerAborted):
        if isinstance(exc, kind):
            cls = kind
    return cls(f"{where}: {exc}", blames=blames)
