"""Where received tensors land on a worker.

* :class:`ModuleSink` copies into an ``nn.Module``'s parameters and buffers by name. Its
  destinations are the parameters themselves, so unpacking is one copy from the buffer
  straight into the weights, and it allows the one-copy ``direct`` transport.
* :class:`LoadWeightsSink` hands ``(name, tensor)`` lists to a ``load_weights`` callable,
  the convention of inference engines (vLLM's ``model.load_weights``), which rename, fuse
  and shard as they load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch
from torch import nn

from weightsync.core.delta.apply import apply_delta
from weightsync.core.delta.encoding import Kind
from weightsync.core.delta.wire_copy import WireCopy
from weightsync.core.halves import Landing
from weightsync.core.packing import read_checksums, tensor_checksums, word_sum
from weightsync.core.tensor_paths import TensorPaths
from weightsync.core.wire.casts import TensorCast, overflows
from weightsync.core.wire.dtypes import dtype_from_name
from weightsync.core.wire.errors import ManifestError, ModelChangedError, WeightSyncError
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
    """

    keeps_references = False
    records_checksums = True
    #: The wire's bytes are written into the parameters' storage (and direct writes them
    #: there from the trainer): a dtype difference cannot be cast.
    casts_on_load = False

    def __init__(self, module: nn.Module) -> None:
        self.module = module
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

    def direct_tensors(self, manifest: Manifest) -> list[torch.Tensor]:
        """The held tensors themselves, in manifest order (the direct transport reads their
        data pointers and shapes, copies from them under no_grad, and rebinds them)."""
        if self._paths is None or not self._paths.unchanged():
            held = self.held()
            self._order = [held[spec.name] for spec in manifest.specs]
            self._paths = TensorPaths(self.module, manifest.names)
        return self._order

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        self._order[index].data = tensor

    def checksums(self, manifest: Manifest) -> list[int]:
        held = self.held()
        missing = [spec.name for spec in manifest.specs if spec.name not in held]
        if missing:
            raise ModelChangedError(f"tensors of the manifest no longer in the model: {', '.join(missing)}")
        return tensor_checksums([held[spec.name] for spec in manifest.specs])


