"""One-copy colocated transfer: the trainer writes straight into the worker's tensors.

At setup the worker moves its synced tensors into one region it exports (CUDA IPC on a
GPU; ``/dev/shm`` on a CPU), laid out at aligned offsets, and rebinds each tensor to its
view of the region; the trainer maps the region once. A sync is then one copy of each
tensor from the trainer's parameter into its mapped destination, with no packing buffer
and no second copy: on a GPU one kernel launch over a table of all of them
(``batched_copy``), elsewhere (and for casts to the wire dtype) one ``copy_`` per tensor.

Each export carries a small control block, so a sync is one call per side, started
together, with no Ray round trip between them::

    worker (DirectTarget.receive)            trainer (DirectWriter.send, per worker)
      a tensor's dtype or shape left the       plans the copies, waits for the announcement
        manifest? -> fail, naming it           "stale": writes nothing, names the worker
      storage moved? -> announce "stale"       "ready": copies, synchronizes, (checksums
      else announce "ready"                       with verify), "written"
      wait for "written" (check checksums)
    the receiver commits the version

A worker whose tensors moved since its export (a new tensor object or data pointer) is
never written: the coordinator re-exports it and runs the sync again for that worker. A
tensor whose dtype or shape changed is never written at all: the sync fails naming it.
The worker must not read its weights between its announcement and its commit (an
inference engine pauses generation, as it does for any in-place weight update).

The worker's half lives in :mod:`weightsync.transports.direct.target`, the trainer's in
:mod:`weightsync.transports.direct.writer`, the control words both read in
:mod:`weightsync.transports.direct.handoff`; this module names the two halves.
"""

from weightsync.transports.direct.target import DirectTarget
from weightsync.transports.direct.writer import DirectWriter

__all__ = ["DirectTarget", "DirectWriter"]
