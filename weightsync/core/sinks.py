"""Where received tensors land on a worker.

* :class:`ModuleSink` copies into an ``nn.Module``'s parameters and buffers by name. Its
  destinations are the parameters themselves, so unpacking is one copy from the buffer
  straight into the weights, and it allows the one-copy ``direct`` transport.
* :class:`LoadWeightsSink` hands ``(name, tensor)`` lists to a ``load_weights`` callable,
  the convention of inference engines (vLLM's ``model.load_weights``), which rename, fuse
  and shard as they load.

Either can stage (``ModuleSink(stage=...)``, ``LoadWeightsSink(staged=True)``): a sync is
received into a stage (:mod:`weightsync.core.stage`) and swapped in at its commit with one
copy (``land``), so the model keeps its version until then and a failed sync never reaches
it. A staging sink has ``staged`` True and ``seal()`` / ``land()`` / ``discard()``, which
the receiver calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from weightsync.core.delta.apply import apply_delta
from weightsync.core.delta.encoding import Kind
from weightsync.core.halves import Landing
from weightsync.core.load_weights_sink import LoadWeightsSink
from weightsync.core.packing import tensor_checksums
from weightsync.core.stage import CopyPlans, Staging, copy_in, one_device
from weightsync.core.tensor_paths import TensorPaths
from weightsync.core.wire.casts import TensorCast
from weightsync.core.wire.errors import ManifestError, ModelChangedError
from weightsync.core.wire.manifest import Manifest, TensorSpec


def module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and persistent buffers, in registration order.

    Tied tensors (one Parameter registered under two names, as tied embeddings are) appear
    once, under their first name, so they travel once and stay tied on the worker.
    """
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, param in module.named_parameters():
        seen.add(id(param))
        out.append((name, param))
    for module_name, sub in module.named_modules():
        skip: set[str] = getattr(sub, "_non_persistent_buffers_set", set())
        for buffer_name, buffer in sub.named_buffers(recurse=False):
            if buffer is None or buffer_name in skip or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            out.append((f"{module_name}.{buffer_name}" if module_name else buffer_name, buffer))
    return out


class Sink(Landing, Protocol):
    """What a receiver needs from the place tensors go: a transport's :class:`Landing`, plus
    what the handshake and ``WeightSync.verify`` ask.

    ``casts_on_load`` (read with ``getattr``, False when absent): whether the sink copies
    each tensor into its destination with a cast, so the handshake may accept a floating
    tensor held in another dtype than the wire's (:mod:`weightsync.core.wire.casts`)."""

    def local_specs(self) -> Sequence[TensorSpec] | None:
        """What this worker holds, for the handshake; None accepts any manifest."""

    def checksums(self, manifest: Manifest) -> list[int] | None:
        """Per spec, the checksum of what this worker holds after loading, or None when it
        cannot tell (nothing received yet). What ``verify`` compares with the trainer's: a
        sink that writes tensors in place reads them back; one that transforms them on load
        gives the checksums of the bytes it was handed (and says so in its docs)."""


def _check_held(manifest: Manifest, held: Sequence[torch.Tensor]) -> None:
    problems = [p for spec, t in zip(manifest.specs, held) if (p := spec.mismatch(t)) is not None]
    if problems:
        raise ModelChangedError(
            "tensors changed since setup and cannot receive the manifest's bytes without a cast or a "
            f"broadcast (nothing was written): {'; '.join(problems)}; restore them or run setup() again"
        )


