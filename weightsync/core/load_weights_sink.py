"""The sink of workers whose model loads weights itself: :class:`LoadWeightsSink` hands
``(name, tensor)`` lists to a ``load_weights`` callable, the convention of inference engines
(vLLM's ``model.load_weights``), which rename, fuse and shard as they load. See
:mod:`weightsync.core.sinks` for the sinks together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch

from weightsync.core.delta.encoding import Kind
from weightsync.core.delta.wire_copy import WireCopy
from weightsync.core.packing import read_checksums, word_sum
from weightsync.core.stage import Staging
from weightsync.core.wire.casts import TensorCast, overflows
from weightsync.core.wire.dtypes import dtype_from_name
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.manifest import Manifest, TensorSpec


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
    into ``inf`` (:meth:`watch_casts`, :meth:`take_overflows`; a staged sync's when its
    stage is sealed).

    In a delta session (``SyncSettings(delta=True)``) the sink keeps its own copy of the
    wire bytes it was handed (``keep_base``, which the receiver calls at setup), applies
    each delta to that copy and loads the whole rebuilt tensor: a ``load_weights`` renames,
    fuses and shards on load, so only a tensor in the checkpoint's coordinates can take the
    changed elements, and only the worker's own copy holds the unchanged ones. It costs a
    copy of the model's wire bytes on the worker's device. ``reload_all``: in a delta sync,
    load the unchanged tensors too (from that copy), for a loader that must see every
    tensor of a layer to rebuild it (vLLM's layerwise reload leaves a layer it was given
    part of half built); without it only the changed tensors are loaded.

    ``staged``: receive every tensor of a sync into a stage (:mod:`weightsync.core.stage`:
    one allocation on ``device`` or in host memory, by ``stage``) and load them only once
    the sync commits (:meth:`land`, called by the receiver), so a sync that fails midway, a
    trainer rank dying or a transfer timing out, never reaches the model: the worker keeps
    serving its last version, committed. It costs a second copy of the model's bytes while
    a sync is in flight (kept between syncs only with ``keep_stage``); without it a failed
    sync leaves a loaded model part old, part new (dirty) until the next sync. A staging sink keeps no copy
    of the wire bytes: in a delta session its worker is sent every sync dense.
    """

    casts_on_load = True
    #: The trainer never writes a transforming sink's model itself.
    allows_direct = False

    def __init__(
        self,
        load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
        copies_immediately: bool = True,
        expected_specs: Sequence[TensorSpec] | None = None,
        record_checksums: bool = True,
        staged: bool = False,
        reload_all: bool = False,
        stage: str = "auto",
        keep_stage: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        self._load_weights = load_weights
        self.reload_all = reload_all
        #: Delta sessions: the wire bytes last handed over (None: not kept).
        self._copy: WireCopy | None = None
        self._keep_base = False
        self._copies = copies_immediately
        self._expected = list(expected_specs) if expected_specs is not None else None
        self._record = record_checksums
        self._received: dict[str, torch.Tensor] = {}
        #: Per tensor whose cast narrows the range, the dtype it is held in; this sync's
        #: count of values that cast turns into ``inf``, per such tensor.
        self._narrowed: dict[str, torch.dtype] = {}
        self._overflows: dict[str, torch.Tensor] = {}
        self.device = torch.device(device)
        self.staging = Staging(stage, keep_stage, record_checksums)
        self.staged = False
        self.set_staged(staged)

    def set_staged(self, staged: bool, stage: str | None = None, keep_stage: bool | None = None) -> None:
        """Stage whole syncs (see the class doc) from the next sync on, optionally moving the
        stage (``stage``) or keeping it between syncs (``keep_stage``); refused while a
        sync's tensors wait for their commit."""
        if not isinstance(staged, bool):
            raise TypeError(f"staged must be True or False, got {staged!r}")
        if self.staging.pending:
            raise WeightSyncError(
                f"staged={staged}: a sync's tensors wait in the stage for its commit; change staging between "
                "syncs, not during one"
            )
        staging = Staging(
            stage if stage is not None else self.staging.place,
            keep_stage if keep_stage is not None else self.staging.keep,
            self._record,
        )
        self.staging.drop()
        self.staging = staging
        self.staged = staged
        # Staging on or off between syncs: the wire copy follows (a stage keeps none).
        self._copy = (self._copy or WireCopy()) if self._keep_base and not staged else None
        self.keeps_references = not self._copies

    def seal(self) -> None:
        self.staging.seal()
        if self._narrowed:
            self._count_overflows(self.staging.items())

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

    def _count_overflows(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            held = self._narrowed.get(name)
            if held is not None:
                self._overflows[name] = overflows(tensor, held)

    def land(self) -> None:
        """Load what a staged sync kept (the receiver calls it as the sync commits)."""
        items = self.staging.items()
        start = time.perf_counter()
        try:
            with torch.no_grad():
                self._load_weights(iter(items))
        finally:
            self.staging.release()  # loaded or not, the stage is spent
        self.staging.swap_s = time.perf_counter() - start
        self._received.update(zip((name for name, _ in items), self.staging.sums()))

    def discard(self) -> None:
        """Drop what a staged sync kept: it failed, the model was never touched."""
        self.staging.release()

    @property
    def records_checksums(self) -> bool:
        return self._record

    def local_specs(self) -> list[TensorSpec] | None:
        return self._expected

    def destinations(self, manifest: Manifest) -> list[torch.Tensor | None]:
        if self.staged:
            return list(self.staging.open(manifest, self.device))
        return [None] * len(manifest.specs)

    def keep_base(self, keep: bool) -> None:
        """Keep a copy of the wire bytes handed over, to apply deltas to (a delta session; one
        already kept stays, with what the worker holds), or drop it. A staging sink keeps none:
        its worker takes dense syncs."""
        self._keep_base = keep
        self._copy = (self._copy or WireCopy()) if keep and not self.staged else None

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
        if self.staged:  # every tensor has a destination in the stage
            raise WeightSyncError(f"a staging LoadWeightsSink was handed {len(items)} tensor(s) outside its stage")
        if self._copy is not None:
            self._copy.keep(items)
        self._take(items)

    def _take(self, items: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            self._count_overflows(items)
            if self._record:
                for name, tensor in items:
                    self._received[name] = word_sum(tensor)
            self._load_weights(iter(items))

    def checksums(self, manifest: Manifest) -> list[int] | None:
        """What the sink holds, or with a staged sync waiting for its commit, what it will
        hold once that lands (what a verified commit checks first)."""
        staged = self.staging.checksums()
        if staged is not None:
            return staged
        sums = self._received
        if not self._record or any(spec.name not in sums for spec in manifest.specs):
            return None
        return read_checksums([sums[spec.name] for spec in manifest.specs])

    def direct_tensors(self, manifest: Manifest) -> None:
        return None

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        raise TypeError("LoadWeightsSink transforms tensors on load; it cannot take direct writes")
