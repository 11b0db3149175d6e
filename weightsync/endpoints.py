"""In-process endpoints: a trainer's :class:`WeightSender` and a worker's :class:`WeightReceiver`.

These hold the model side of a transfer (which tensors, under which names and wire dtypes,
landing where) and the transports opened for it. They import no Ray: the actors wrap them,
and a user can drive them from any process layout. One session, as the coordinator runs it::

    sender.manifest(...)              -> Manifest           (trainer)
    receiver.accept(manifest)                              (each worker: refuses mismatches)
    open transports (broadcast group / ipc export+attach / direct export+map)
    per sync: sender.send_*(...) and receiver.receive_*(...) together, then commit
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from weightsync.packing import ChunkUnpacker
from weightsync.sinks import ModuleSink, Sink, TensorPaths, module_tensors
from weightsync.spec import (
    DEFAULT_ALIGNMENT,
    DEFAULT_BUFFER_BYTES,
    DEFAULT_NUM_BUFFERS,
    Manifest,
    ManifestError,
    TensorSpec,
    WeightSyncError,
    dtype_name,
)
from weightsync.transport.batched_copy import PlanKey, plan_key
from weightsync.transport.broadcast import BroadcastReceiver, BroadcastSender, Communicator
from weightsync.transport.direct import DirectExport, DirectTarget, DirectWriter
from weightsync.transport.ipc import ChunkHandle, IpcExport, IpcReceiver, IpcSender

Transform = Callable[[str, torch.Tensor], torch.Tensor]


class VersionError(WeightSyncError, ValueError):
    """A sync asked for a version that is not newer than the one a worker holds."""


class WorkerState(str, enum.Enum):
    COMMITTED = "committed"  # weights are exactly those of ``version``
    RECEIVING = "receiving"  # a sync is writing; weights must not be read
    DIRTY = "dirty"  # a sync failed midway; weights are a mix, ``version`` is the last good one


def digest_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes, in the given order."""
    h = hashlib.sha256()
    for name, tensor in named:
        h.update(f"{name}|{dtype_name(tensor.dtype)}|{list(tensor.shape)}|".encode())
        data = tensor.detach().contiguous().cpu()
        h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


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
        self.broadcast: BroadcastSender | None = None
        self.ipc: IpcSender | None = None
        self.direct: DirectWriter | None = None
        self._paths: TensorPaths | None = None  # how the last fully checked tensors were reached
        self._checked_key: PlanKey | None = None  # their layout when last checked

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        pairs = list(self.source()) if self.source is not None else module_tensors(self.model)  # type: ignore[arg-type]
        if self.transform is not None:
            pairs = [(n, self.transform(n, t.detach())) for n, t in pairs]
        return [(n, t.detach()) for n, t in pairs]

    def _wire(self, tensor: torch.Tensor) -> torch.dtype:
        if self.wire_dtype is not None and tensor.dtype.is_floating_point:
            return self.wire_dtype
        return tensor.dtype

    def specs(self) -> list[TensorSpec]:
        return [TensorSpec.of(n, t, self._wire(t)) for n, t in self.named_tensors()]

    def manifest(
        self,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        alignment: int = DEFAULT_ALIGNMENT,
    ) -> Manifest:
        """Fix the wire contract for this session (recomputed only when settings change)."""
        current = self._manifest
        if current is None or (current.buffer_bytes, current.num_buffers, current.alignment) != (
            buffer_bytes,
            num_buffers,
            alignment,
        ):
            self.close_transports()
            self._manifest = Manifest.build(self.specs(), buffer_bytes, num_buffers, alignment)
        assert self._manifest is not None
        return self._manifest

    @property
    def current_manifest(self) -> Manifest:
        if self._manifest is None:
            raise WeightSyncError(f"{self.name}: manifest() must be called before a transfer")
        return self._manifest

    def sources(self) -> list[torch.Tensor]:
        """This sync's tensors in manifest order, detached; see :meth:`checked_sources`."""
        return [t.detach() for t in self.checked_sources()[0]]

    def checked_sources(self) -> tuple[list[torch.Tensor], PlanKey]:
        """This sync's tensors in manifest order and their :func:`plan_key`; refuses a model
        that changed shape since setup.

        The tensors may be the module's own parameters, not detached (detaching 194 of them
        costs more than checking them): copy from them under ``torch.no_grad()``. Names are
        checked again only when the module no longer holds the very tensor objects it held
        at the last check: walking and naming every tensor each sync costs more than the
        copies of a small model. The key of the last checked tensors is kept, and returned
        as the same object while nothing moved, so a copy plan keyed on it is reused with
        an identity check.
        """
        manifest = self.current_manifest
        plain = self.model is not None and self.source is None and self.transform is None
        paths = self._paths
        if plain and paths is not None and paths.unchanged():
            current = paths.tensors
            key = plan_key(current)
            if key == self._checked_key:
                return current, self._checked_key
            if all(row[1] == spec.shape for row, spec in zip(key, manifest.specs)):
                self._checked_key = key
                return current, key
        pairs = self.named_tensors()
        if [n for n, _ in pairs] != list(manifest.names):
            raise ManifestError(f"{self.name}: the model's tensors changed since setup; run setup() again")
        for (name, tensor), spec in zip(pairs, manifest.specs):
            if tuple(tensor.shape) != spec.shape:
                raise ManifestError(
                    f"{self.name}: tensor {name} is now {list(tensor.shape)}, the manifest says "
                    f"{list(spec.shape)}; run setup() again"
                )
        tensors = [t for _, t in pairs]
        key = plan_key(tensors)
        if plain:
            self._paths = TensorPaths(self.model, manifest.names)  # type: ignore[arg-type]
            self._checked_key = key
        return tensors, key

    def digest(self) -> str:
        manifest = self.current_manifest
        return digest_tensors([(s.name, t.to(s.torch_dtype)) for s, t in zip(manifest.specs, self.sources())])

    # transports ------------------------------------------------------------------------
    def open_broadcast(self, comm: Communicator, timeout_s: float) -> None:
        self.close_broadcast()
        self.broadcast = BroadcastSender(comm, self.current_manifest, timeout_s)

    def send_broadcast(self, verify: bool = False) -> list[int]:
        if self.broadcast is None:
            raise WeightSyncError(f"{self.name}: no broadcast group is open")
        return self.broadcast.send(self.sources(), verify)

    def export_ipc(self, consumer_names: Sequence[str], timeout_s: float) -> IpcExport:
        self.close_ipc()
        self.ipc = IpcSender(self.current_manifest, self.device, timeout_s, self.name)
        return self.ipc.export(consumer_names)

    def send_ipc(self, sync_seq: int, consumers: Sequence[int], verify: bool = False) -> list[int]:
        if self.ipc is None:
            raise WeightSyncError(f"{self.name}: no IPC export is open")
        return self.ipc.send(self.sources(), sync_seq, consumers, verify)

    def pack_ipc_chunk(self, chunk_index: int, slot: int, verify: bool = False) -> ChunkHandle:
        if self.ipc is None:
            raise WeightSyncError(f"{self.name}: no IPC export is open")
        return self.ipc.pack(chunk_index, slot, self.sources(), verify)

    def map_direct(self, export: DirectExport, timeout_s: float) -> None:
        if self.direct is None:
            self.direct = DirectWriter(self.current_manifest, self.device, timeout_s, self.name)
        self.direct.map(export)

    def write_direct(self, workers: Sequence[str], sync_seq: int) -> list[str]:
        """Write into each worker's mapped tensors for sync ``sync_seq``, in turn; returns
        the workers skipped because their tensors moved since their export."""
        if self.direct is None:
            raise WeightSyncError(f"{self.name}: no direct export is mapped")
        sources, key = self.checked_sources()
        return [w for w in workers if not self.direct.write(w, sources, sync_seq, key)]

    def close_broadcast(self, abort: bool = False) -> None:
        if self.broadcast is not None:
            comm = self.broadcast.comm
            self.broadcast = None
            comm.abort() if abort else comm.close()

    def close_ipc(self) -> None:
        if self.ipc is not None:
            self.ipc.close()
            self.ipc = None

    def close_transports(self, abort: bool = False) -> None:
        self.close_broadcast(abort)
        self.close_ipc()
        if self.direct is not None:
            self.direct.close()
            self.direct = None


