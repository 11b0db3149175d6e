"""A staged sync: the next version's bytes kept aside until one swap puts them in place.

A worker that stages receives each sync into a :class:`Stage` instead of into its model:
every tensor of the manifest, in the wire's dtype, at an aligned offset of one allocation.
What it serves (or what its own code reads) stays version N while version N+1 arrives; a
sync that fails before its swap never touches the model, and the swap at the commit is one
copy of the staged bytes into the model (a module's tensors; an engine's ``load_weights``).

Where the stage lives (``place``):

* ``"device"``: on the worker's device (on a CPU worker, its memory);
* ``"host"``: in host memory, pinned on a GPU so that the swap's copies run at full speed;
* ``"auto"``: the device when its free memory holds the stage with room to spare
  (:data:`HEADROOM`), else the host.

A stage is allocated when a sync starts and released after its swap, or its failure, so
nothing is held between syncs; ``keep=True`` keeps it for the next sync of the same
manifest and device (no allocation per sync, at the cost of the memory). On a GPU,
memory given back goes to torch's caching allocators, which keep it for reuse until
``torch.cuda.empty_cache()``. A sink's staging, per sync (done by the sinks and the
receiver)::

    views = staging.open(manifest, device)  # per spec, a tensor the transport writes into
    staging.seal(manifest)                  # every byte arrived (the checksums are taken here)
    staging.items()                         # (name, view) in manifest order, for the swap
    staging.release()                       # after the swap, or after a failure
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import torch

from weightsync.core.packing import read_checksums, tensor_checksums, typed_view, word_sum
from weightsync.core.wire.errors import SettingsError, WeightSyncError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.plan import align_up
from weightsync.core.wire.report import STAGE_PLACES, StageReport
from weightsync.mechanisms.batched_copy import BatchedCopier, CopyPlan, plan_key

#: What ``place`` may say.
PLACES = ("auto", *STAGE_PLACES)
#: ``"auto"`` stages on a GPU only when that leaves this share of the stage, and at least
#: :data:`MIN_HEADROOM_BYTES`, free besides (the engine's own allocations must not fail).
HEADROOM = 0.125
MIN_HEADROOM_BYTES = 256 << 20
#: Offsets of staged tensors are multiples of this (and of the manifest's alignment), so
#: every dtype view is legal and device copies run vectorized.
STAGE_ALIGNMENT = 256


def check_place(place: object, what: str = "stage") -> str:
    if place not in PLACES:
        raise SettingsError(f"{what} must be one of {', '.join(map(repr, PLACES))}, got {place!r}")
    assert isinstance(place, str)
    return place


def resolve_place(place: str, device: torch.device, nbytes: int) -> str:
    """Where a stage of ``nbytes`` for ``device`` goes: ``place`` itself, or for ``"auto"``
    the device when it has room (always, for a CPU device: its memory is the host's)."""
    if place != "auto":
        return place
    if device.type != "cuda":
        return "device"
    free, _ = torch.cuda.mem_get_info(device)
    spare = max(int(nbytes * HEADROOM), MIN_HEADROOM_BYTES)
    return "device" if free >= nbytes + spare else "host"


class Stage:
    """One allocation holding every tensor of ``manifest``, in its wire dtypes, on ``device``
    (``where="device"``) or in host memory (``where="host"``, pinned for a GPU)."""

    def __init__(self, manifest: Manifest, device: torch.device, where: str) -> None:
        if where not in STAGE_PLACES:
            raise SettingsError(f"a stage lives on the device or the host, got {where!r}")
        self.manifest = manifest
        self.device = device
        self.where = where
        alignment = max(manifest.agreed.alignment, STAGE_ALIGNMENT)
        offsets = []
        cursor = 0
        for spec in manifest.specs:
            cursor = align_up(cursor, alignment)
            offsets.append(cursor)
            cursor += spec.nbytes
        self.nbytes = align_up(max(cursor, 1), alignment)
        self.buffer = _allocate(self.nbytes, device, where)
        self.views = [typed_view(self.buffer, o, s) for o, s in zip(offsets, manifest.specs)]

    def fits(self, manifest: Manifest, device: torch.device, where: str) -> bool:
        """Whether this stage serves a sync of ``manifest`` on ``device`` in ``where`` as it is
        (a manifest of the same tensors and alignment: a new session of the same model)."""
        same = self.manifest is manifest or (
            self.manifest.specs == manifest.specs and self.manifest.agreed.alignment == manifest.agreed.alignment
        )
        return same and self.device == device and self.where == where

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return [(spec.name, view) for spec, view in zip(self.manifest.specs, self.views)]


def _allocate(nbytes: int, device: torch.device, where: str) -> torch.Tensor:
    pinned = where == "host" and device.type == "cuda"
    try:
        if where == "host":
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        other = "host" if where == "device" else "device"
        raise WeightSyncError(
            f"cannot allocate a stage of {nbytes / 1e6:.1f} MB in {where} memory "
            f"({'pinned host' if pinned else device}): {type(exc).__name__}: {exc}; stage on the {other} "
            "(stage='auto' picks by free memory) or stop staging"
        ) from exc


class Staging:
    """A sink's stage from sync to sync (see the module doc): opened by each sync's
    destinations, sealed once every byte arrived, then swapped in or discarded.

    ``record``: take the checksum of every staged tensor when the stage is sealed (after
    the transfer, before the swap), so a verified commit and a later ``verify`` see what
    the worker holds without reading it again during the swap."""

    def __init__(self, place: str = "auto", keep: bool = False, record: bool = True) -> None:
        self.place = check_place(place)
        if not isinstance(keep, bool):
            raise SettingsError(f"keep_stage must be True or False, got {keep!r}")
        self.keep = keep
        self.record = record
        self._stage: Stage | None = None
        #: Where the last stage lived and its bytes (reported after it is released).
        self._placed: tuple[str, int] | None = None
        #: Every byte of a sync is in the stage, waiting for its swap.
        self.pending = False
        self._sums: list[torch.Tensor] = []
        #: Seconds of the last swap (set by the sink that swapped).
        self.swap_s = 0.0

    @property
    def stage(self) -> Stage | None:
        return self._stage

    def open(self, manifest: Manifest, device: torch.device) -> list[torch.Tensor]:
        """This sync's stage (a kept one when it fits), as one tensor per spec to receive into."""
        if self.pending:
            raise WeightSyncError(
                "a staged sync's bytes wait for their swap: a second sync cannot write the stage before "
                "the first one commits or fails"
            )
        where = resolve_place(self.place, device, _stage_bytes(manifest))
        stage = self._stage
        if stage is None or not stage.fits(manifest, device, where):
            self._stage = None  # the old one goes before the new one is allocated
            stage = self._stage = Stage(manifest, device, where)
        self._placed = (stage.where, stage.nbytes)
        self._sums = []
        self.swap_s = 0.0
        return list(stage.views)

    def seal(self) -> None:
        """Every byte of the sync is in the stage; it now waits for its swap."""
        stage = self._required()
        if self.record:
            with torch.no_grad():
                self._sums = [word_sum(v) for v in stage.views]
        self.pending = True

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return self._required().items()

    def sums(self) -> list[torch.Tensor]:
        """Per spec, the checksum of the sealed stage (empty unless ``record``)."""
        return list(self._sums)

    def checksums(self) -> list[int] | None:
        """Per spec, the checksum of the sealed stage (what the worker will hold), or None
        when no stage waits for its swap."""
        if not self.pending:
            return None
        if self.record:
            return read_checksums(self._sums)
        return tensor_checksums(self._required().views)

    def release(self) -> None:
        """The sync is over (swapped or failed): drop the stage, unless it is kept."""
        self.pending = False
        if not self.keep:
            self._stage = None

    def drop(self) -> None:
        """Release the stage whatever ``keep`` says (staging turned off, the worker closes)."""
        self.pending = False
        self._stage = None

    def report(self) -> StageReport | None:
        """Where the last sync's stage lived, its bytes and its swap (None before any)."""
        if self._placed is None:
            return None
        where, nbytes = self._placed
        return StageReport(where=(where,), part_bytes=(nbytes,), kept=self.keep, swap_s=self.swap_s)

    def _required(self) -> Stage:
        if self._stage is None:
            raise WeightSyncError("no stage is open: a staged sync writes its destinations first")
        return self._stage


def _stage_bytes(manifest: Manifest) -> int:
    alignment = max(manifest.agreed.alignment, STAGE_ALIGNMENT)
    cursor = 0
    for spec in manifest.specs:
        cursor = align_up(cursor, alignment) + spec.nbytes
    return cursor


def one_device(held: Sequence[torch.Tensor]) -> torch.device:
    """The one device a module's tensors are on (its stage goes there)."""
    devices = sorted({str(t.device) for t in held})
    if len(devices) > 1:
        raise WeightSyncError(
            f"a staging ModuleSink needs the module on one device, found tensors on {', '.join(devices)}; "
            "move the module to one device or stage without it"
        )
    return held[0].device if held else torch.device("cpu")


def copy_in(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], plans: CopyPlans) -> float:
    """Copy each staged tensor into its destination (the swap of a module sink); returns
    the seconds, the copies finished (a GPU is synchronized). On a GPU, device to device,
    one launch of the batched copy kernel (``weightsync.mechanisms.batched_copy``) where
    CuPy is installed; every other pair (from pinned host memory, on a CPU) one ``copy_``."""
    start = time.perf_counter()
    with torch.no_grad():
        left = plans.run(destinations, sources)
        for index in left:
            destinations[index].copy_(sources[index], non_blocking=True)
        devices = {d.device for d in destinations if d.device.type == "cuda"}
        for device in devices:
            torch.cuda.synchronize(device)
    return time.perf_counter() - start


class CopyPlans:
    """A staging sink's batched copy plan (on a GPU), kept while the stage and the model's
    tensors stay where they were."""

    def __init__(self) -> None:
        self._plan: CopyPlan | None = None
        self._key: object = None

    def run(self, destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> list[int]:
        """Queue the kernel's copies; returns the indices of the pairs it cannot take."""
        device = destinations[0].device if destinations else torch.device("cpu")
        if device.type != "cuda" or any(s.device != device for s in sources):
            return list(range(len(destinations)))
        copier = _copier(device.index if device.index is not None else torch.cuda.current_device())
        if copier is None:
            return list(range(len(destinations)))
        key = (plan_key(sources), plan_key(destinations))
        if self._plan is None or key != self._key:
            self._plan, self._key = copier.plan(destinations, sources, key=key[0]), key
        copier.launch(self._plan, torch.cuda.current_stream(device))
        return list(self._plan.leftovers)


@functools.cache
def _copier(index: int) -> BatchedCopier | None:
    return BatchedCopier.create(torch.device("cuda", index))
