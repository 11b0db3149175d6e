"""Ray actors for the trainer and the workers, and the mixins they are made of.

Real RLHF stacks already have their own trainer and inference actors: mix
:class:`TrainerMixin` or :class:`WorkerMixin` into them (they need ``self.model``, or an
override of ``weightsync_model()``) and hand the actor handles to
:class:`~weightsync.coordinator.WeightSync`. The ``ws_*`` methods are the coordinator's
protocol; they are public so the mixins work inside any actor, not for calling by hand.

:class:`TrainerActor` and :class:`WorkerActor` are ready-made actors around a
``model_factory``::

    trainer = TrainerActor.remote(model_factory, device="cpu")
    worker = WorkerActor.remote(model_factory, device="cpu")
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from torch import nn

from weightsync.endpoints import WeightReceiver, WeightSender, WorkerState
from weightsync.sinks import LoadWeightsSink, ModuleSink, Sink
from weightsync.spec import Manifest, WeightSyncError
from weightsync.transport.direct import DirectExport
from weightsync.transport.gloo import GlooCommunicator, open_store
from weightsync.transport.ipc import ChecksumMismatch, ChunkHandle, IpcExport


@dataclass(frozen=True)
class EndpointInfo:
    """Where an endpoint lives; the coordinator picks transports from this."""

    node_id: str
    node_ip: str
    hostname: str
    pid: int
    device: str
    gpu_uuid: str | None
    sink_allows_direct: bool


@dataclass(frozen=True)
class GroupSpec:
    """A broadcast group to join: rendezvous address, this rank, and the timeout."""

    name: str
    store_host: str
    store_port: int
    rank: int
    world_size: int
    timeout_s: float
    backend: str
    #: The NCCL unique id's 128 raw bytes (:func:`weightsync.transport.nccl.make_unique_id`).
    nccl_id: bytes | None = None


@dataclass
class ReceiveResult:
    """A worker's answer to one sync call."""

    worker: str
    version: int | None
    state: str
    checksums: list[int] = field(default_factory=list)
    seconds: float = 0.0
    #: Direct transport: tensors whose storage moved since the export (nothing written).
    moved: list[str] = field(default_factory=list)


def _resolve_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _describe(device: torch.device, allows_direct: bool) -> EndpointInfo:
    # An engine's worker process outside Ray (driven by an actor that forwards to it) has
    # no Ray node id; the coordinator then compares host names.
    in_ray = ray.is_initialized()
    uuid = None
    if device.type == "cuda":
        from weightsync.transport.cuda_ipc import gpu_uuid

        uuid = gpu_uuid(device.index or 0)
    return EndpointInfo(
        node_id=ray.get_runtime_context().get_node_id() if in_ray else "",
        node_ip=ray.util.get_node_ip_address() if in_ray else socket.gethostbyname(socket.gethostname()),
        hostname=socket.gethostname(),
        pid=os.getpid(),
        device=device.type,
        gpu_uuid=uuid,
        sink_allows_direct=allows_direct,
    )


def _communicator(spec: GroupSpec, device: torch.device, store: Any = None) -> Any:
    if spec.backend == "nccl":
        from weightsync.transport.nccl import NcclCommunicator

        assert spec.nccl_id is not None
        return NcclCommunicator(spec.nccl_id, spec.rank, spec.world_size, device, spec.timeout_s)
    return GlooCommunicator(
        spec.store_host,
        spec.store_port,
        spec.rank,
        spec.world_size,
        spec.name,
        spec.timeout_s,
        bind_host=spec.store_host,
        store=store,
    )


