"""The trainer's endpoint: which tensors travel, under which names and wire dtypes.

:class:`WeightSender` holds the model side of a transfer and the sending halves of the
transports opened for it. It imports no Ray: the actors wrap it, and any process layout can
drive it. One session, as the coordinator runs it::

    sender.manifest(settings)            -> Manifest (rebuilt from the model at every setup)
    open the transports: open_broadcast / export_ipc + seal_ipc / map_direct
    per sync: sender.send(call)          -> SendResult, alongside every worker's receive
    sender.close_transports(abort)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from weightsync.core.packing import tensor_checksums
from weightsync.core.sinks import TensorPaths, module_tensors
from weightsync.core.transport.base import SendHalf, Sources, shed_traceback
from weightsync.core.transport.batched_copy import PlanKey, plan_key
from weightsync.core.transport.broadcast import BroadcastSender, Communicator
from weightsync.core.transport.control import Deadlines
from weightsync.core.transport.direct import DirectWriter
from weightsync.core.transport.ipc import IpcSender
from weightsync.core.wire.errors import ModelChangedError, WeightSyncError
from weightsync.core.wire.manifest import Manifest, TensorSpec
from weightsync.core.wire.messages import DirectExport, IpcExport, SendResult, SyncCall
from weightsync.core.wire.settings import SyncSettings
from weightsync.core.wire.sizing import BufferHints, free_memory_bytes, resolve_buffer_bytes

Transform = Callable[[str, torch.Tensor], torch.Tensor]
ORDER = ("direct", "ipc", "broadcast")


def _known(free: int | None) -> tuple[int, ...]:
    return () if free is None else (free,)


@dataclass
class WeightSender:
    """The trainer's side. Reads (name, tensor) pairs from a module (or any source).

    ``wire_dtype`` casts floating tensors on the wire (fp32 master weights sent as bf16);
    the cast happens inside the copy into the buffer, so it costs no extra pass. A general
    ``transform(name, tensor)`` runs per sync instead and may allocate.
    """

    model: nn.Module | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    source: Callable[[], Sequence[tuple[str, torch.Tensor]]] | None = None
    wire_dtype: torch.dtype | None = None
    transform: Transform | None = None
    name: str = "trainer"

    def __post_init__(self) -> None:
        if self.model is None and self.source is None:
            raise ValueError("WeightSender needs a model or a source callable")
        self._manifest: Manifest | None = None
        self.halves: dict[str, SendHalf] = {}
        self._paths: TensorPaths | None = None  # how the last fully checked tensors were reached
        self._checked_key: PlanKey | None = None  # their layout when last checked
        self._timeout_s = SyncSettings().timeout_s  # the session's, set with the manifest

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        pairs = list(self.source()) if self.source is not None else module_tensors(self.model)  # type: ignore[arg-type]
        if self.transform is not None:
            pairs = [(n, self.transform(n, t.detach())) for n, t in pairs]
        return [(n, t.detach()) for n, t in pairs]

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        if self.wire_dtype is not None and dtype.is_floating_point:
            return self.wire_dtype
        return dtype

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec.of(n, t, self._wire(t.dtype)) for n, t in self.named_tensors()]

    def manifest(self, settings: SyncSettings, hints: BufferHints | None = None) -> Manifest:
        """Fix the wire contract for a new session from the model as it is now;
        ``buffer_bytes="auto"`` is resolved here, from ``hints`` (every party's free memory)."""
        self.close_transports()
        self._paths = None
        self._checked_key = None
        self._timeout_s = settings.timeout_s
        specs = self.specs()
        if hints is None:
            hints = BufferHints(device=self.device.type, free_bytes=_known(free_memory_bytes(self.device)))
        buffer_bytes = resolve_buffer_bytes(
            settings.buffer_bytes, specs, settings.num_buffers, settings.alignment, hints
        )
        self._manifest = Manifest.build(
            specs, buffer_bytes, settings.num_buffers, settings.alignment, settings.inplace_bytes
        )
        return self._manifest

    @property
    def current_manifest(self) -> Manifest:
        if self._manifest is None:
            raise WeightSyncError(f"{self.name}: no manifest yet; run setup()")
        return self._manifest

    def checked_sources(self) -> Sources:
        """This sync's tensors in manifest order and their :func:`plan_key`; refuses, naming
        the tensors, a model that changed since setup (added, removed, reshaped, re-typed).

        The tensors may be the module's own parameters, not detached (detaching 194 of them
        costs more than checking them): copy from them under ``torch.no_grad()``. Names are
        checked again only when the module's structure changed since the last check
        (:class:`TensorPaths`): walking and naming every tensor each sync costs more than
        the copies of a small model. The key of the last checked tensors is kept, and
        returned as the same object while nothing moved, so a copy plan keyed on it is
        reused with an identity check.
        """
        manifest = self.current_manifest
        plain = self.model is not None and self.source is None and self.transform is None
        paths = self._paths
        if plain and paths is not None and paths.unchanged():
            current = paths.tensors
            key = plan_key(current)
            if key == self._checked_key:
                return Sources(current, self._checked_key)
            if all(
                row[1] == spec.shape and self._wire(row[3]) == spec.torch_dtype
                for row, spec in zip(key, manifest.specs)
            ):
                self._checked_key = key
                return Sources(current, key)
        pairs = self.named_tensors()
        problems = self._changes(manifest, pairs)
        if problems:
            raise ModelChangedError(
                f"{self.name}: the model changed since setup (nothing was sent): {'; '.join(problems)}; "
                "run WeightSync.setup() again once every worker holds the same model"
            )
        tensors = [t for _, t in pairs]
        key = plan_key(tensors)
        if plain:
            self._paths = TensorPaths(self.model, manifest.names)  # type: ignore[arg-type]
            self._checked_key = key
        return Sources(tensors, key)

    def sources(self) -> list[torch.Tensor]:
        """This sync's tensors in manifest order, detached (see :meth:`checked_sources`)."""
        return [t.detach() for t in self.checked_sources().tensors]

    def _changes(self, manifest: Manifest, pairs: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
        now = {n: t for n, t in pairs}
        then = {s.name: s for s in manifest.specs}
        problems = [f"{n} added" for n in now if n not in then]
        problems += [f"{n} removed" for n in then if n not in now]
        for name in then.keys() & now.keys():
            spec, tensor = then[name], now[name]
            if tuple(tensor.shape) != spec.shape:
                problems.append(f"{name} is now {list(tensor.shape)}, was {list(spec.shape)}")
            elif self._wire(tensor.dtype) != spec.torch_dtype:
                problems.append(f"{name} is now {tensor.dtype}, the manifest sends {spec.dtype}")
        if not problems and [n for n, _ in pairs] != list(manifest.names):
            problems.append("the tensors' order changed")
        return sorted(problems)

    def checksums(self) -> list[int]:
        """Per tensor, the checksum of its bytes as they travel (after the wire cast)."""
        manifest = self.current_manifest
        sources = self.checked_sources()
        with torch.no_grad():
            return tensor_checksums([t.to(s.torch_dtype) for s, t in zip(manifest.specs, sources.tensors)])

    # one sync ---------------------------------------------------------------------------
    def send(self, call: SyncCall) -> SendResult:
        """The trainer's side of one sync: direct writes, then IPC, then the broadcast.

        Any failure is told to every peer of every transport at once (abort words, the
        broadcast agreement or a group abort) before it is raised.
        """
        start = time.perf_counter()
        # One deadline for the whole call, whichever transports it drives: the workers'
        # and the coordinator's deadlines are counted from the same moment.
        deadline = Deadlines(self._timeout_s).leader(time.monotonic())
        failure: BaseException | None = None
        try:
            checksums, stale = self.drive(self.checked_sources(), call, deadline)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the peers know
            failure = shed_traceback(exc)
        if failure is not None:
            self.abort_halves(call)
            raise failure
        return SendResult(checksums=checksums, stale=stale, seconds=time.perf_counter() - start)

    def drive(self, sources: Sources, call: SyncCall, deadline: float) -> tuple[dict[str, list[int]], tuple[str, ...]]:
        """Run this sync's halves over ``sources`` in :data:`ORDER`; (checksums per kind, stale workers)."""
        checksums: dict[str, list[int]] = {}
        stale: tuple[str, ...] = ()
        for kind in ORDER:
            half = self.halves.get(kind)
            if half is None or kind not in call.kinds:
                continue
            checksums[kind], found = half.send(sources, call, deadline)
            stale += found
        return checksums, stale

    def abort_halves(self, call: SyncCall) -> None:
        """Tell every peer of this sync's transports that this side failed."""
        for kind in ORDER:
            if kind in call.kinds and kind in self.halves:
                self.halves[kind].abort()

    # transports -------------------------------------------------------------------------
    def open_broadcast(self, comm: Communicator, members: Sequence[str], timeout_s: float) -> None:
        self._close("broadcast")
        self.halves["broadcast"] = BroadcastSender(comm, self.current_manifest, timeout_s, members)

    def export_ipc(self, consumer_names: Sequence[str], timeout_s: float) -> IpcExport:
        self._close("ipc")
        ipc = IpcSender(self.current_manifest, self.device, timeout_s, self.name)
        self.halves["ipc"] = ipc
        return ipc.export(consumer_names)

    @property
    def ipc(self) -> IpcSender | None:
        half = self.halves.get("ipc")
        return half if isinstance(half, IpcSender) else None

    @property
    def direct(self) -> DirectWriter | None:
        half = self.halves.get("direct")
        return half if isinstance(half, DirectWriter) else None

    def map_direct(self, export: DirectExport, timeout_s: float) -> None:
        writer = self.direct
        if writer is None:
            writer = DirectWriter(self.current_manifest, self.device, timeout_s, self.name)
            self.halves["direct"] = writer
        writer.map(export)

    def _close(self, kind: str, abort: bool = False) -> None:
        half = self.halves.pop(kind, None)
        if half is not None:
            half.close(abort)

    def close_transports(self, abort: bool = False) -> None:
        for kind in list(self.halves):
            self._close(kind, abort)