class WeightReceiver:
    """A worker's side: checks the Manifest, receives, and tracks its version and state."""

    def __init__(
        self,
        sink: Sink | nn.Module,
        device: torch.device | str = "cpu",
        name: str = "worker",
        expect_buffer_bytes: int | None = None,
        expect_num_buffers: int | None = None,
    ) -> None:
        self.sink: Sink = ModuleSink(sink) if isinstance(sink, nn.Module) else sink
        self.device = torch.device(device)
        self.name = name
        self._expect = (expect_buffer_bytes, expect_num_buffers)
        self.manifest: Manifest | None = None
        self.version: int | None = None
        self.state = WorkerState.COMMITTED
        self.broadcast: BroadcastReceiver | None = None
        self.ipc: IpcReceiver | None = None
        self.direct: DirectTarget | None = None
        self._closed_imports = [0, 0]

    def accept(self, manifest: Manifest) -> None:
        """Check ``manifest`` against this worker; raises naming every mismatch, moves nothing."""
        if not isinstance(manifest, Manifest):
            raise ManifestError(f"{self.name}: expected a Manifest, got {type(manifest).__name__}")
        manifest.validate()
        manifest.check_buffer_expectations(self.name, *self._expect)
        local = self.sink.local_specs()
        if local is not None:
            manifest.check_against(local, self.name)
        if self.manifest != manifest:
            self.close_transports()
        self.manifest = manifest

    def _manifest(self) -> Manifest:
        if self.manifest is None:
            raise WeightSyncError(f"{self.name}: no manifest accepted yet; run setup()")
        return self.manifest

    def unpacker(self) -> ChunkUnpacker:
        manifest = self._manifest()
        dests = self.sink.destinations(manifest)
        return ChunkUnpacker(manifest.specs, dests.__getitem__, self.sink.keeps_references)

    # version bracketing -------------------------------------------------------------------
    def check_version(self, version: int, force: bool = False) -> None:
        if self.version is not None and version <= self.version and not force:
            raise VersionError(
                f"{self.name}: version {version} is not newer than the version it holds "
                f"({self.version}); pass force=True to overwrite anyway"
            )

    def begin(self, version: int, force: bool = False) -> None:
        self.check_version(version, force)
        self.state = WorkerState.RECEIVING

    def commit(self, version: int) -> None:
        self.version = version
        self.state = WorkerState.COMMITTED

    def fail(self) -> None:
        self.state = WorkerState.DIRTY

    def status(self) -> tuple[int | None, str]:
        return self.version, self.state.value

    # transports ------------------------------------------------------------------------
    def open_broadcast(self, comm: Communicator, timeout_s: float) -> None:
        self.close_broadcast()
        self.broadcast = BroadcastReceiver(comm, self._manifest(), timeout_s)

    def receive_broadcast(self, verify: bool = False) -> list[int]:
        if self.broadcast is None:
            raise WeightSyncError(f"{self.name}: no broadcast group is open")
        return self.broadcast.receive(self.unpacker(), self.sink.consume, verify)

    def attach_ipc(self, export: IpcExport, consumer_index: int, timeout_s: float) -> None:
        self.close_ipc()
        self.ipc = IpcReceiver(self._manifest(), self.device, timeout_s, self.name)
        self.ipc.attach(export, consumer_index)

    def receive_ipc(self, sync_seq: int, verify: bool = False) -> list[int]:
        if self.ipc is None:
            raise WeightSyncError(f"{self.name}: no IPC export attached")
        return self.ipc.receive(sync_seq, self.unpacker(), self.sink.consume, verify)

    def consume_ipc_chunk(
        self, handle: ChunkHandle, unpacker: ChunkUnpacker | None = None, verify: bool = False
    ) -> int | None:
        if self.ipc is None:
            raise WeightSyncError(f"{self.name}: no IPC export attached")
        return self.ipc.consume(handle, unpacker or self.unpacker(), self.sink.consume, verify)

    def export_direct(self, timeout_s: float = 60.0) -> DirectExport:
        manifest = self._manifest()
        tensors = self.sink.direct_tensors(manifest)
        if tensors is None:
            raise WeightSyncError(
                f"{self.name}: its sink ({type(self.sink).__name__}) transforms tensors on load "
                "and cannot take direct writes; use transport='ipc' for this worker"
            )
        if self.direct is None:
            self.direct = DirectTarget(manifest, self.device, self.name, timeout_s)
        self.direct.timeout_s = timeout_s
        return self.direct.export(tensors, self.sink.rebind)

    def receive_direct(self, version: int, sync_seq: int, force: bool = False) -> list[str]:
        """The worker's side of a direct sync, started alongside the trainer's write.

        Returns the names of tensors whose storage moved since the export: nothing was
        written and the version did not move; re-export (setup does) and sync again.
        Otherwise waits for the trainer's write and commits ``version``.
        """
        target = self.direct
        if target is None:
            raise WeightSyncError(f"{self.name}: no direct export; run setup()")
        try:
            self.check_version(version, force)
            tensors = self.sink.direct_tensors(self._manifest())
            assert tensors is not None
        except BaseException:
            target.abort()
            raise
        self.state, before = WorkerState.RECEIVING, self.state
        moved = target.announce(sync_seq, tensors)
        if moved:
            self.state = before
            return moved
        try:
            target.await_written(sync_seq)
        except BaseException:
            self.fail()
            raise
        self.commit(version)
        return []

    def close_broadcast(self, abort: bool = False) -> None:
        if self.broadcast is not None:
            comm = self.broadcast.comm
            self.broadcast = None
            comm.abort() if abort else comm.close()

    def close_ipc(self) -> None:
        if self.ipc is not None:
            self.ipc.close()
            self._closed_imports[0] += self.ipc.importer.maps
            self._closed_imports[1] += self.ipc.importer.releases
            self.ipc = None

    def ipc_import_counts(self) -> tuple[int, int]:
        """(mappings made, mappings released) by this worker's IPC importers, all sessions."""
        maps, releases = self._closed_imports
        if self.ipc is not None:
            maps, releases = maps + self.ipc.importer.maps, releases + self.ipc.importer.releases
        return maps, releases

    def close_transports(self, abort: bool = False) -> None:
        self.close_broadcast(abort)
        self.close_ipc()
        if self.direct is not None:
            self.direct.close()
            self.direct = None

    def digest(self) -> str:
        manifest = self._manifest()
        held = module_tensors(self.sink.module) if isinstance(self.sink, ModuleSink) else None
        if held is None:
            raise WeightSyncError(f"{self.name}: digest needs a module sink")
        by_name = dict(held)
        return digest_tensors([(s.name, by_name[s.name]) for s in manifest.specs])
