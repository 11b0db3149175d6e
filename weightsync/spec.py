"""The wire contract: what both sides of a weight sync must agree on before a byte moves.

A :class:`Manifest` is built once, on the trainer, and sent to every worker in the
handshake. It fixes the tensor order, the wire dtypes, the buffer settings and the chunk
plan, so that nothing but raw bytes travels at sync time and a worker configured
differently is refused at setup instead of hanging a collective later.

This module imports no transport and no Ray.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

PROTOCOL_VERSION = 1
DEFAULT_ALIGNMENT = 256
DEFAULT_BUFFER_BYTES = 256 * 1024 * 1024
DEFAULT_NUM_BUFFERS = 2

_DTYPE_CANDIDATES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "complex64",
    "complex128",
)


def _build_allow_list() -> dict[str, torch.dtype]:
    allowed: dict[str, torch.dtype] = {}
    for name in _DTYPE_CANDIDATES:
        candidate = getattr(torch, name, None)
        if isinstance(candidate, torch.dtype):
            allowed[name] = candidate
    return allowed


#: Dtypes that may travel, by wire name. Built from this torch's real dtypes only, so a
#: name received over the wire can never resolve to an arbitrary ``torch`` attribute.
ALLOWED_DTYPES: Mapping[str, torch.dtype] = _build_allow_list()
_NAME_OF_DTYPE = {dtype: name for name, dtype in ALLOWED_DTYPES.items()}


class WeightSyncError(RuntimeError):
    """Base class of every error weightsync raises on purpose."""


class UnsupportedDtypeError(WeightSyncError, ValueError):
    """A dtype name or dtype outside :data:`ALLOWED_DTYPES`."""


class ManifestError(WeightSyncError, ValueError):
    """A Manifest that is malformed, or that does not match a model."""


def dtype_from_name(name: str) -> torch.dtype:
    """Resolve a wire dtype name through the allow-list, refusing anything else."""
    if not isinstance(name, str) or name not in ALLOWED_DTYPES:
        raise UnsupportedDtypeError(
            f"dtype {name!r} is not one weightsync can transfer; allowed: {', '.join(sorted(ALLOWED_DTYPES))}"
        )
    return ALLOWED_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; refuses dtypes outside the allow-list."""
    try:
        return _NAME_OF_DTYPE[dtype]
    except KeyError:
        raise UnsupportedDtypeError(
            f"dtype {dtype} cannot be transferred; allowed: {', '.join(sorted(ALLOWED_DTYPES))}"
        ) from None


