"""A ``load_weights`` sink's own copy of the wire bytes, for delta sessions.

A loader renames, fuses and shards on load, out of weightsync's sight, so only a tensor in
the checkpoint's coordinates can take a delta's changed elements, and only the worker's
own copy of what it was last handed holds the unchanged ones.
:class:`~weightsync.core.sinks.LoadWeightsSink` keeps one :class:`WireCopy` in a delta
session (``keep_base``): every tensor handed over is copied into it; a delta is applied to
it and the whole rebuilt tensor handed to the loader. It costs a copy of the model's wire
bytes on the worker's device.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from weightsync.core.delta.apply import apply_delta
from weightsync.core.delta.encoding import Kind
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.manifest import Manifest, TensorSpec


class WireCopy:
    """The wire bytes last handed over, by tensor name."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def keep(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors handed over (a dense sync's) into the copy."""
        with torch.no_grad():
            for name, tensor in items:
                held = self.tensors.get(name)
                if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
                    self.tensors[name] = held = torch.empty_like(tensor, memory_format=torch.contiguous_format)
                held.copy_(tensor)

    def patched(self, spec: TensorSpec, kind: Kind, count: int, payload: torch.Tensor) -> torch.Tensor:
        """The copy of ``spec``'s tensor with a delta's changed elements written in."""
        held = self.tensors.get(spec.name)
        if held is None:
            raise WeightSyncError(
                f"a delta for {spec.name!r} reached a load_weights sink that holds no copy of its bytes "
                "(the sync before it never handed that tensor over); a weightsync bug: set up again"
            )
        with torch.no_grad():
            apply_delta(held, spec, kind, count, payload)
        return held

    def rows_target(self, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        """The copy of ``spec``'s whole tensor, for pieces of it written or patched in place
        (owner sends); made, uninitialized, the first time."""
        held = self.tensors.get(spec.name)
        if held is None or tuple(held.shape) != spec.shape or held.dtype != spec.torch_dtype:
            held = self.tensors[spec.name] = torch.empty(spec.shape, dtype=spec.torch_dtype, device=device)
        return held

    def unchanged(self, manifest: Manifest, kinds: Sequence[tuple[Kind, int]]) -> list[tuple[str, torch.Tensor]]:
        """The copies of the tensors a delta sync left unchanged."""
        same = [s.name for s, (kind, _) in zip(manifest.specs, kinds) if kind is Kind.UNCHANGED]
        return [(name, self.tensors[name]) for name in same if name in self.tensors]
