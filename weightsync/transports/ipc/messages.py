"""The ipc transport's setup message (rank-ipc's too): what a consumer attaches."""

from __future__ import annotations

from dataclasses import dataclass

from weightsync.core.wire.fields import is_int, require
from weightsync.core.wire.messages import RegionHandle, ShmHandle


@dataclass(frozen=True, kw_only=True)
class IpcExport:
    """What an IPC consumer needs to attach: the slot region, the control block, the layout."""

    session: str
    slots: RegionHandle
    control: ShmHandle
    num_slots: int
    slot_bytes: int
    consumer_names: tuple[str, ...]
    #: On a GPU: per slot, the interprocess event the producer records after packing it;
    #: per consumer and slot, the event that consumer records after unpacking it.
    packed_events: tuple[bytes, ...] = ()
    freed_events: tuple[tuple[bytes, ...], ...] = ()

    def __post_init__(self) -> None:
        require(
            is_int(self.num_slots) and is_int(self.slot_bytes) and self.num_slots >= 1 and self.slot_bytes >= 1,
            "an IPC export needs at least one non-empty slot",
        )
        require(
            not self.packed_events
            or (
                len(self.packed_events) == self.num_slots
                and len(self.freed_events) == len(self.consumer_names)
                and all(len(row) == self.num_slots for row in self.freed_events)
            ),
            "an IPC export's events must be one per slot, and one row per consumer",
        )
        require(bool(self.consumer_names), "an IPC export needs at least one consumer")
        require(
            self.slots.nbytes == self.num_slots * self.slot_bytes,
            f"IPC export region holds {self.slots.nbytes} bytes, {self.num_slots} slots of {self.slot_bytes} need "
            f"{self.num_slots * self.slot_bytes}",
        )

    @property
    def num_consumers(self) -> int:
        return len(self.consumer_names)
