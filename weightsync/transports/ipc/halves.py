"""Packed transfer through slots the trainer exports once and each worker maps once.

For a trainer and workers on one device (one GPU, or one host on CPU) whose sink transforms
tensors on load, where a collective is impossible (NCCL refuses two ranks on one GPU). The
producer allocates ``num_buffers`` slots (never more than the plan has chunks:
``Manifest.depth``) in one exported region and packs chunk k into slot ``k % num_buffers``;
each consumer copies out of its mapping of the same memory.

Per sync, one call per side (``send`` and ``receive``, started together). Slots are handed
over on the control block: the producer publishes chunk g after its bytes are visible, each
consumer acknowledges g after its copy out finished, and the producer writes slot
``g % num_buffers`` only once every consumer acknowledged chunk ``g - num_buffers``; so with
two slots the producer packs chunk k+1 while consumers read chunk k, and a slot is never
rewritten while anyone reads it. On a GPU no side waits on the host per chunk: the producer
records an interprocess CUDA event after packing a slot and publishes at once; a consumer's
stream waits on it, unpacks, records its own event and acknowledges; the producer's stream
waits on every consumer's event before packing that slot again. Each side synchronizes
once, at the end of a sync. With CuPy, packing and unpacking a chunk are one launch of the
batched copy kernel each (:mod:`weightsync.transports.ipc.slot_copies`). Two processes'
kernels on one GPU take turns in time slices, so there a second slot overlaps nothing:
with ``buffer_bytes="auto"`` the slots' memory goes into one (the plug-in declares
``Slots.ONE_DEVICE``; :mod:`weightsync.core.wire.sizing`). Chunks are
numbered from the session's start (the control block's counts; :mod:`~weightsync.transports.ipc.handoff`),
so a sync may move any number of them: in a delta session (:mod:`weightsync.core.delta`)
the first chunk of every sync is the delta header, and the chunks of the plan it
announces (the session's, or the payloads') follow.

Both halves are made from their party's Session: the consumers name the trainer party that
serves them (``session.server``) when it fails or is late. ``IpcSender.pack_slot`` and
``IpcReceiver.read_slot`` move one chunk through one slot, synchronized, for callers that
hand chunks over themselves (the bench's model of the reference design): such a caller must
not pack into a slot again before every consumer's read of it returned.

The producer lives in :mod:`weightsync.transports.ipc.producer`, the consumer in
:mod:`weightsync.transports.ipc.consumer`, the control words both read in
:mod:`weightsync.transports.ipc.handoff`; this module names the two halves.
"""

from weightsync.transports.ipc.consumer import IpcReceiver
from weightsync.transports.ipc.producer import IpcSender

__all__ = ["IpcReceiver", "IpcSender"]
