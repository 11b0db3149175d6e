"""The per-chunk IPC hand-off the reference design uses: one chunk per call, by handle.

The reference file this project grew from hands every chunk over with a call to the
producer (pack it into a slot) and one to each consumer (copy it out). The bench measures
that design (:mod:`~weightsync.tools.bench.reference`) on weightsync's own slots, through
the two hooks the ipc halves keep for it (``pack_slot`` of its sending half, ``read_slot`` of
its receiving half), seen through :class:`SlotPacker` and :class:`SlotReader`.
The caller must not pack a slot again before every consumer's :func:`consume_chunk` of it
returned. Call order::

    handle = pack_chunk(ipc_sender, chunk_index, slot, tensors)           # producer
    consume_chunk(ipc_receiver, handle, unpacker, sink.consume)           # each consumer
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from weightsync.core.packing import ChunkUnpacker
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.manifest import Manifest


@runtime_checkable
class SlotPacker(Protocol):
    """An ipc sending half, as far as the per-chunk hand-off needs it."""

    manifest: Manifest

    @property
    def export_session(self) -> str | None: ...

    def pack_slot(
        self, chunk_index: int, slot: int, sources: Sequence[torch.Tensor], verify: bool = False
    ) -> int | None: ...


@runtime_checkable
class SlotReader(Protocol):
    """An ipc receiving half, as far as the per-chunk hand-off needs it."""

    name: str
    manifest: Manifest

    @property
    def export_session(self) -> str | None: ...

    def read_slot(
        self,
        chunk_index: int,
        slot: int,
        unpacker: ChunkUnpacker,
        deliver: Callable[[list[tuple[str, torch.Tensor]]], None],
        verify: bool = False,
        expected: int | None = None,
    ) -> int | None: ...


@dataclass(frozen=True, kw_only=True)
class ChunkHandle:
    """Chunk ``chunk_index`` sits in ``slot`` of export ``session``'s region."""

    session: str
    slot: int
    chunk_index: int
    nbytes: int
    checksum: int | None = None

    def __post_init__(self) -> None:
        values = (self.slot, self.chunk_index, self.nbytes)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in values) or self.nbytes < 0:
            raise WeightSyncError(
                f"a chunk handle's slot, chunk index and size must be ints, got {self.slot!r}, "
                f"{self.chunk_index!r}, {self.nbytes!r}"
            )


def pack_chunk(
    sender: SlotPacker, chunk_index: int, slot: int, sources: Sequence[torch.Tensor], verify: bool = False
) -> ChunkHandle:
    """Pack chunk ``chunk_index`` into ``slot``; its bytes are complete when this returns."""
    checksum = sender.pack_slot(chunk_index, slot, sources, verify)
    session = sender.export_session
    assert session is not None
    nbytes = sender.manifest.chunks[chunk_index].nbytes
    return ChunkHandle(session=session, slot=slot, chunk_index=chunk_index, nbytes=nbytes, checksum=checksum)


def consume_chunk(
    receiver: SlotReader,
    handle: ChunkHandle,
    unpacker: ChunkUnpacker,
    deliver: Callable[[list[tuple[str, torch.Tensor]]], None],
    verify: bool = False,
) -> int | None:
    """Copy chunk ``handle`` out of its slot into the sink, synchronized on return. Refuses,
    before reading a byte, a handle from another session or a size that disagrees with the plan."""
    name = receiver.name
    if handle.session != receiver.export_session:
        raise WeightSyncError(
            f"{name}: chunk handle belongs to session {handle.session}, attached to "
            f"{receiver.export_session}: a handle from a previous session; nothing was read"
        )
    chunks = receiver.manifest.chunks
    if 0 <= handle.chunk_index < len(chunks) and handle.nbytes != chunks[handle.chunk_index].nbytes:
        raise WeightSyncError(
            f"{name}: chunk {handle.chunk_index} handle says {handle.nbytes} bytes, "
            f"the plan says {chunks[handle.chunk_index].nbytes}"
        )
    return receiver.read_slot(handle.chunk_index, handle.slot, unpacker, deliver, verify, handle.checksum)
