"""Casts a worker makes as it loads: which the handshake accepts, and what each one loses.

A worker whose sink hands tensors to ``load_weights`` may hold a floating tensor in another
floating dtype than the wire's: the loader copies each weight into its own parameter,
casting (vLLM's loaders do). The handshake accepts such a difference and records it, one
:class:`TensorCast` per tensor. A module sink, and every direct worker, writes the wire's
bytes into the parameter's storage: it cannot cast, so a dtype difference there is refused.
A dtype that changes after setup is refused at the next sync either way (the model changed).

Casts run only between :data:`CASTABLE` dtypes. What a cast loses, from ``torch.finfo`` of
the two dtypes (:func:`loss`):

- ``"range"``: the held dtype's exponent range is narrower than the wire's (its largest
  exponent is smaller, or its smallest normal value larger): wire values outside it
  become ``inf`` or underflow. fp16 held from a bf16, fp32 or fp64 wire; bf16 from fp16
  keeps range; fp32 from fp64.
- ``"precision"``: the exponent range is kept, but the held dtype has fewer significand
  bits: values are rounded (the largest ones may round up to ``inf``, as bf16's largest
  finite value is a little under fp32's). bf16 held from an fp32 or fp16 wire.
- ``None``: every wire value is held exactly. bf16 or fp16 into fp32, anything into fp64.

Lossy casts are accepted too (the trainer chose the wire, the engine its dtype), and are
listed in every :class:`~weightsync.core.wire.report.SyncReport` (``WorkerReport.casts``)
and logged at setup. What a range-losing cast actually did in a sync is counted too: a sink
that casts counts, per tensor, the finite wire values its cast turned into ``inf``
(:func:`overflows`; ``WorkerReport.overflows``, named in the summary).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from weightsync.core.wire.dtypes import dtype_from_name
from weightsync.core.wire.errors import ManifestError

#: The dtypes a sink may cast between. fp8 dtypes are left out: they carry scales that a
#: plain ``copy_`` does not apply.
CASTABLE: frozenset[torch.dtype] = frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16})


def castable(wire: torch.dtype, held: torch.dtype) -> bool:
    """Whether a sink that casts on load may hold ``held`` for a tensor sent as ``wire``."""
    return wire != held and wire in CASTABLE and held in CASTABLE


def loss(wire: torch.dtype, held: torch.dtype) -> str | None:
    """``"range"``, ``"precision"`` or None: what holding ``wire`` values in ``held`` loses."""
    w, h = torch.finfo(wire), torch.finfo(held)
    if math.frexp(h.max)[1] < math.frexp(w.max)[1] or h.tiny > w.tiny:
        return "range"
    if h.eps > w.eps:
        return "precision"
    return None


def overflows(tensor: torch.Tensor, held: torch.dtype) -> torch.Tensor:
    """How many finite values of ``tensor`` a cast to ``held`` turns into ``inf`` (a 0-d
    tensor where ``tensor`` lives: read it when the sync is done)."""
    return torch.count_nonzero(torch.isinf(tensor.to(held)) & torch.isfinite(tensor))


@dataclass(frozen=True, kw_only=True)
class TensorCast:
    """One tensor a worker holds in another dtype than the wire's (dtypes by allow-listed name)."""

    name: str
    """The tensor, by its name on the wire."""

    wire: str
    """The dtype the trainer sends it in."""

    held: str
    """The dtype the worker holds it in."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ManifestError(f"TensorCast.name must be a non-empty string, got {self.name!r}")
        if not castable(dtype_from_name(self.wire), dtype_from_name(self.held)):
            raise ManifestError(
                f"{self.name}: no cast from {self.wire} to {self.held}; casts run between two different dtypes of "
                f"{sorted(str(d).removeprefix('torch.') for d in CASTABLE)}"
            )

    @property
    def loses(self) -> str | None:
        return loss(dtype_from_name(self.wire), dtype_from_name(self.held))


@dataclass(frozen=True, kw_only=True)
class CastCount:
    """How many tensors one worker casts from one wire dtype to one held dtype."""

    wire: str
    """The dtype on the wire."""

    held: str
    """The dtype the worker holds."""

    tensors: int
    """How many tensors take this cast."""

    loses: str | None
    """``"range"``, ``"precision"`` or None (exact); see :func:`loss`."""

    first: str
    """The first such tensor in the manifest's order, to look at."""

    def line(self) -> str:
        lost = f", loses {self.loses}" if self.loses else ""
        return f"{self.tensors} tensor(s) {self.wire}->{self.held}{lost} (first {self.first})"


def count_casts(casts: Iterable[TensorCast]) -> tuple[CastCount, ...]:
    """``casts`` counted by (wire, held), in order of first appearance."""
    groups: dict[tuple[str, str], list[TensorCast]] = {}
    for cast in casts:
        groups.setdefault((cast.wire, cast.held), []).append(cast)
    return tuple(
        CastCount(wire=wire, held=held, tensors=len(group), loses=group[0].loses, first=group[0].name)
        for (wire, held), group in groups.items()
    )