class TrainerMixin:
    """Weight-sync methods for a trainer actor. Needs ``self.model`` (or override
    ``weightsync_model``) and optionally ``self.device``."""

    _ws_store: Any = None

    def weightsync_model(self) -> nn.Module:
        return self.model  # type: ignore[attr-defined, no-any-return]

    def weightsync_device(self) -> torch.device:
        return _resolve_device(getattr(self, "device", "cpu"))

    def _ws(self) -> WeightSender:
        sender = getattr(self, "_ws_sender", None)
        if sender is None:
            sender = WeightSender(
                model=self.weightsync_model(),
                device=self.weightsync_device(),
                wire_dtype=getattr(self, "wire_dtype", None),
            )
            self._ws_sender = sender
        return sender

    def ws_describe(self) -> EndpointInfo:
        return _describe(self.weightsync_device(), True)

    def ws_manifest(self, buffer_bytes: int, num_buffers: int, alignment: int) -> Manifest:
        return self._ws().manifest(buffer_bytes, num_buffers, alignment)

    def ws_open_store(self, world_size: int, timeout_s: float, host: str) -> tuple[str, int]:
        self._ws_store = open_store(host, 0, world_size, timeout_s)
        return host, int(self._ws_store.port)

    def ws_nccl_id(self) -> bytes:
        from weightsync.transport.nccl import make_unique_id

        return make_unique_id()

    def ws_join_broadcast(self, spec: GroupSpec) -> None:
        comm = _communicator(spec, self.weightsync_device(), getattr(self, "_ws_store", None))
        self._ws().open_broadcast(comm, spec.timeout_s)

    def ws_export_ipc(self, consumer_names: list[str], timeout_s: float) -> IpcExport:
        return self._ws().export_ipc(consumer_names, timeout_s)

    def ws_seal_ipc(self) -> None:
        if self._ws().ipc is not None:
            self._ws().ipc.seal()  # type: ignore[union-attr]

    def ws_map_direct(self, export: DirectExport, timeout_s: float) -> None:
        self._ws().map_direct(export, timeout_s)

    def ws_send(
        self, broadcast: bool, ipc_consumers: list[int], sync_seq: int, direct: list[str], verify: bool
    ) -> dict[str, Any]:
        """One sync on the trainer: direct writes, then IPC, then the broadcast.

        Each worker's receive call runs alongside this one; the colocated transports meet
        it through their control blocks, with no Ray round trip in between. Returns the
        checksums per transport (with ``verify``), the direct workers skipped because their
        tensors moved (``direct_stale``), and the seconds spent here.
        """
        sender = self._ws()
        start = time.perf_counter()
        out: dict[str, Any] = {"broadcast": [], "ipc": [], "direct_stale": []}
        if direct:
            out["direct_stale"] = sender.write_direct(direct, sync_seq)
        if ipc_consumers:
            out["ipc"] = sender.send_ipc(sync_seq, ipc_consumers, verify)
        if broadcast:
            out["broadcast"] = sender.send_broadcast(verify)
        out["seconds"] = time.perf_counter() - start
        return out

    def ws_pack_ipc_chunk(self, chunk_index: int, slot: int) -> ChunkHandle:
        return self._ws().pack_ipc_chunk(chunk_index, slot)

    def ws_teardown(self, abort: bool = False) -> None:
        sender = getattr(self, "_ws_sender", None)
        if sender is not None:
            sender.close_transports(abort)
        self._ws_store = None

    def ws_digest(self) -> str:
        return self._ws().digest()

    def ws_forget_direct(self, worker: str) -> None:
        if self._ws().direct is not None:
            self._ws().direct.forget(worker)  # type: ignore[union-attr]


