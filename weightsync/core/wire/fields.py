"""The checks a wire message runs on its fields as it is built (``__post_init__``)."""

from __future__ import annotations

from weightsync.core.wire.errors import WeightSyncError


def require(condition: bool, message: str) -> None:
    """Refuse a message whose field breaks a rule: ``message`` names the field and the value."""
    if not condition:
        raise WeightSyncError(message)


def is_int(value: object) -> bool:
    """True for an int that is not a bool (``True`` is not a rank or a size)."""
    return isinstance(value, int) and not isinstance(value, bool)
