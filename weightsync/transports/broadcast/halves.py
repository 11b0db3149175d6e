"""Packed, multi-buffer broadcast over any :class:`Communicator` (gloo on CPU, NCCL on GPU),
with large tensors sent in place.

Both sides walk the Manifest's broadcast plan (``Manifest.broadcast_chunks``). A packed
chunk: the producer (rank 0, the trainer) packs it into buffer ``p % num_buffers`` (p counts
packed chunks) and starts its broadcast asynchronously, so with two or more buffers packing
chunk p+1 overlaps sending chunk p; each receiver unpacks it out of its own buffer. An
in-place chunk (one tensor of at least ``inplace_bytes``): the trainer broadcasts the
tensor's own storage when it is contiguous and of the wire dtype (else a contiguous
wire-dtype temporary, alive until its broadcast completed: at most ``num_buffers`` of them
at once), and a receiver whose sink gives a contiguous tensor of that dtype and shape
receives straight into it; any other receiver (a strided or differently typed destination,
a ``load_weights`` sink) receives into one reused scratch buffer, the size of the largest
such tensor, and unpacks from there exactly as it unpacks a packed chunk. In-place
operations hold no buffer, so both sides keep up to :data:`INPLACE_DEPTH` of them in flight
(``num_buffers`` when that is larger): on a CPU every gloo operation waits for a
receiver's ready message and a peer's wake-up, which several operations in flight hide
(docs/benchmarks.md, "CPU broadcast knobs"). Receivers keep that many operations posted
ahead, whatever their kind; a packed chunk still waits for its buffer. In-place operations
run on their own stream (on a GPU). Buffers are allocated once per session and reused; an
in-flight chunk's buffer stays referenced until its broadcast completed, and both sides
drain every stream before returning. With ``verify``, every chunk has a checksum on both sides.

Every sync starts with an agreement, one tiny all-reduce in which each rank says whether it
can go ahead: a rank that failed before any byte moved (a worker refusing the version, a
trainer whose model changed) says no there, and every rank stops at once, naming it, with
the group intact and nobody's weights touched. A failure after that aborts the group, which
fails every peer's pending operation instead of leaving it to its deadline. In a delta
session the delta header (:mod:`weightsync.core.delta.header`) follows the agreement, and
the plan it announces (the Manifest's, or the payloads') is the one walked. Per sync::

    BroadcastSender.send(sources, call)              # rank 0
    BroadcastReceiver.receive(sink, call, begin)     # ranks 1..N

The group both halves share lives in :mod:`weightsync.transports.broadcast.group`, the
trainer's half in :mod:`weightsync.transports.broadcast.sender`, a worker's in
:mod:`weightsync.transports.broadcast.receiver`; this module names them.
"""

from weightsync.transports.broadcast.group import INPLACE_DEPTH, Communicator, PackedGroup, Work
from weightsync.transports.broadcast.receiver import BroadcastReceiver
from weightsync.transports.broadcast.sender import BroadcastSender

__all__ = ["INPLACE_DEPTH", "BroadcastReceiver", "BroadcastSender", "Communicator", "PackedGroup", "Work"]
