"""The size header of :mod:`weightsync.packed_tensor`'s broadcasts: a mismatch raises, by name.

vLLM's broadcast consumer derives each chunk's size from its own metadata and
``buffer_size_bytes`` and receives that many bytes. When either differs from the producer's,
the chunk sizes differ: a larger receive unpacks the next chunk's bytes as this one's (wrong
tensors, reported as success), a smaller one aborts the process inside gloo.

With the header (weightsync on both sides, the default), the producer broadcasts four
int64 words before each chunk, and once more, zeroed, after the last::

    MAGIC, the producer's buffer_size_bytes, the chunk's bytes, the chunk's tensor count

The consumer compares them with the chunk its metadata makes before receiving any data, so a
mismatch (or a stream that ends early or late) raises :class:`ValueError` naming the chunk's
first tensor and both sides' numbers. vLLM's own module sends and expects no header: pass
``size_header=False`` on the weightsync side to talk to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

MAGIC = 0x5753504B48  # "WSPKH"
WORDS = 4


def send(group: Any, src: int, device: torch.device, buffer_size_bytes: int, nbytes: int, ntensors: int) -> None:
    """Broadcast the header of a chunk of ``nbytes`` in ``ntensors`` (0, 0: the end)."""
    words = torch.tensor([MAGIC, buffer_size_bytes, nbytes, ntensors], dtype=torch.int64, device=device)
    group.broadcast(words, src=src)


def expect(
    group: Any,
    src: int,
    device: torch.device,
    buffer_size_bytes: int,
    metas: Sequence[tuple[str, list[int], torch.dtype, int]],
    chunk: int,
) -> None:
    """Receive the producer's next header and check it against the chunk ``metas`` make
    (none: the end of the stream); raise :class:`ValueError` naming what differs."""
    words = torch.zeros(WORDS, dtype=torch.int64, device=device)
    group.broadcast(words, src=src)
    magic, their_buffer, their_bytes, their_count = (int(w) for w in words.tolist())
    if magic != MAGIC:
        raise ValueError(
            f"chunk {chunk}: the producer sent no size header (word {magic:#x}, expected {MAGIC:#x}); a producer "
            "without one is vLLM's own module or weightsync's with size_header=False: pass size_header=False here too"
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
