"""The opt-in size header of :mod:`weightsync.packed_tensor`'s broadcasts, and how a side
that uses it and a side that does not are told apart.

vLLM's broadcast consumer derives each chunk's size from its own metadata and
``buffer_size_bytes`` and receives that many bytes. When either differs from the producer's,
the chunk sizes differ: on gloo a larger receive takes the shorter message and returns
success with the rest of the buffer unwritten (wrong tensors), a smaller one aborts the
process; on NCCL the ranks hang or read the next chunk's bytes.

With ``size_header=True`` on both sides (both weightsync), the producer broadcasts four
int64 words before each chunk, and once more, zeroed, after the last::

    MAGIC, the producer's buffer_size_bytes, the chunk's bytes, the chunk's tensor count

and the consumer compares them with the chunk its metadata makes before receiving any data,
so a mismatch (or a stream that ends early or late) raises :class:`ValueError` naming the
chunk's first tensor and both sides' numbers. The header is not on vLLM's wire, so it is off
by default.

A side with the header facing a side without it is named where the transport allows it.
Gloo delivers a shorter message into a larger receive and aborts on a longer one, so on CPU:

- a consumer with the header receives the first header into room for its first chunk
  (:func:`expect`'s ``room``): a header-less producer's first chunk lands there whole and,
  lacking the magic word, is refused by name instead of aborting the process;
- a consumer without it (the default) looks for a header at the start of its first chunk
  (:func:`refuse_if_header`): a header-sending producer's 32 bytes are refused by name
  instead of unpacked as weights. A first chunk under 32 bytes cannot hold the header, and
  gloo aborts that receive.

On CUDA (NCCL) sizes must match exactly, so no receive is enlarged and nothing is looked
for: the two sides must agree on ``size_header``. vLLM's own consumer never looks, so a
weightsync producer with the header feeding it goes unnoticed: keep the default there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

MAGIC = 0x5753504B48  # "WSPKH"
WORDS = 4
#: Bytes of one header on the wire.
HEADER_BYTES = WORDS * 8

_HEADERLESS_PRODUCER = (
    "a producer without one is vLLM's own module or weightsync's with the default size_header=False: "
    "pass size_header=False here too, or size_header=True to a weightsync producer"
)


def send(group: Any, src: int, device: torch.device, buffer_size_bytes: int, nbytes: int, ntensors: int) -> None:
    """Broadcast the header of a chunk of ``nbytes`` in ``ntensors`` (0, 0: the end)."""
    words = torch.tensor([MAGIC, buffer_size_bytes, nbytes, ntensors], dtype=torch.int64, device=device)
    group.broadcast(words, src=src)


def _words(received: torch.Tensor) -> list[int]:
    return [int(w) for w in received[:HEADER_BYTES].view(torch.int64).tolist()]


def expect(
    group: Any,
    src: int,
    device: torch.device,
    buffer_size_bytes: int,
    metas: Sequence[tuple[str, list[int], torch.dtype, int]],
    chunk: int,
    *,
    room: int = HEADER_BYTES,
) -> None:
    """Receive the producer's next header and check it against the chunk ``metas`` make
    (none: the end of the stream); raise :class:`ValueError` naming what differs.

    ``room`` (at least :data:`HEADER_BYTES`) is how many bytes the receive may take: more
    only over gloo, for the first header, so a header-less producer's first chunk is caught.
    """
    received = torch.empty(max(room, HEADER_BYTES), dtype=torch.uint8, device=device)
    received[:HEADER_BYTES].zero_()  # a message shorter than a header leaves no stale magic behind
    group.broadcast(received, src=src)
    magic, their_buffer, their_bytes, their_count = _words(received)
    if magic != MAGIC:
        where = f"chunk {chunk}" + (f" (from tensor {metas[0][0]!r})" if metas else "")
        raise ValueError(
            f"{where}: this consumer expects a size header (size_header=True) and the producer sent none "
            f"(word {magic:#x}, expected {MAGIC:#x}); {_HEADERLESS_PRODUCER}"
        )
    my_bytes = sum(m[3] for m in metas)
    if (their_bytes, their_count) == (my_bytes, len(metas)):
        return
    settings = f"producer buffer_size_bytes={their_buffer}, this consumer's={buffer_size_bytes}"
    if not metas:
        raise ValueError(
            f"the producer sends more than this consumer's metadata lists: chunk {chunk} of {their_count} tensors "
            f"({their_bytes} bytes) follows its last tensor ({settings}); give the consumer the producer's "
            "tensors, in its order"
        )
    first = metas[0][0]
    if their_count == 0:
        raise ValueError(
            f"the producer ended before tensor {first!r} (chunk {chunk}): this consumer's metadata lists tensors "
            f"it never sent ({settings})"
        )
    raise ValueError(
        f"chunk {chunk} (from tensor {first!r}): the producer sent {their_count} tensors in {their_bytes} bytes, "
        f"this consumer's metadata and buffer_size_bytes make {len(metas)} tensors in {my_bytes} bytes "
        f"({settings}); use the producer's buffer_size_bytes and the shapes and dtypes it sends"
    )


def receive_chunk(
    group: Any,
    src: int,
    device: torch.device,
    buffer_size_bytes: int,
    metas: Sequence[tuple[str, list[int], torch.dtype, int]],
    chunk: int,
    size_header: bool,
) -> torch.Tensor | None:
    """Receive chunk number ``chunk``, whose tensors ``metas`` lists, into a new uint8 tensor,
    with its header first when ``size_header``; None for the header that ends the stream.

    Over gloo (a CPU ``device``) the first receive is where a peer with the other
    ``size_header`` shows: it is checked for that (see the module's docstring).
    """
    nbytes = sum(m[3] for m in metas)
    first_on_gloo = chunk == 0 and device.type == "cpu"
    if size_header:
        expect(group, src, device, buffer_size_bytes, metas, chunk, room=nbytes if first_on_gloo else HEADER_BYTES)
    if not metas:
        return None
    packed = torch.empty(nbytes, dtype=torch.uint8, device=device)
    group.broadcast(packed, src=src)
    if first_on_gloo and not size_header:
        refuse_if_header(packed, metas[0][0])
    return packed


def refuse_if_header(received: torch.Tensor, first: str) -> None:
    """Raise :class:`ValueError` when the first chunk a header-less consumer received opens
    with a weightsync size header (the producer passed ``size_header=True``).

    All four words must be a header's (the magic word, a positive buffer size and tensor
    count, a non-negative byte count), so weights that merely start with the magic word's
    eight bytes are not mistaken for one.
    """
    if received.numel() < HEADER_BYTES:
        return
    magic, their_buffer, their_bytes, their_count = _words(received)
    if magic == MAGIC and their_buffer > 0 and their_bytes >= 0 and their_count > 0:
        raise ValueError(
            f"chunk 0 (from tensor {first!r}): the producer sent a weightsync size header (its buffer_size_bytes="
            f"{their_buffer}, a chunk of {their_count} tensors in {their_bytes} bytes) where this consumer expects "
            "vLLM's header-less wire: pass size_header=True to this consumer too, or leave the producer's "
            "size_header at its default (False)"
        )
