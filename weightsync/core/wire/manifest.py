"""The wire contract: what both sides of a weight sync agree on before a byte moves.

A :class:`Manifest` is built once, on the trainer, and sent to every worker in the
handshake. It fixes the tensor order, the wire dtypes, the buffer settings and the chunk
plan (:func:`plan_chunks`, a pure function of the specs and the settings), so that nothing
but raw bytes travels at sync time and a worker configured differently is refused at setup
instead of hanging a collective later.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from weightsync.core.wire.adapter import AdapterConfig
from weightsync.core.wire.casts import CASTABLE, TensorCast, castable
from weightsync.core.wire.dtypes import ALLOWED_DTYPES, dtype_from_name, dtype_name
from weightsync.core.wire.errors import ManifestError, SettingsError
from weightsync.core.wire.plan import Chunk, align_up, plan_broadcast, plan_chunks
from weightsync.core.wire.settings import (
    DEFAULT_ALIGNMENT,
    DEFAULT_BUFFER_BYTES,
    DEFAULT_INPLACE_BYTES,
    DEFAULT_NUM_BUFFERS,
    check_buffer_settings,
)

#: 3: the Manifest carries the in-place threshold and the broadcast plan; 4: and, for a
#: LoRA sync, the adapter's config; 5: and whether every sync starts with a delta header
#: (``AgreedSettings.delta``).
PROTOCOL_VERSION = 5


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor as it travels: its name, shape and wire dtype (by allow-listed name)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ManifestError(f"tensor name must be a non-empty string, got {self.name!r}")
        shape = tuple(self.shape)
        if any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
            raise ManifestError(f"tensor {self.name!r}: shape {self.shape!r} must be non-negative integers")
        object.__setattr__(self, "shape", shape)
        dtype_from_name(self.dtype, self.name)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> TensorSpec:
        """The spec of ``tensor`` as sent under ``name``, optionally cast to ``dtype``."""
        return cls(name, tuple(tensor.shape), dtype_name(dtype or tensor.dtype, name))

    @property
    def torch_dtype(self) -> torch.dtype:
        return ALLOWED_DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    def __reduce__(self) -> tuple[type[TensorSpec], tuple[str, tuple[int, ...], str]]:
        # Rebuilt through the constructor, so what arrives is validated again (and pickled
        # faster than a frozen, slotted dataclass's own state, which walks its fields).
        return TensorSpec, (self.name, self.shape, self.dtype)

    def mismatch(self, tensor: torch.Tensor) -> str | None:
        """Why ``tensor`` cannot receive this spec's bytes without a cast or a broadcast, or None."""
        if tuple(tensor.shape) != self.shape:
            return f"{self.name}: shape {list(tensor.shape)}, the manifest says {list(self.shape)}"
        if tensor.dtype != self.torch_dtype:
            return f"{self.name}: dtype {tensor.dtype}, the manifest says {self.dtype}"
        return None


