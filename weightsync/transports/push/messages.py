"""Push mode's setup message: what the trainer attaches to ring a listening worker."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.core.wire.fields import is_int, require
from weightsync.core.wire.messages import ShmHandle


@dataclass(frozen=True, kw_only=True)
class PushExport:
    """A listening direct worker's mailbox and doorbell (see :mod:`weightsync.mechanisms.mailbox`)."""

    worker: str
    mailbox: ShmHandle
    doorbell: str
    #: The secret each ring carries; the listener ignores a datagram without it.
    doorbell_key: bytes
    pid: int

    def __post_init__(self) -> None:
        require(bool(self.worker) and bool(self.doorbell), "a push export names its worker and its doorbell")
        require(
            isinstance(self.doorbell_key, bytes) and len(self.doorbell_key) == 16,
            f"{self.worker}: a push export's doorbell key must be 16 bytes, got {self.doorbell_key!r}",
        )
        require(is_int(self.pid) and self.pid > 0, f"a push export's pid must be a positive int, got {self.pid!r}")
