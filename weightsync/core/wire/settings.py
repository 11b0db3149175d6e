"""The settings of one WeightSync, validated once, on the coordinator, before any actor is asked.

The trainer's copy of these numbers is the one that counts: they travel to every worker
inside the Manifest, so a worker configured differently is refused in the handshake instead
of hanging a collective later (TRL #7104 hung NCCL that way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from weightsync.core.wire.errors import SettingsError

#: Byte units: every size in weightsync is a number of bytes, and a name that holds another
#: unit says so (``buffer_mib``); these turn one into the other.
MIB = 1 << 20
GIB = 1 << 30

# The one default of each setting; everything else that needs one imports it from here.

#: Byte alignment of every tensor in a buffer: the widest dtype a view may need, with room.
DEFAULT_ALIGNMENT = 256
#: A packing buffer's bytes where a number is needed and none was given (a Manifest built
#: directly); ``SyncSettings`` defaults to ``"auto"`` (:mod:`weightsync.core.wire.sizing`).
DEFAULT_BUFFER_BYTES = 256 * MIB
#: Tensors of at least this many bytes on the wire are broadcast in place (their own
#: collective, straight from the trainer's storage into the worker's), not packed. Chosen
#: by measurement: docs/benchmarks.md ("CPU broadcast knobs": scripts/broadcast_sweep.py) and
#: docs/benchmarks-history.md ("In-place threshold": scripts/inplace_threshold.py).
DEFAULT_INPLACE_BYTES = 4 * MIB
#: Buffers in rotation: two let packing chunk k+1 overlap moving chunk k.
DEFAULT_NUM_BUFFERS = 2
#: Seconds any wait of a sync may take (see :class:`~weightsync.core.wire.session.Deadlines`).
DEFAULT_TIMEOUT_S = 120.0
#: Seconds any call into an inference engine may take (the ``timeout_s`` of the vLLM engine
#: actors and of a server worker, per call and per HTTP request): a bound on the engine
#: answering at all (a generate, a load with its reload lifecycle, a protocol call whose
#: own waits are the sync's), so longer than a sync's.
DEFAULT_ENGINE_TIMEOUT_S = 300.0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


BufferBytes = int | Literal["auto"]
DeltaBase = Literal["device", "host"]


def check_delta_settings(delta: object, keyframe: object, base: object) -> None:
    """Refuse delta settings that mean nothing; each message names the setting."""
    if not isinstance(delta, bool):
        raise SettingsError(f"delta must be True or False, got {delta!r}")
    if keyframe is not None and (not _is_int(keyframe) or keyframe < 1):  # type: ignore[operator]
        raise SettingsError(f"delta_keyframe must be None or a positive number of syncs, got {keyframe!r}")
    if base not in ("device", "host"):
        raise SettingsError(f"delta_base must be 'device' or 'host', got {base!r}")


def check_buffer_settings(
    buffer_bytes: object, num_buffers: object, alignment: object, inplace_bytes: object = 0, auto: bool = False
) -> None:
    """Refuse buffer settings that cannot be laid out; each message names the setting.

    ``auto``: ``buffer_bytes="auto"`` is allowed (settings, before the trainer resolves it);
    a Manifest always carries a number.
    """
    if not _is_int(alignment) or alignment < 16 or alignment & (alignment - 1):  # type: ignore[operator]
        raise SettingsError(
            f"alignment must be a power of two of at least 16 bytes (the widest dtype), got {alignment!r}"
        )
    if not (auto and buffer_bytes == "auto") and (
        not _is_int(buffer_bytes) or buffer_bytes < alignment or buffer_bytes % alignment  # type: ignore[operator]
    ):
        expected = '"auto" or a positive multiple' if auto else "a positive multiple"
        raise SettingsError(
            f"buffer_bytes must be {expected} of the alignment ({alignment} bytes), got {buffer_bytes!r}; "
            f"round it to a multiple of {alignment}" + (' or pass "auto"' if auto else "")
        )
    if not _is_int(inplace_bytes) or inplace_bytes < 0:  # type: ignore[operator]
        raise SettingsError(
            f"inplace_bytes must be a non-negative integer (0 turns in-place broadcast off), got {inplace_bytes!r}"
        )
    if not _is_int(num_buffers) or num_buffers < 1:  # type: ignore[operator]
        raise SettingsError(f"num_buffers must be a positive integer, got {num_buffers!r}")


def check_timeout(timeout_s: object) -> float:
    """A finite, positive number of seconds, or SettingsError naming ``timeout_s``."""
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool):
        raise SettingsError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise SettingsError(f"timeout_s must be finite and positive, got {timeout_s!r}")
    return float(timeout_s)


@dataclass(frozen=True, kw_only=True)
class SyncSettings:
    """How a WeightSync moves bytes. Every field is checked on construction.

    Call order: ``SyncSettings(...)`` (or keywords to ``WeightSync``) -> the trainer builds
    the Manifest from ``buffer_bytes``/``num_buffers``/``alignment`` -> workers check it.
    """

    buffer_bytes: BufferBytes = "auto"
    """Bytes per packing buffer (ipc slot, broadcast buffer): ``"auto"`` (the trainer picks
    it at setup from the model and every party's free memory, capped by the device's knee:
    :mod:`weightsync.core.wire.sizing`), or a multiple of ``alignment``, which always wins."""

    num_buffers: int = DEFAULT_NUM_BUFFERS
    """Buffers in rotation: with two or more, packing chunk k+1 overlaps moving chunk k.
    With ``buffer_bytes="auto"`` on a GPU whose slots are all ipc's (both sides copy on that
    GPU, time-sliced: nothing to overlap), one slot holding the memory of this many."""

    alignment: int = DEFAULT_ALIGNMENT
    """Byte alignment of every tensor in a buffer (a power of two >= 16), so any dtype view is legal."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    """Bound on every wait of a call; a dead or frozen peer is named within about this long."""

    inplace_bytes: int = DEFAULT_INPLACE_BYTES
    """Broadcast only: tensors of at least this many bytes on the wire get their own
    collective, sent from the trainer's tensor and received into the worker's, with no pack
    or unpack copy (a worker whose tensor is not a plain contiguous tensor of the wire dtype
    receives into a reused scratch buffer of the largest such tensor instead). 0 packs
    everything. Fixed in the Manifest, so both sides derive the same plan; ipc and direct
    ignore it."""

    verify: bool = False
    """Check each sync's bytes on the worker before it commits (chunk checksums for ipc and
    broadcast, per-tensor checksums for direct)."""

    gather_bytes: int | None = None
    """Sharded trainers only: the most bytes of full tensors a rank gathers at once (one
    bucket; a larger tensor is gathered alone), which bounds the rank's extra memory.
    None: as large as one buffer. Set it to keep gathers small under a large transfer
    buffer; each rank's own, not part of the Manifest."""

    lora: bool = False
    """Send only the trainer's PEFT LoRA adapter (the active one), not the model: its
    config goes to every worker in the Manifest, which refuses one it cannot serve. A
    module worker must hold the same PEFT model; a vLLM engine needs ``enable_lora=True``.
    See :mod:`weightsync.core.lora`."""

    delta: bool = False
    """Send only what changed: a sync to a worker that holds the trainer's last sent bytes
    carries, per tensor, either its dense bytes or its changed elements (indices or a
    bitmask, plus their new bit patterns), whichever is smaller; every other sync, and every
    sync to a worker that does not hold those bytes (new, dirty, failed, rejoined), is
    dense. Over broadcast, ipc and owners; direct, owner-writes and rank-ipc stay dense
    (see docs/transports.md). The trainer keeps a copy of the wire bytes (``delta_base``)."""

    delta_keyframe: int | None = None
    """With ``delta``: every this many syncs, one dense sync to every worker (None: only
    where needed)."""

    delta_base: DeltaBase = "device"
    """With ``delta``: where the trainer keeps its copy of the last sent wire bytes: on its
    own device (fastest to compare against), or in host memory (``"host"``: no device
    memory, at the cost of copying each tensor to the host to compare it)."""

    reply_board: bool = True
    """Parties on the coordinator's host also leave their answers to a sync's calls in
    shared memory the coordinator polls, sparing each sync Ray's return leg (0.3-1 ms
    measured); False: every answer comes through Ray. See :mod:`weightsync.glue.replies`."""

    def __post_init__(self) -> None:
        check_buffer_settings(self.buffer_bytes, self.num_buffers, self.alignment, self.inplace_bytes, auto=True)
        check_delta_settings(self.delta, self.delta_keyframe, self.delta_base)
        if self.gather_bytes is not None and (
            not isinstance(self.gather_bytes, int) or isinstance(self.gather_bytes, bool) or self.gather_bytes < 1
        ):
            raise SettingsError(f"gather_bytes must be None or a positive number of bytes, got {self.gather_bytes!r}")
        object.__setattr__(self, "timeout_s", check_timeout(self.timeout_s))
        if not isinstance(self.verify, bool):
            raise SettingsError(f"verify must be True or False, got {self.verify!r}")
        if not isinstance(self.lora, bool):
            raise SettingsError(f"lora must be True or False, got {self.lora!r}")
        if not isinstance(self.reply_board, bool):
            raise SettingsError(f"reply_board must be True or False, got {self.reply_board!r}")

    def with_overrides(self, **overrides: Any) -> SyncSettings:
        """A copy with the given fields replaced (None means keep); unknown names are refused."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise SettingsError(f"unknown setting(s) {unknown}; known: {sorted(known)}")
        given = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, **given) if given else self