class WorkerMixin:
    """Weight-sync methods for an inference worker actor. Needs ``self.model`` (or override
    ``weightsync_model``); set ``self.weightsync_sink`` to a Sink to load another way."""

    def weightsync_model(self) -> nn.Module:
        return self.model  # type: ignore[attr-defined, no-any-return]

    def weightsync_device(self) -> torch.device:
        return _resolve_device(getattr(self, "device", "cpu"))

    def _wr(self, name: str | None = None) -> WeightReceiver:
        receiver = getattr(self, "_ws_receiver", None)
        if receiver is None:
            sink: Sink | None = getattr(self, "weightsync_sink", None)
            receiver = WeightReceiver(
                sink if sink is not None else ModuleSink(self.weightsync_model()),
                self.weightsync_device(),
                name or "worker",
                getattr(self, "expect_buffer_bytes", None),
                getattr(self, "expect_num_buffers", None),
            )
            self._ws_receiver = receiver
        if name is not None:
            receiver.name = name
        return receiver

    def ws_describe(self) -> EndpointInfo:
        sink = getattr(self, "weightsync_sink", None)
        return _describe(self.weightsync_device(), not isinstance(sink, LoadWeightsSink))

    def ws_accept(self, manifest: Manifest, name: str) -> None:
        self._wr(name).accept(manifest)

    def ws_join_broadcast(self, spec: GroupSpec) -> None:
        self._wr().open_broadcast(_communicator(spec, self.weightsync_device()), spec.timeout_s)

    def ws_attach_ipc(self, export: IpcExport, index: int, timeout_s: float) -> None:
        self._wr().attach_ipc(export, index, timeout_s)

    def ws_export_direct(self, timeout_s: float = 60.0) -> DirectExport:
        return self._wr().export_direct(timeout_s)

    def ws_seal_direct(self) -> None:
        receiver = self._wr()
        if receiver.direct is not None:
            receiver.direct.seal()

    def _result(self, checksums: list[int], start: float) -> ReceiveResult:
        r = self._wr()
        return ReceiveResult(r.name, r.version, r.state.value, checksums, time.perf_counter() - start)

    def _receive(self, version: int, force: bool, body: Callable[[], list[int]], commit: bool = False) -> ReceiveResult:
        receiver = self._wr()
        start = time.perf_counter()
        receiver.begin(version, force)
        try:
            checksums = body()
        except BaseException:
            receiver.fail()
            raise
        if commit:
            receiver.commit(version)
        return self._result(checksums, start)

    def ws_receive_broadcast(self, version: int, verify: bool, force: bool = False) -> ReceiveResult:
        """Receive every chunk; stays RECEIVING until ``ws_commit``, which runs only once the
        trainer's side succeeded too (a collective can return on a receiver whose root died)."""
        return self._receive(version, force, lambda: self._wr().receive_broadcast(verify))

    def ws_receive_ipc(self, version: int, sync_seq: int, verify: bool, force: bool = False) -> ReceiveResult:
        """Receive every chunk and commit ``version``: this side saw the trainer publish every
        chunk (and, with ``verify``, checked each one's checksum), so its weights are whole."""
        return self._receive(version, force, lambda: self._wr().receive_ipc(sync_seq, verify), commit=True)

    def ws_consume_ipc_chunk(self, handle: ChunkHandle) -> None:
        self._wr().consume_ipc_chunk(handle)

    def ws_receive_direct(self, version: int, sync_seq: int, force: bool = False) -> ReceiveResult:
        """The worker's side of a direct sync: announce, wait for the write, commit.

        Returns with ``moved`` set (version unchanged) when its tensors' storage moved
        since the export; the coordinator then re-exports and syncs this worker again.
        """
        start = time.perf_counter()
        moved = self._wr().receive_direct(version, sync_seq, force)
        result = self._result([], start)
        result.moved = moved
        return result

    def ws_commit(
        self, version: int, transport: str, verify: bool, sent: dict[str, Any], received: ReceiveResult | None = None
    ) -> ReceiveResult:
        """Take ``version`` once the trainer's side (``sent``) and this worker's receive
        (``received``) both succeeded; with ``verify``, only if every chunk's checksum
        matches the trainer's. Both arrive as Ray object refs: a failure on either side
        fails this call before it runs, so the version never moves on a failed sync."""
        receiver = self._wr()
        if verify and received is not None:
            expected = sent[transport]
            bad = [i for i, (a, b) in enumerate(zip(received.checksums, expected)) if a != b]
            if bad or len(received.checksums) != len(expected):
                receiver.fail()
                which = (
                    ", ".join(f"chunk {i}" for i in bad)
                    or f"{len(received.checksums)} checksums for {len(expected)} chunks"
                )
                raise ChecksumMismatch(f"{receiver.name}: checksum mismatch ({which}): bytes corrupted in transit")
        receiver.commit(version)
        seconds = received.seconds if received is not None else 0.0
        return ReceiveResult(receiver.name, receiver.version, receiver.state.value, [], seconds)

    def ws_mark_dirty(self) -> None:
        receiver = self._wr()
        if receiver.state is not WorkerState.COMMITTED:
            receiver.fail()

    def ws_status(self) -> tuple[int | None, str]:
        return self._wr().status()

    def ws_teardown(self, abort: bool = False) -> None:
        receiver = getattr(self, "_ws_receiver", None)
        if receiver is not None:
            receiver.close_transports(abort)

    def ws_digest(self) -> str:
        return self._wr().digest()

    def ws_debug_corrupt_next(self, chunk_index: int, byte: int = 0) -> None:
        """Fault injection for tests: flip one bit of ``chunk_index``'s received bytes, once."""
        receiver = self._wr()
        original = receiver.unpacker

        def corrupting_unpacker() -> Any:
            unpacker = original()
            inner = unpacker.unpack

            def unpack(chunk: Any, buffer: torch.Tensor) -> Any:
                if chunk.index == chunk_index:
                    buffer[byte] ^= 1
                    receiver.unpacker = original  # type: ignore[method-assign]
                return inner(chunk, buffer)

            unpacker.unpack = unpack  # type: ignore[method-assign]
            return unpacker

        receiver.unpacker = corrupting_unpacker  # type: ignore[method-assign]


