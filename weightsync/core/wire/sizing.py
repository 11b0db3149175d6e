"""``buffer_bytes="auto"``: how big the packing buffers are, decided once, on the trainer.

The size is the smallest of three bounds, rounded to the alignment:

* what the model needs: the bytes of every tensor laid out at aligned offsets (one buffer
  then holds the whole model and a sync is one chunk; more would be memory for nothing);
* the knee of the device: past it, bigger buffers buy little speed (the constants below,
  measured, with where they came from);
* free memory: ``num_buffers`` buffers may take at most :data:`MEMORY_SHARE` of the free
  memory of the party with the least (each side of a broadcast holds its own buffers; ipc
  slots live on the trainer's device, in /dev/shm on CPU).

On a GPU whose every slotted transport copies in and out of its slots on the trainer's
device (``Slots.ONE_DEVICE``: ipc), the memory of ``num_buffers`` slots goes into one slot
(measured: :func:`resolve_buffers`): the two processes' kernels are time-sliced, so a second slot
overlaps nothing, and fewer, larger chunks mean fewer hand-offs between them.

Call order: every party's :func:`free_memory_bytes` travels in its ``EndpointInfo``
(``ws_describe``) -> the coordinator gathers them, and whether every slotted transport of
the session shares the trainer's device, into :class:`BufferHints` -> the trainer's
``WeightSender.manifest(settings, hints)`` calls :func:`resolve_buffers` and puts the size
and count in the Manifest, which every worker checks like explicit ones.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.manifest import TensorSpec
from weightsync.core.wire.plan import align_up
from weightsync.core.wire.settings import GIB, MIB

#: CUDA knee, measured on the H200 test machine, 2026-12-03 (docs/benchmarks-history.md,
#: "run 4"): 16.6 GB bf16 model over ipc, trainer and worker sharing the GPU, 2 slots:
#: 256 MiB 31.1 ms, 512 MiB 25.8, 1 GiB 22.6, 2 GiB 21.2, 4 GiB 21.5 (3 slots of 4 GiB:
#: 20.9). The gain stops at 2 GiB; the share of free memory below caps it where memory is
#: tight (an inference engine holding most of the GPU).
CUDA_KNEE_BYTES = 2 * GIB

#: CPU knee, measured on the 2-core development machine (docs/benchmarks-history.md, "Buffer
#: size on CPU", 2026-12-03, noisy shared machine): shared-memory ipc, 2 slots. 256 MB model:
#: 4 MiB 27.6 ms, 8 MiB 22.9, 16 MiB 33.4-36.3, 32 MiB 37.0, 64 MiB 37.0-40.8, 256 MiB 41.3;
#: 1 GB model: 8 MiB 112-114 ms, 16 MiB 106, 64 MiB 98. On a CPU small slots stay in cache,
#: so there is no knee upwards: 16 MiB is within ~10% of the best at both sizes.
CPU_KNEE_BYTES = 16 * MIB

#: The largest share of a party's free memory that its ``num_buffers`` buffers may take.
MEMORY_SHARE = 0.25

KNEES = {"cpu": CPU_KNEE_BYTES, "cuda": CUDA_KNEE_BYTES}


@dataclass(frozen=True, kw_only=True)
class BufferHints:
    """What the trainer needs to know about the other parties to size buffers."""

    device: str
    #: Free memory of every party that reported it (bytes), the trainer's included.
    free_bytes: tuple[int, ...] = ()
    #: Whether every transport of the session that uses slots copies through them on the
    #: trainer's device alone (``Slots.ONE_DEVICE``), and one does: on a GPU, "auto" then
    #: makes one slot.
    one_device: bool = False

    def __post_init__(self) -> None:
        if self.device not in KNEES:
            raise SettingsError(f"buffer hints: device must be one of {sorted(KNEES)}, got {self.device!r}")
        if any(not isinstance(b, int) or isinstance(b, bool) or b < 0 for b in self.free_bytes):
            raise SettingsError(f"buffer hints: free_bytes must be non-negative integers, got {self.free_bytes!r}")
        if not isinstance(self.one_device, bool):
            raise SettingsError(f"buffer hints: one_device must be True or False, got {self.one_device!r}")


def needed_bytes(specs: Sequence[TensorSpec], alignment: int) -> int:
    """The bytes of every tensor at aligned offsets: one buffer this big holds the model."""
    cursor = 0
    for spec in specs:
        cursor = align_up(cursor, alignment) + spec.nbytes
    return align_up(max(cursor, 1), alignment)


def resolve_buffers(
    buffer_bytes: int | str, specs: Sequence[TensorSpec], num_buffers: int, alignment: int, hints: BufferHints
) -> tuple[int, int]:
    """The (size, count) of the slots: ``buffer_bytes`` and ``num_buffers`` themselves when
    the size is a number; for ``"auto"`` the size described above, and on a GPU whose slots
    are all filled and drained on one device, one slot holding the memory of ``num_buffers``."""
    if buffer_bytes != "auto":
        assert isinstance(buffer_bytes, int)
        return buffer_bytes, num_buffers
    # Measured on the H100 test machine, 2026-12-06 (docs/benchmarks.md, "One ipc slot on a
    # GPU"): a 16.6 GB bf16 model over ipc, trainer and worker sharing the GPU, median of 18
    # syncs in two interleaved rounds, slot size x count: 2 GiB x 2 28.49 ms, 4 GiB x 1 27.22,
    # 8 GiB x 1 27.31, 4 GiB x 2 28.47, 2 GiB x 1 28.82, 1 GiB x 2 29.09, 1 GiB x 1 31.75. In
    # the memory of two knee-sized slots, one slot is 4.5% faster; a larger one buys nothing.
    slots = 1 if hints.one_device and hints.device == "cuda" else num_buffers
    size = min(needed_bytes(specs, alignment), KNEES[hints.device] * num_buffers // slots)
    if hints.free_bytes:
        size = min(size, int(min(hints.free_bytes) * MEMORY_SHARE) // slots)
    return max(alignment, size // alignment * alignment), slots


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory a party could still give to buffers: free device memory on a GPU; on a CPU
    the smaller of available RAM and free /dev/shm (ipc slots live there). None if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        st = os.statvfs("/dev/shm")
        found.append(st.f_bavail * st.f_frsize)
    except OSError:
        pass
    return min(found) if found else None