class ModuleSink:
    """Copies received tensors into ``module``'s parameters and buffers by name.

    ``verify`` checks the parameters and buffers themselves, read back after the sync.

    ``stage`` ("auto", "device" or "host"; None: off): receive each sync into a stage and
    copy it into the module's tensors only at the commit (:meth:`land`, one copy), so code
    reading the module under the receiver's gate (``WorkerMixin.weightsync_reading()``)
    keeps reading the last version while the next one arrives, and waits only for that
    copy. ``keep_stage`` keeps the stage allocated between syncs. A staging sink takes no
    ``direct`` writes (they would write the module itself).
    """

    keeps_references = False
    records_checksums = True
    #: :meth:`patch` writes in place and nothing reads the tensors before the sync ends, so
    #: a delta's GPU scatters may be launched together (``batched_scatters``).
    patches_in_place = True
    #: The wire's bytes are written into the parameters' storage (and direct writes them
    #: there from the trainer): a dtype difference cannot be cast.
    casts_on_load = False

    def __init__(self, module: nn.Module, stage: str | None = None, keep_stage: bool = False) -> None:
        self.module = module
        # A module's checksums are read from it (or its pending stage) when asked: none kept.
        self.staging = Staging(stage, keep_stage, record=False) if stage is not None else None
        self._plans = CopyPlans()  # the swap's copies, in one kernel launch on a GPU
        self.staged = self.staging is not None
        #: The trainer may write the module itself (``direct``) only when it does not stage.
        self.allows_direct = not self.staged
        self._by_name: dict[str, torch.Tensor] = {}
        self._order: list[torch.Tensor] = []
        self._paths: TensorPaths | None = None  # how _order was reached, for direct syncs
        # How _by_name was reached, and for which manifest, for syncs into destinations.
        self._held_paths: TensorPaths | None = None
        self._held_for: Manifest | None = None

    def held(self) -> dict[str, torch.Tensor]:
        return dict(module_tensors(self.module))

    def local_specs(self) -> list[TensorSpec]:
        """What the module holds; refuses, naming them, tensors on the meta device (they have
        no storage: a sync would write nowhere and a verify would read nothing)."""
        held = module_tensors(self.module)
        meta = [name for name, tensor in held if tensor.is_meta]
        if meta:
            shown = ", ".join(meta[:5]) + (f" and {len(meta) - 5} more" if len(meta) > 5 else "")
            raise ManifestError(
                f"{len(meta)} tensor(s) of the worker's model are on the meta device ({shown}): they hold no "
                "bytes and cannot receive any; materialize the model first (model.to_empty(device=...), or "
                "build it on a real device) and set up again"
            )
        return [TensorSpec.of(name, tensor) for name, tensor in held]

    def destinations(self, manifest: Manifest) -> list[torch.Tensor | None]:
        # The module tree is walked again only when a link to a tensor changed (a walk costs
        # more per sync than a small model's copies); dtypes and shapes are checked every time.
        paths = self._held_paths
        if self._held_for is not manifest or paths is None or not paths.unchanged():
            self._held_paths = self._held_for = None
            self._by_name = self.held()
            missing = [spec.name for spec in manifest.specs if spec.name not in self._by_name]
            if missing:
                raise ModelChangedError(
                    f"tensors of the manifest no longer in the model: {', '.join(missing)}; run setup() again"
                )
            self._held_paths, self._held_for = TensorPaths(self.module, manifest.names), manifest
        self._order = [self._by_name[spec.name] for spec in manifest.specs]
        _check_held(manifest, self._order)
        if self.staging is not None:
            return list(self.staging.open(manifest, one_device(self._order)))
        return [t.data if t.is_contiguous() else None for t in self._order]

    def consume(self, items: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in items:
                self._by_name[name].copy_(tensor)

    def patch(self, index: int, spec: TensorSpec, kind: Kind, count: int, payload: torch.Tensor) -> None:
        """A delta sync: write the changed elements into the held tensor, in place (it holds
        the bytes the delta was made against: the receiver checks that first)."""
        with torch.no_grad():
            apply_delta(self._order[index].data, spec, kind, count, payload)

    def rows_target(self, index: int, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        """Owner sends in a delta session: the held tensor whose rows pieces are written
        into or patched (after :meth:`destinations` of this sync)."""
        return self._order[index].data

    def seal(self) -> None:
        assert self.staging is not None, "seal() is a staging sink's"
        self.staging.seal()

    def land(self) -> None:
        """Copy the staged sync into the module's tensors (the swap), then release the stage.
        Refuses, before copying anything, a module whose tensors were replaced meanwhile."""
        assert self.staging is not None, "land() is a staging sink's"
        try:
            paths = self._held_paths
            if paths is None or not paths.unchanged():
                raise ModelChangedError(
                    "the module's tensors were replaced while a staged sync arrived; run setup() again"
                )
            self.staging.swap_s = copy_in(self._order, [v for _, v in self.staging.items()], self._plans)
        finally:
            self.staging.release()

    def discard(self) -> None:
        if self.staging is not None:
            self.staging.release()

    def direct_tensors(self, manifest: Manifest) -> list[torch.Tensor] | None:
        """The held tensors themselves, in manifest order (the direct transport reads their
        data pointers and shapes, copies from them under no_grad, and rebinds them); None
        for a staging sink."""
        if self.staging is not None:
            return None
        if self._paths is None or not self._paths.unchanged():
            held = self.held()
            self._order = [held[spec.name] for spec in manifest.specs]
            self._paths = TensorPaths(self.module, manifest.names)
        return self._order

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        self._order[index].data = tensor

    def checksums(self, manifest: Manifest) -> list[int]:
        """What the module holds, or with a staged sync waiting for its swap, what it will hold."""
        staged = self.staging.checksums() if self.staging is not None else None
        if staged is not None:
            return staged
        held = self.held()
        missing = [spec.name for spec in manifest.specs if spec.name not in held]
        if missing:
            raise ModelChangedError(f"tensors of the manifest no longer in the model: {', '.join(missing)}")
        return tensor_checksums([held[spec.name] for spec in manifest.specs])


def watch_casts(sink: Sink, casts: Sequence[TensorCast]) -> None:
    """Hand ``sink`` the casts the handshake accepted, when it counts overflows (see
    :meth:`LoadWeightsSink.watch_casts`)."""
    watch = getattr(sink, "watch_casts", None)
    if callable(watch):
        watch(casts)


def taken_overflows(sink: Sink) -> dict[str, int]:
    """Per tensor, the values ``sink``'s casts on load turned into inf since the last call
    (``{}`` for a sink that does not count them)."""
    take = getattr(sink, "take_overflows", None)
    return take() if callable(take) else {}


__all__ = ["LoadWeightsSink", "ModuleSink", "Sink", "TensorPaths", "module_tensors", "taken_overflows", "watch_casts"]
