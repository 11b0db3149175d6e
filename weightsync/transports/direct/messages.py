"""The direct transport's setup message (owner writes' too): what a writer maps."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.core.wire.fields import is_int, require
from weightsync.core.wire.messages import RegionHandle, ShmHandle


@dataclass(frozen=True, kw_only=True)
class DirectExport:
    """A worker's exported destination region, where each tensor lives in it, and the
    control block the two sides meet on."""

    session: str
    worker: str
    region: RegionHandle
    offsets: tuple[int, ...]
    control: ShmHandle
    writers: int = 1
    """The trainer parties writing into it, each its own part (owner writes: every rank)."""

    def __post_init__(self) -> None:
        require(all(is_int(o) and o >= 0 for o in self.offsets), "direct export offsets must be non-negative ints")
        require(
            is_int(self.writers) and self.writers >= 1, f"a direct export has 1 or more writers, got {self.writers!r}"
        )