class LoadWeightsSink:
    """Hands each chunk's tensors to ``load_weights(iterable of (name, tensor))``.

    ``copies_immediately=True`` (the engines' behaviour: each weight is copied into the
    engine's own parameter inside the call) passes views into the receive buffer, which
    saves a copy; pass False for a loader that keeps references (for instance one that
    buffers tensors to replay later), and it gets clones instead. ``expected_specs``, when
    given, is checked against the trainer's manifest in the handshake.

    It records a checksum of every tensor it is handed (computed where the tensor lives,
    read back only when asked), so ``sync(verify=True)`` and ``WeightSync.verify`` can
    compare the bytes this worker received with the trainer's. What they check is the bytes
    handed to ``load_weights``, not the engine's parameters after it renamed, fused or
    sharded them (weightsync cannot see those). ``record_checksums=False`` skips that read
    of every byte, and a sync with ``verify`` is then refused.

    ``load_weights`` must copy each tensor into its own (with ``copy_``, as vLLM's loaders
    do), which casts: ``expected_specs`` may name a floating dtype other than the wire's,
    and the handshake records the cast (:mod:`weightsync.core.wire.casts`). The checksums
    are of the bytes handed over, in the wire's dtype. For each cast that narrows the range
    (fp16 held from an fp32 or bf16 wire) it counts, per sync, the values the cast turns
    into ``inf`` (:meth:`watch_casts`, :meth:`take_overflows`).

    In a delta session (``SyncSettings(delta=True)``) the sink keeps its own copy of the
    wire bytes it was handed (``keep_base``, which the receiver calls at setup), applies
    each delta to that copy and loads the whole rebuilt tensor: a ``load_weights`` renames,
    fuses and shards on load, so only a tensor in the checkpoint's coordinates can take the
    changed elements, and only the worker's own copy holds the unchanged ones. It costs a
    copy of the model's wire bytes on the worker's device. ``reload_all``: in a delta sync,
    load the unchanged tensors too (from that copy), for a loader that must see every
    tensor of a layer to rebuild it (vLLM's layerwise reload leaves a layer it was given
    part of half built); without it only the changed tensors are loaded.

    ``staged``: keep every tensor of a sync (as copies) and load them only once the sync
    commits (:meth:`land`, called by the receiver), so a sync that fails midway, a trainer
    rank dying or a transfer timing out, never reaches the model: the worker keeps serving
    its last version, committed. It costs a second copy of the model's bytes on the
    worker's device while a sync is in flight; without it a failed sync leaves a loaded
    model part old, part new (dirty) until the next sync.
    """

    casts_on_load = True

    def __init__(
        self,
        load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
        copies_immediately: bool = True,
        expected_specs: Sequence[TensorSpec] | None = None,
        record_checksums: bool = True,
        staged: bool = False,
        reload_all: bool = False,
    ) -> None:
        self._load_weights = load_weights
        self.reload_all = reload_all
        #: Delta sessions: the wire bytes last handed over (None: not kept).
        self._copy: WireCopy | None = None
        self._copies = copies_immediately
        self._expected = list(expected_specs) if expected_specs is not None else None
        self._record = record_checksums
        self._received: dict[str, torch.Tensor] = {}
        self._staged: list[tuple[str, torch.Tensor]] = []
        #: Checksums of the staged tensors: what the sink will hold once they land.
        self._staged_sums: dict[str, torch.Tensor] = {}
        #: Per tensor whose cast narrows the range, the dtype it is held in; this sync's
        #: count of values that cast turns into ``inf``, per such tensor.
        self._narrowed: dict[str, torch.dtype] = {}
        self._overflows: dict[str, torch.Tensor] = {}
        self.staged = False
        self.set_staged(staged)

    def watch_casts(self, casts: Iterable[TensorCast]) -> None:
        """The casts the handshake accepted (the receiver passes them on): from now on each
        tensor cast to a narrower range is counted for values that overflow to ``inf``."""
        self._narrowed = {c.name: dtype_from_name(c.held) for c in casts if c.loses == "range"}
        self._overflows = {}

    def take_overflows(self) -> dict[str, int]:
        """Per tensor handed over since the last call, how many values its cast turned into
        ``inf`` (tensors without any left out); counting starts afresh."""
        counts, self._overflows = self._overflows, {}
        return {name: n for name, count in counts.items() if (n := int(count))}

    def set_staged(self, staged: bool) -> None:
        """Stage whole syncs (see the class doc) from the next sync on; refused while a
        sync's tensors wait to land (between a receive and its commit)."""
        if not isinstance(staged, bool):
            raise TypeError(f"staged must be True or False, got {staged!r}")
        if self._staged:
            raise WeightSyncError(
                f"staged={staged}: {len(self._staged)} tensor(s) of a sync wait for its commit; change staging "
                "between syncs, not during one"
            )
        self.staged = staged
        self.keeps_references = not self._copies or staged

    def land(self) -> None:
        """Load what a staged sync kept (the receiver calls it as the sync commits)."""
        items, self._staged = self._staged, []
        sums, self._staged_sums = self._staged_sums, {}
        if items:
            with torch.no_grad():
                self._load_weights(iter(items))
        self._received.update(sums)

    def discard(self) -> None:
        """Drop what a staged sync kept: it failed, the model was never touched."""
        self._staged, self._staged_sums = [], {}

    @property
    def records_checksums(self) -> bool:
        return self._record

    def local_specs(self) -> list[TensorSpec] | None:
        return self._expected

    def destinations(self, manifest: Manifest) -> list[torch.Tensor | None]:
        return [None] * len(manifest.specs)

    def keep_base(self, keep: bool) -> None:
        """Keep a copy of the wire bytes handed over, to apply deltas to (a delta session; one
        already kept stays, with what the worker holds), or drop it."""
        self._copy = (self._copy or WireCopy()) if keep else None

    def _wire_copy(self, what: str) -> WireCopy:
        if self._copy is None:
            raise WeightSyncError(f"{what} reached a load_weights sink that keeps no copy of the wire bytes; a bug")
        return self._copy

    def patch(self, index: int, spec: TensorSpec, kind: Kind, count: int, payload: torch.Tensor) -> None:
        """A delta sync: the changed elements into this sink's copy of ``spec``'s bytes, then
        the whole tensor loaded (see the class doc)."""
        self._hand([(spec.name, self._wire_copy(f"a delta for {spec.name!r}").patched(spec, kind, count, payload))])

    def delta_done(self, manifest: Manifest, kinds: Sequence[tuple[Kind, int]]) -> None:
        """After a delta sync's payloads: with ``reload_all``, load the unchanged tensors too."""
        if self.reload_all and self._copy is not None:
            self._hand(self._copy.unchanged(manifest, kinds))

    def rows_target(self, index: int, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        """Owner sends in a delta session: where pieces of ``spec``'s tensor are written or
        patched (this sink's copy), handed over by :meth:`hand_rows` once all arrived."""
        return self._wire_copy(f"rows of {spec.name!r}").rows_target(spec, device)

    def hand_rows(self, manifest: Manifest, indices: Sequence[int]) -> None:
        """Load the tensors ``indices`` (every rank's pieces of them landed in the copy); with
        ``reload_all`` every other tensor too."""
        copy = self._wire_copy("owner sends")
        chosen = set(indices) if not self.reload_all else range(len(manifest.specs))
        self._hand([(s.name, copy.tensors[s.name]) for i, s in enumerate(manifest.specs) if i in chosen])

    def _hand(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Load tensors of this sink's own copy: cloned for a loader that keeps them (the
        copy changes with the next delta)."""
        if items:
            self._take([(n, t.clone()) for n, t in items] if self.keeps_references else items)

    def consume(self, items: list[tuple[str, torch.Tensor]]) -> None:
        if self._copy is not None:
            self._copy.keep(items)
        self._take(items)

    def _take(self, items: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in items:
                held = self._narrowed.get(name)
                if held is not None:
                    self._overflows[name] = overflows(tensor, held)
            if self._record:
                sums = self._staged_sums if self.staged else self._received
                for name, tensor in items:
                    sums[name] = word_sum(tensor)
            if self.staged:
                self._staged.extend(items)
            else:
                self._load_weights(iter(items))

    def checksums(self, manifest: Manifest) -> list[int] | None:
        """What the sink holds, or with a staged sync waiting for its commit, what it will
        hold once that lands (what a verified commit checks first)."""
        sums = {**self._received, **self._staged_sums}
        if not self._record or any(spec.name not in sums for spec in manifest.specs):
            return None
        return read_checksums([sums[spec.name] for spec in manifest.specs])

    def direct_tensors(self, manifest: Manifest) -> None:
        return None

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        raise TypeError("LoadWeightsSink transforms tensors on load; it cannot take direct writes")
