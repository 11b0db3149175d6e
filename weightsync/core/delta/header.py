"""The per-sync layout of a delta session: a fixed-size header, then a payload plan both
sides derive from it.

In a session with deltas on (``AgreedSettings.delta``), a transport that carries them
starts every sync with the header, ``4 + len(specs)`` int64 words whatever the data::

    [MAGIC, mode, base token, new token, code of tensor 0, code of tensor 1, ...]

``mode`` DENSE: the Manifest's own plan follows, as in a session without deltas. ``mode``
DELTA: the codes (:mod:`weightsync.core.delta.encoding`) say per tensor what travels, and
:func:`plan_payload` turns them into a :class:`PayloadPlan`: a Manifest of the payloads,
planned with the session's agreed buffer settings (so a payload of at least
``inplace_bytes`` is broadcast in place, the rest packed), which the transport then moves
exactly as it moves a dense sync. A tensor sent DENSE in a delta sync keeps its own spec
there, so it still lands straight in the worker's tensor. The tokens name the bytes: a
worker applies a delta only onto the bytes of ``base token`` (what it committed last), and
holds ``new token`` once it commits.
"""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass

import torch

from weightsync.core.delta.encoding import Kind, decode_code, layout
from weightsync.core.wire.errors import ManifestError
from weightsync.core.wire.manifest import Manifest, TensorSpec

#: The header's first word: catches a receiver reading something else as a header.
MAGIC = 0x5753_444C_5441_0001
_WORDS = 4


class Mode(enum.IntEnum):
    DENSE = 0
    DELTA = 1


def new_token() -> int:
    """A fresh name for the bytes of one sync (never 0, which names nothing)."""
    return secrets.randbits(62) + 1


def header_nbytes(manifest: Manifest) -> int:
    return 8 * (_WORDS + len(manifest.specs))


def header_manifest(manifest: Manifest) -> Manifest:
    """The header as a Manifest of one uint8 tensor, planned with the session's settings:
    how a transport that moves chunks through slots (ipc) carries it, as its first chunk."""
    return Manifest.planned([TensorSpec("delta header", (header_nbytes(manifest),), "uint8")], manifest.agreed)


@dataclass(frozen=True)
class SyncHeader:
    """What a delta session's sync starts with (see the module doc)."""

    mode: Mode
    base_token: int
    new_token: int
    codes: tuple[int, ...] = ()

    def to_tensor(self, manifest: Manifest, device: torch.device) -> torch.Tensor:
        codes = self.codes if self.mode is Mode.DELTA else (0,) * len(manifest.specs)
        words = [MAGIC, int(self.mode), self.base_token, self.new_token, *codes]
        return torch.tensor(words, dtype=torch.int64, device=device).view(torch.uint8)

    @classmethod
    def from_tensor(cls, raw: torch.Tensor, manifest: Manifest, who: str) -> SyncHeader:
        """The header in ``raw`` (the bytes received), checked against ``manifest``."""
        if raw.numel() != header_nbytes(manifest):
            raise ManifestError(f"{who}: a delta header of {raw.numel()} bytes, {header_nbytes(manifest)} expected")
        words = raw.detach().cpu().view(torch.int64).tolist()
        if words[0] != MAGIC or words[1] not in (0, 1):
            raise ManifestError(
                f"{who}: the sync's first bytes are not a delta header (magic {words[0]:#x}, mode {words[1]}); "
                "the two sides are out of step: set up again"
            )
        mode = Mode(words[1])
        header = cls(mode, words[2], words[3], tuple(words[_WORDS:]) if mode is Mode.DELTA else ())
        if mode is Mode.DELTA:
            plan_payload(manifest, header.codes)  # refuses codes that fit no tensor, by name
        return header


@dataclass(frozen=True)
class PayloadPlan:
    """One delta sync's payloads: per tensor its (kind, count); the payloads as a Manifest
    (None when nothing changed) and, per payload, the index of its tensor."""

    kinds: tuple[tuple[Kind, int], ...]
    manifest: Manifest | None
    origin: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.manifest.total_bytes if self.manifest is not None else 0


def plan_payload(manifest: Manifest, codes: tuple[int, ...]) -> PayloadPlan:
    """The payload plan of a delta sync of ``manifest`` whose tensors carry ``codes``."""
    if len(codes) != len(manifest.specs):
        raise ManifestError(f"delta header: {len(codes)} codes for {len(manifest.specs)} tensors")
    kinds: list[tuple[Kind, int]] = []
    specs: list[TensorSpec] = []
    origin: list[int] = []
    for index, (spec, code) in enumerate(zip(manifest.specs, codes)):
        kind, count = decode_code(code, spec)
        kinds.append((kind, count))
        if kind is Kind.UNCHANGED or spec.nbytes == 0:
            continue
        specs.append(
            spec if kind is Kind.DENSE else TensorSpec(spec.name, (layout(spec, kind, count).nbytes,), "uint8")
        )
        origin.append(index)
    planned = Manifest.planned(specs, manifest.agreed) if specs else None
    return PayloadPlan(tuple(kinds), planned, tuple(origin))