@dataclass(frozen=True, kw_only=True)
class AgreedSettings:
    """The settings both sides of a transfer must share, fixed by the trainer at setup.

    The chunk plans derive from them; a worker pinned to other values is refused in the
    handshake (:meth:`Manifest.check_buffer_expectations`). ``buffer_bytes`` is a number
    here: ``"auto"`` was resolved by the trainer.
    """

    buffer_bytes: int
    """Bytes per packing buffer (ipc slot, broadcast buffer)."""

    num_buffers: int
    """Buffers in rotation on each side."""

    alignment: int
    """Byte alignment of every tensor in a buffer or region."""

    inplace_bytes: int
    """Broadcast: tensors of at least this many bytes get their own collective (0: none)."""

    delta: bool = False
    """Every sync over a transport that carries deltas starts with a delta header
    (:mod:`weightsync.core.delta.header`), which says whether a dense plan or a payload
    plan follows."""

    def __post_init__(self) -> None:
        check_buffer_settings(self.buffer_bytes, self.num_buffers, self.alignment, self.inplace_bytes)
        if not isinstance(self.delta, bool):
            raise SettingsError(f"delta must be True or False, got {self.delta!r}")


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Everything both sides derive a transfer from, fixed by the trainer at setup.

    Build it with :meth:`build` (which computes the chunk plans); a receiver checks it with
    :meth:`validate` and :meth:`check_against` before joining any collective.

    Two plans: ``chunks`` packs every tensor (ipc slots; direct uses :meth:`region_layout`);
    ``broadcast_chunks`` sends tensors of at least ``agreed.inplace_bytes`` in place and
    packs the rest (:func:`plan_broadcast`). ``adapter``: set when the specs are a LoRA
    adapter's tensors (``WeightSync(lora=True)``), what they mean (:mod:`~weightsync.core.wire.adapter`).
    """

    specs: tuple[TensorSpec, ...]
    agreed: AgreedSettings
    chunks: tuple[Chunk, ...]
    broadcast_chunks: tuple[Chunk, ...]
    total_bytes: int
    protocol_version: int = PROTOCOL_VERSION
    adapter: AdapterConfig | None = None

    @classmethod
    def build(
        cls,
        specs: Iterable[TensorSpec],
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        alignment: int = DEFAULT_ALIGNMENT,
        inplace_bytes: int = DEFAULT_INPLACE_BYTES,
        delta: bool = False,
    ) -> Manifest:
        agreed = AgreedSettings(
            buffer_bytes=buffer_bytes,
            num_buffers=num_buffers,
            alignment=alignment,
            inplace_bytes=inplace_bytes,
            delta=delta,
        )
        return cls.planned(specs, agreed)

    @classmethod
    def planned(cls, specs: Iterable[TensorSpec], agreed: AgreedSettings) -> Manifest:
        """The Manifest of ``specs`` under ``agreed``, with both chunk plans derived."""
        spec_tuple = tuple(specs)
        check_specs(spec_tuple)
        a = agreed
        sizes = [s.nbytes for s in spec_tuple]
        total = sum(sizes)
        # Every chunk holds at most buffer_bytes of aligned pieces: refuse before planning
        # a plan too long to hold (a tiny buffer_bytes for a large model).
        least = -(-sum(align_up(n, a.alignment) for n in sizes) // a.buffer_bytes)
        _check_chunk_count(least, total, a)
        chunks = plan_chunks(spec_tuple, a.buffer_bytes, a.alignment, sizes)
        _check_chunk_count(len(chunks), total, a)
        inplace = a.inplace_bytes > 0 and max(sizes) >= a.inplace_bytes
        return cls(
            specs=spec_tuple,
            agreed=a,
            chunks=chunks,
            # Without in-place tensors both plans are one: shared, so it is held and sent once.
            broadcast_chunks=plan_broadcast(spec_tuple, a.buffer_bytes, a.alignment, a.inplace_bytes)
            if inplace
            else chunks,
            total_bytes=total,
        )

    def depth(self, plan: Sequence[Chunk]) -> int:
        """The buffers (slots) a transport rotates for ``plan``: ``num_buffers``, never more
        than the plan has chunks (both sides derive it, so a huge ``num_buffers`` costs
        nothing it cannot use)."""
        return max(1, min(self.agreed.num_buffers, len(plan)))

    @property
    def inplace_count(self) -> int:
        """How many tensors the broadcast plan sends in place."""
        return sum(1 for c in self.broadcast_chunks if c.inplace)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    def region_layout(self) -> tuple[tuple[int, ...], int]:
        """Aligned offsets of every spec in one region holding them all, and its size
        (the direct transport's layout of a worker's exported tensors)."""
        offsets = []
        cursor = 0
        for spec in self.specs:
            cursor = align_up(cursor, self.agreed.alignment)
            offsets.append(cursor)
            cursor += spec.nbytes
        return tuple(offsets), cursor

    def validate(self) -> None:
        """Re-derive the chunk plan from the specs and refuse a Manifest that disagrees.

        A receiver calls this on what it was sent: a plan computed by another version of
        the packing code, a different protocol version, or tampered numbers are refused
        here, by name, rather than producing misplaced bytes.
        """
        if self.protocol_version != PROTOCOL_VERSION:
            raise ManifestError(
                f"protocol version mismatch: the trainer speaks {self.protocol_version}, this "
                f"worker speaks {PROTOCOL_VERSION}; install the same weightsync version on both"
            )
        if self.adapter is not None:
            if not isinstance(self.adapter, AdapterConfig):
                raise ManifestError(
                    f"the manifest's adapter must be an AdapterConfig, got {type(self.adapter).__name__}"
                )
            replace(self.adapter)  # runs the checks that unpickling skipped
        try:
            if not isinstance(self.agreed, AgreedSettings):
                raise SettingsError(f"agreed settings must be AgreedSettings, got {type(self.agreed).__name__}")
            # replace() runs the checks again: unpickling skipped them.
            rebuilt = Manifest.planned(self.specs, replace(self.agreed))
        except SettingsError as exc:
            raise ManifestError(f"the trainer's manifest carries unusable buffer settings: {exc}") from exc
        if rebuilt.chunks != self.chunks or rebuilt.total_bytes != self.total_bytes:
            raise ManifestError(
                "the chunk plan sent by the trainer differs from the one this worker derives "
                "from the same specs; install the same weightsync version on both sides"
            )
        if rebuilt.broadcast_chunks != self.broadcast_chunks:
            raise ManifestError(
                f"the broadcast plan sent by the trainer (inplace_bytes={self.agreed.inplace_bytes}: "
                f"{self.inplace_count} tensor(s) in place, {len(self.broadcast_chunks)} chunk(s)) differs from "
                f"the one this worker derives with that threshold ({rebuilt.inplace_count} in place, "
                f"{len(rebuilt.broadcast_chunks)} chunk(s)); install the same weightsync version on both sides"
            )

    def check_against(
        self, local: Sequence[TensorSpec], who: str = "worker", may_cast: bool = False
    ) -> tuple[TensorCast, ...]:
        """Refuse this Manifest unless ``local`` holds the same tensors; returns the casts.

        Every mismatch is listed by tensor name in one error: missing on ``who``,
        unexpected on ``who``, shape and dtype differences, and what to set when dtypes
        differ. With ``may_cast`` (``who`` loads through a sink that casts), a floating
        tensor held in another castable dtype is no mismatch but a :class:`TensorCast`,
        returned in manifest order (:mod:`weightsync.core.wire.casts`). Order does not
        matter otherwise: the receiver places tensors by name.
        """
        problems = spec_mismatches(self.specs, local, who, may_cast)
        if problems:
            fix = _dtype_fix(self.specs, local, who, may_cast)
            raise ManifestError(
                f"{who} does not match the trainer's manifest ({len(problems)} problem(s)):\n  "
                + "\n  ".join(problems)
                + (f"\n{fix}" if fix else "")
            )
        if not may_cast:
            return ()
        mine = {s.name: s for s in local}
        return tuple(
            TensorCast(name=s.name, wire=s.dtype, held=mine[s.name].dtype)
            for s in self.specs
            if mine[s.name].dtype != s.dtype
        )

    def check_buffer_expectations(
        self,
        who: str,
        buffer_bytes: int | None = None,
        num_buffers: int | None = None,
        inplace_bytes: int | None = None,
    ) -> None:
        """Refuse the trainer's buffer settings where ``who`` was pinned to other values
        (``buffer_bytes`` is compared with the size the trainer resolved, "auto" or not)."""
        problems = []
        for label, mine, theirs in (
            ("buffer_bytes", buffer_bytes, self.agreed.buffer_bytes),
            ("num_buffers", num_buffers, self.agreed.num_buffers),
            ("inplace_bytes", inplace_bytes, self.agreed.inplace_bytes),
        ):
            if mine is not None and mine != theirs:
                problems.append(f"{label}: trainer uses {theirs}, {who} was configured with {mine}")
        if problems:
            raise ManifestError(
                f"{who} was configured with buffer settings that differ from the trainer's "
                f"(the trainer's settings are the ones used; drop the override on {who} or "
                "make them equal): " + "; ".join(problems)
            )


#: The most chunks one plan may hold: every chunk costs each side a little bookkeeping per
#: sync, and a plan this long means ``buffer_bytes`` is far too small for the model.
MAX_CHUNKS = 1 << 20


def _check_chunk_count(count: int, total_bytes: int, agreed: AgreedSettings) -> None:
    if count > MAX_CHUNKS:
        raise SettingsError(
            f"buffer_bytes={agreed.buffer_bytes} cuts {total_bytes} bytes of tensors into at least {count} chunks, "
            f"more than the {MAX_CHUNKS} one plan may hold: raise buffer_bytes (to at least "
            f"{-(-total_bytes // MAX_CHUNKS) + agreed.alignment}) or leave it at its default"
        )


def check_specs(specs: Sequence[TensorSpec]) -> None:
    if not specs:
        raise ManifestError(
            "the model has no parameters or buffers to sync; pass the model whose weights "
            "should move (an empty manifest would report success with no bytes sent)"
        )
    seen: set[str] = set()
    duplicates = []
    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise ManifestError(f"manifest entries must be TensorSpec, got {type(spec).__name__}")
        if spec.name in seen:
            duplicates.append(spec.name)
        seen.add(spec.name)
    if duplicates:
        raise ManifestError(f"duplicate tensor names in manifest: {', '.join(duplicates)}")


def spec_mismatches(
    expected: Sequence[TensorSpec], local: Sequence[TensorSpec], who: str = "worker", may_cast: bool = False
) -> list[str]:
    """Every difference between two spec lists, one readable line per tensor (with
    ``may_cast``, a castable dtype difference is none: see :func:`castable`)."""
    theirs = {s.name: s for s in expected}
    mine = {s.name: s for s in local}
    problems = []
    for name in theirs.keys() - mine.keys():
        problems.append(f"{name}: sent by the trainer but missing on {who}")
    for name in mine.keys() - theirs.keys():
        problems.append(f"{name}: present on {who} but not sent by the trainer")
    for name in theirs.keys() & mine.keys():
        t, m = theirs[name], mine[name]
        if t.shape != m.shape:
            problems.append(f"{name}: shape {list(t.shape)} on the trainer, {list(m.shape)} on {who}")
        if t.dtype != m.dtype and not (may_cast and castable(t.torch_dtype, m.torch_dtype)):
            problems.append(f"{name}: dtype {t.dtype} on the trainer, {m.dtype} on {who}")
    return sorted(problems)


def _dtype_fix(expected: Sequence[TensorSpec], local: Sequence[TensorSpec], who: str, may_cast: bool) -> str:
    """What to set when dtypes differ (empty when none does)."""
    mine = {s.name: s for s in local}
    refused = [
        (s.dtype, mine[s.name].dtype)
        for s in expected
        if s.name in mine
        and mine[s.name].dtype != s.dtype
        and not (may_cast and castable(s.torch_dtype, mine[s.name].torch_dtype))
    ]
    pairs = sorted(set(refused))
    if not pairs:
        return ""
    wire, held = pairs[0]
    why = (
        f"{who} loads through a sink that casts, but only between {sorted(dtype_name(d) for d in CASTABLE)}"
        if may_cast
        else f"{who} writes the wire's bytes into its tensors' storage (a module sink or a direct worker), so it "
        "cannot cast; a worker that loads through load_weights (a LoadWeightsSink, a vLLM engine) can"
    )
    return (
        f"To fix the dtypes ({', '.join(f'{w} sent, {h} held' for w, h in pairs)}): set the trainer's wire_dtype "
        f"to the worker's dtype (wire_dtype=torch.{held}), or build {who}'s model in {wire} (a vLLM engine: "
        f"dtype={wire!r}); {why}."
    )