@dataclass(frozen=True)
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
        dtype_from_name(self.dtype)

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> TensorSpec:
        """The spec of ``tensor`` as sent under ``name``, optionally cast to ``dtype``."""
        return cls(name, tuple(tensor.shape), dtype_name(dtype or tensor.dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return ALLOWED_DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


@dataclass(frozen=True)
class ChunkPiece:
    """A contiguous byte range of one tensor placed at ``buffer_offset`` in a chunk.

    ``tensor_offset`` is the byte offset inside the tensor's own contiguous bytes; a piece
    with ``tensor_offset == 0`` and ``nbytes`` equal to the tensor's size is the whole
    tensor, which is the common case. Tensors larger than the buffer span several chunks.
    """

    spec_index: int
    tensor_offset: int
    buffer_offset: int
    nbytes: int


@dataclass(frozen=True)
class Chunk:
    """The contents of one buffer fill: pieces in order and the bytes actually used."""

    index: int
    pieces: tuple[ChunkPiece, ...]
    nbytes: int


@dataclass(frozen=True)
class Manifest:
    """Everything both sides derive a transfer from, fixed by the trainer at setup.

    Build it with :meth:`build` (which computes the chunk plan); a receiver checks it with
    :meth:`check_against` and :meth:`validate` before joining any collective.
    """

    specs: tuple[TensorSpec, ...]
    buffer_bytes: int
    num_buffers: int
    alignment: int
    chunks: tuple[Chunk, ...]
    protocol_version: int = PROTOCOL_VERSION
    total_bytes: int = field(default=0)

    @classmethod
    def build(
        cls,
        specs: Iterable[TensorSpec],
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        alignment: int = DEFAULT_ALIGNMENT,
    ) -> Manifest:
        from weightsync.packing import plan_chunks

        spec_tuple = tuple(specs)
        check_buffer_settings(buffer_bytes, num_buffers, alignment)
        check_specs(spec_tuple)
        return cls(
            specs=spec_tuple,
            buffer_bytes=buffer_bytes,
            num_buffers=num_buffers,
            alignment=alignment,
            chunks=plan_chunks(spec_tuple, buffer_bytes, alignment),
            total_bytes=sum(s.nbytes for s in spec_tuple),
        )

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

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
        check_buffer_settings(self.buffer_bytes, self.num_buffers, self.alignment)
        check_specs(self.specs)
        rebuilt = Manifest.build(self.specs, self.buffer_bytes, self.num_buffers, self.alignment)
        if rebuilt.chunks != self.chunks or rebuilt.total_bytes != self.total_bytes:
            raise ManifestError(
                "the chunk plan sent by the trainer differs from the one this worker derives "
                "from the same specs; install the same weightsync version on both sides"
            )

    def check_against(self, local: Sequence[TensorSpec], who: str = "worker") -> None:
        """Refuse this Manifest unless ``local`` holds exactly the same tensors.

        Every mismatch is listed by tensor name in one error: missing on ``who``,
        unexpected on ``who``, shape and dtype differences. Order does not matter: the
        receiver places tensors by name.
        """
        problems = spec_mismatches(self.specs, local, who)
        if problems:
            raise ManifestError(
                f"{who} does not match the trainer's manifest ({len(problems)} problem(s)):\n  " + "\n  ".join(problems)
            )

    def check_buffer_expectations(
        self,
        who: str,
        buffer_bytes: int | None = None,
        num_buffers: int | None = None,
        alignment: int | None = None,
    ) -> None:
        """Refuse the trainer's buffer settings where ``who`` was pinned to other values."""
        problems = []
        for label, mine, theirs in (
            ("buffer_bytes", buffer_bytes, self.buffer_bytes),
            ("num_buffers", num_buffers, self.num_buffers),
            ("alignment", alignment, self.alignment),
        ):
            if mine is not None and mine != theirs:
                problems.append(f"{label}: trainer uses {theirs}, {who} was configured with {mine}")
        if problems:
            raise ManifestError(
                f"{who} was configured with buffer settings that differ from the trainer's "
                f"(the trainer's settings are the ones used; drop the override on {who} or "
                "make them equal): " + "; ".join(problems)
            )


def check_buffer_settings(buffer_bytes: int, num_buffers: int, alignment: int) -> None:
    if not isinstance(alignment, int) or alignment < 16 or alignment & (alignment - 1):
        raise ManifestError(
            f"alignment must be a power of two of at least 16 bytes (the widest dtype), got {alignment!r}"
        )
    if not isinstance(buffer_bytes, int) or buffer_bytes < alignment:
        raise ManifestError(
            f"buffer_bytes must be an integer of at least the alignment ({alignment}), got {buffer_bytes!r}"
        )
    if not isinstance(num_buffers, int) or num_buffers < 1:
        raise ManifestError(f"num_buffers must be a positive integer, got {num_buffers!r}")


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


def spec_mismatches(expected: Sequence[TensorSpec], local: Sequence[TensorSpec], who: str = "worker") -> list[str]:
    """Every difference between two spec lists, one readable line per tensor."""
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
        if t.dtype != m.dtype:
            problems.append(f"{name}: dtype {t.dtype} on the trainer, {m.dtype} on {who}")
    return sorted(problems)