#: The methods the coordinator calls on a worker; :func:`forward_worker_protocol` adds them
#: to an actor that hosts its model elsewhere (an inference engine's worker processes).
WORKER_PROTOCOL: tuple[str, ...] = tuple(
    name for name in vars(WorkerMixin) if name.startswith("ws_") and callable(getattr(WorkerMixin, name))
)


def forward_worker_protocol(cls: type) -> type:
    """Class decorator: give ``cls`` every method of :data:`WORKER_PROTOCOL`, each calling
    ``self.forward_weightsync(method_name, *args, **kwargs)``.

    For an actor whose model lives in processes it drives, such as an inference engine
    with its own workers (vLLM's ``collective_rpc``): those processes mix in
    :class:`WorkerMixin`, and this actor forwards the coordinator's calls to them. Apply it
    before ``ray.remote`` (Ray reads an actor's methods when the class is made remote)::

        @ray.remote
        @forward_worker_protocol
        class Engine:
            def forward_weightsync(self, method, *args, **kwargs):
                return self.llm.collective_rpc(method, args=args, kwargs=kwargs)[0]
    """
    if not callable(getattr(cls, "forward_weightsync", None)):
        raise TypeError(f"{cls.__name__} needs a forward_weightsync(method, *args, **kwargs) method")

    def forwarder(method: str) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self.forward_weightsync(method, *args, **kwargs)

        call.__name__ = call.__qualname__ = method
        call.__doc__ = f"Forwards {method} to the processes holding the model."
        return call

    for method in WORKER_PROTOCOL:
        if method not in vars(cls):
            setattr(cls, method, forwarder(method))
    return cls


class _ModelHost:
    """Shared body of the ready-made actors: builds the model and runs ``call``."""

    def __init__(self, model_factory: Callable[[], nn.Module], device: str = "cpu", **options: Any) -> None:
        self.device = _resolve_device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        model = model_factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model_factory must return an nn.Module, got {type(model).__name__}")
        self.model = model.to(self.device)
        for key, value in options.items():
            setattr(self, key, value)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(model, *args, **kwargs)`` here and return its result."""
        return fn(self.model, *args, **kwargs)

    def digest(self) -> str:
        return self.ws_digest()  # type: ignore[attr-defined, no-any-return]

    def pid(self) -> int:
        return os.getpid()


class _Trainer(_ModelHost, TrainerMixin):
    """Holds the policy being trained. Options: ``wire_dtype`` (e.g. torch.bfloat16)."""


class _Worker(_ModelHost, WorkerMixin):
    """Holds an inference copy. Options: ``sink="load_weights"`` to load through the
    model's ``load_weights`` method; ``expect_buffer_bytes``/``expect_num_buffers`` to pin
    the buffer settings this worker accepts."""

    def __init__(
        self, model_factory: Callable[[], nn.Module], device: str = "cpu", sink: str = "module", **options: Any
    ) -> None:
        super().__init__(model_factory, device, **options)
        if sink == "load_weights":
            load = getattr(self.model, "load_weights", None)
            if load is None:
                raise WeightSyncError("sink='load_weights' needs a model with a load_weights method")
            self.weightsync_sink = LoadWeightsSink(load)
        elif sink != "module":
            raise ValueError(f"sink must be 'module' or 'load_weights', got {sink!r}")

    def version(self) -> tuple[int | None, str]:
        return self.ws_status()


# Typed as Any: Ray's stubs do not follow ``.options(...).remote(...)`` to actor handles.
TrainerActor: Any = ray.remote(_Trainer)
WorkerActor: Any = ray.remote(_Worker)
