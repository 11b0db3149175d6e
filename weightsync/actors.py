"""Ray actors for the trainer and the workers, and the mixins they are made of.

Real RLHF stacks already have their own trainer and inference actors: mix
:class:`TrainerMixin` or :class:`WorkerMixin` into them (they need ``self.model``, or an
override of ``weightsync_model()``) and hand the actor handles to
:class:`~weightsync.coordinator.WeightSync`. The ``ws_*`` methods are the coordinator's
protocol; they are public so the mixins work inside any actor, not for calling by hand.
Each answers with an :class:`~weightsync.wire.outcome.Outcome` (failures as data: the
error's class, message and whom it blames), never by raising.

:class:`TrainerActor` and :class:`WorkerActor` are ready-made actors around a
``model_factory``; their options are declared arguments, so a misspelt one fails the
actor's construction (and setup names the worker)::

    trainer = TrainerActor.remote(model_factory, device="cpu", wire_dtype=torch.bfloat16)
    worker = WorkerActor.remote(model_factory, device="cpu", sink="module")

A sharded trainer is a list of rank actors whose models hold DTensors (FSDP2): give each
rank a :class:`~weightsync.ranks.RankSpec` (``rank=``), so its ``model_factory`` can call
``torch.distributed.init_process_group()`` and ``fully_shard``; :func:`trainer_ranks`
starts them all::

    ranks = trainer_ranks(fsdp_factory, world_size=2, wire_dtype=torch.bfloat16)
    WeightSync(ranks, workers)
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import ray
import torch
from torch import nn

from weightsync.push import Pusher
from weightsync.ranks import RankSpec
from weightsync.receiver import WeightReceiver
from weightsync.sender import WeightSender
from weightsync.sharded import ShardedSender, has_dtensors
from weightsync.sinks import LoadWeightsSink, ModuleSink, Sink
from weightsync.transport.gloo import GlooCommunicator, open_store
from weightsync.wire.errors import SettingsError, SyncError
from weightsync.wire.manifest import Manifest
from weightsync.wire.messages import (
    DirectExport,
    EndpointInfo,
    GroupSpec,
    IpcExport,
    PushExport,
    PushResult,
    SourceLayout,
    SyncCall,
)
from weightsync.wire.outcome import Outcome, Status, assign_blame, describe_failure, failed, ok
from weightsync.wire.settings import SyncSettings
from weightsync.wire.sizing import BufferHints, free_memory_bytes


def _answer(party: str, phase: str, fn: Callable[..., Any], *args: Any) -> Outcome:
    """Run ``fn(*args)`` and turn its result, or the exception it raised, into an Outcome."""
    try:
        return ok(party, phase, fn(*args))
    except Exception as exc:  # noqa: BLE001 - the failure travels as data, with its class and blame
        return failed(party, phase, exc)


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
        free_bytes=free_memory_bytes(device),
    )


def _communicator(spec: GroupSpec, device: torch.device, members: Sequence[str], store: Any = None) -> Any:
    if spec.backend == "nccl":
        from weightsync.transport.nccl import NcclCommunicator

        assert spec.nccl_id is not None
        return NcclCommunicator(spec.nccl_id, spec.rank, spec.world_size, device, spec.timeout_s, members)
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
    ``weightsync_model``); optionally ``self.device`` and ``self.wire_dtype``."""

    _ws_store: Any = None
    _ws_pusher: Pusher | None = None

    def weightsync_model(self) -> nn.Module:
        return self.model  # type: ignore[attr-defined, no-any-return]

    def weightsync_device(self) -> torch.device:
        return _resolve_device(getattr(self, "device", "cpu"))

    def _ws(self) -> WeightSender:
        sender = getattr(self, "_ws_sender", None)
        if sender is None:
            model = self.weightsync_model()
            kind = ShardedSender if has_dtensors(model) else WeightSender
            sender = kind(
                model=model,
                device=self.weightsync_device(),
                wire_dtype=getattr(self, "wire_dtype", None),
            )
            self._ws_sender = sender
        return sender

    def ws_describe(self) -> Outcome:
        return _answer("trainer", "describe", _describe, self.weightsync_device(), True)

    def ws_manifest(
        self,
        settings: SyncSettings,
        party: str = "trainer",
        ranks: Sequence[str] = (),
        hints: BufferHints | None = None,
    ) -> Outcome:
        """The manifest of the model as it is now; ``party``/``ranks``: this rank's name and
        every rank's, in rank order (a sharded trainer checks it was given its mesh's order);
        ``hints``: what ``buffer_bytes="auto"`` is sized from."""

        def build() -> Manifest:
            sender = self._ws()
            if isinstance(sender, ShardedSender):
                sender.bind(party, ranks)
            sender.name = party
            return sender.manifest(settings, hints)

        return _answer(party, "manifest", build)

    def ws_layout(self, party: str = "trainer") -> Outcome:
        """Whether this rank's model is sharded (DTensors) and over which mesh: the ranks of one
        trainer must agree (a plain rank among sharded ones would never join their gathers)."""

        def layout() -> SourceLayout:
            sender = self._ws()
            return sender.layout() if isinstance(sender, ShardedSender) else SourceLayout(sharded=False)

        return _answer(party, "layout", layout)

    def ws_open_store(self, world_size: int, timeout_s: float, host: str) -> Outcome:
        def open_it() -> tuple[str, int]:
            self._ws_store = open_store(host, 0, world_size, timeout_s)
            return host, int(self._ws_store.port)

        return _answer("trainer", "store", open_it)

    def ws_nccl_id(self) -> Outcome:
        from weightsync.transport.nccl import make_unique_id

        return _answer("trainer", "nccl id", make_unique_id)

    def ws_join_broadcast(self, spec: GroupSpec, members: Sequence[str]) -> Outcome:
        def join() -> None:
            comm = _communicator(spec, self.weightsync_device(), members, self._ws_store)
            self._ws().open_broadcast(comm, members, spec.timeout_s)

        return _answer("trainer", "join", join)

    def ws_export_ipc(self, consumer_names: list[str], timeout_s: float) -> Outcome:
        return _answer("trainer", "export", self._ws().export_ipc, consumer_names, timeout_s)

    def ws_seal_ipc(self) -> Outcome:
        ipc = self._ws().ipc
        return _answer("trainer", "seal", ipc.seal if ipc is not None else lambda: None)

    def ws_map_direct(self, export: DirectExport, timeout_s: float) -> Outcome:
        return _answer("trainer", "map", self._ws().map_direct, export, timeout_s)

    def ws_send(self, call: SyncCall) -> Outcome:
        """The trainer's side of one sync; each worker's receive runs alongside it."""
        return _answer("trainer", "send", self._ws().send, call)

    def ws_checksums(self) -> Outcome:
        return _answer("trainer", "checksums", self._ws().checksums)

    # push mode ----------------------------------------------------------------------------
    def ws_arm(self, exports: Sequence[PushExport], timeout_s: float) -> Outcome:
        def arm() -> None:
            self._ws_close_pusher()
            pusher = Pusher(timeout_s)
            pusher.attach(exports)
            self._ws_pusher = pusher

        return _answer("trainer", "arm", arm)

    def ws_push(self, call: SyncCall) -> Outcome:
        """Push mode: one sync of the listening workers (``WeightSync.sync`` calls this)."""
        return _answer("trainer", "push", self._ws_push, call)

    def _ws_push(self, call: SyncCall) -> PushResult:
        pusher = self._ws_pusher
        if pusher is None:
            raise SettingsError("push needs WeightSync(..., push=True) set up with this trainer first")
        if not call.direct:
            call = replace(call, direct=pusher.workers, kinds=("direct",))
        return pusher.push(self._ws().send, call)

    def weightsync_push(self, version: int, verify: bool = False, force: bool = False) -> PushResult:
        """Sync ``version`` to every listening worker from inside this actor's own method.

        For a loop that trains and pushes in one call (no Ray call for the sync at all)::

            def train_and_push(self, step):
                ...optimizer.step()...
                return self.weightsync_push(version=step)

        Raises :class:`~weightsync.wire.errors.SyncError` naming the culprits when any worker
        failed; run ``WeightSync.setup()`` from the driver before the next push then.
        """
        result = self._ws_push(SyncCall(seq=0, version=version, verify=verify, force=force))
        if result.setup_needed:
            raise SettingsError("an earlier push failed: run WeightSync.setup() before pushing again")
        if not result.ok:
            outcomes = {"trainer": result.sent, **{n: a.outcome for n, a in result.workers.items()}}
            culprits = assign_blame(outcomes)
            dead = sorted(n for n, o in outcomes.items() if o.status is Status.DEAD)
            held = {n: (a.version, a.state) for n, a in result.workers.items() if a.state != "unknown"}
            title = f"push of version {version} failed"
            raise SyncError(describe_failure(title, outcomes, culprits), outcomes, culprits, dead, held)
        return result

    def _ws_close_pusher(self) -> None:
        pusher = getattr(self, "_ws_pusher", None)
        self._ws_pusher = None
        if pusher is not None:
            pusher.close()

    def ws_teardown(self, abort: bool = False) -> Outcome:
        def teardown() -> None:
            self._ws_close_pusher()
            sender = getattr(self, "_ws_sender", None)
            if sender is not None:
                sender.close_transports(abort)
            self._ws_store = None

        return _answer("trainer", "teardown", teardown)


class WorkerMixin:
    """Weight-sync methods for an inference worker actor. Needs ``self.model`` (or override
    ``weightsync_model``); set ``self.weightsync_sink`` to a Sink to load another way, and
    optionally ``self.expect_buffer_bytes`` / ``self.expect_num_buffers`` /
    ``self.expect_inplace_bytes``."""

    def weightsync_model(self) -> nn.Module:
        return self.model  # type: ignore[attr-defined, no-any-return]

    def weightsync_device(self) -> torch.device:
        return _resolve_device(getattr(self, "device", "cpu"))

    def _wr(self) -> WeightReceiver:
        receiver = getattr(self, "_ws_receiver", None)
        if receiver is None:
            sink: Sink | None = getattr(self, "weightsync_sink", None)
            receiver = WeightReceiver(
                sink if sink is not None else ModuleSink(self.weightsync_model()),
                self.weightsync_device(),
                "worker",
                getattr(self, "expect_buffer_bytes", None),
                getattr(self, "expect_num_buffers", None),
                getattr(self, "expect_inplace_bytes", None),
            )
            self._ws_receiver = receiver
        return receiver

    def _me(self) -> str:
        receiver = getattr(self, "_ws_receiver", None)
        return receiver.name if receiver is not None else "worker"

    def ws_describe(self) -> Outcome:
        sink = getattr(self, "weightsync_sink", None)
        return _answer(
            self._me(), "describe", _describe, self.weightsync_device(), not isinstance(sink, LoadWeightsSink)
        )

    def ws_accept(self, manifest: Manifest, name: str) -> Outcome:
        def accept() -> None:
            receiver = self._wr()
            receiver.name = name
            receiver.accept(manifest)

        return _answer(name, "accept", accept)

    def ws_join_broadcast(self, spec: GroupSpec, members: Sequence[str]) -> Outcome:
        def join() -> None:
            self._wr().open_broadcast(_communicator(spec, self.weightsync_device(), members), members, spec.timeout_s)

        return _answer(self._me(), "join", join)

    def ws_attach_ipc(self, export: IpcExport, index: int, timeout_s: float) -> Outcome:
        return _answer(self._me(), "attach", self._wr().attach_ipc, export, index, timeout_s)

    def ws_export_direct(self, timeout_s: float) -> Outcome:
        return _answer(self._me(), "export", self._wr().export_direct, timeout_s)

    def ws_seal_direct(self) -> Outcome:
        target = self._wr().direct
        return _answer(self._me(), "seal", target.seal if target is not None else lambda: None)

    def ws_listen(self, timeout_s: float) -> Outcome:
        """Push mode: start this direct worker's listener; the trainer attaches its mailbox."""
        return _answer(self._me(), "listen", self._wr().listen, timeout_s)

    def ws_seal_listen(self) -> Outcome:
        return _answer(self._me(), "seal", self._wr().seal_listen)

    @contextlib.contextmanager
    def weightsync_reading(self) -> Iterator[None]:
        """Hold while reading the weights in push mode: a sync never writes meanwhile."""
        with self._wr().reading():
            yield

    def ws_receive(self, call: SyncCall) -> Outcome:
        """This worker's side of one sync (every transport); commits unless it is a broadcast."""
        return _answer(self._me(), "receive", self._wr().receive, call)

    def ws_commit(self, call: SyncCall, sent: Outcome, received: Outcome) -> Outcome:
        """A broadcast worker takes the version once the trainer's side and its own receive are
        known. Both arrive as Ray object refs, so Ray starts this as soon as both answered."""
        return _answer(self._me(), "commit", self._wr().commit, call, sent, received)

    def ws_settle(self) -> Outcome:
        return _answer(self._me(), "settle", self._wr().settle)

    def ws_checksums(self) -> Outcome:
        return _answer(self._me(), "checksums", self._wr().checksums)

    def ws_status(self) -> tuple[int | None, str]:
        return self._wr().status()

    def ws_teardown(self, abort: bool = False) -> Outcome:
        def teardown() -> None:
            receiver = getattr(self, "_ws_receiver", None)
            if receiver is not None:
                receiver.close_transports(abort)

        return _answer(self._me(), "teardown", teardown)


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
    """Shared body of the ready-made actors: builds the model and runs ``call``. With
    ``rank``, torch's rendezvous variables are set before ``model_factory`` runs."""

    def __init__(
        self, model_factory: Callable[[], nn.Module], device: str = "cpu", rank: RankSpec | None = None
    ) -> None:
        if rank is not None:
            if not isinstance(rank, RankSpec):
                raise SettingsError(f"rank must be a RankSpec, got {type(rank).__name__}")
            os.environ.update(rank.env())
        self.device = _resolve_device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        model = model_factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model_factory must return an nn.Module, got {type(model).__name__}")
        self.model = model.to(self.device)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(model, *args, **kwargs)`` here and return its result."""
        return fn(self.model, *args, **kwargs)

    def pid(self) -> int:
        return os.getpid()


class _Trainer(_ModelHost, TrainerMixin):
    """Holds the policy being trained. ``wire_dtype`` (e.g. torch.bfloat16) casts floating
    tensors on the wire; ``rank`` makes it one rank of a sharded trainer (see the module doc)."""

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        device: str = "cpu",
        wire_dtype: torch.dtype | None = None,
        rank: RankSpec | None = None,
    ) -> None:
        super().__init__(model_factory, device, rank)
        if wire_dtype is not None and not (isinstance(wire_dtype, torch.dtype) and wire_dtype.is_floating_point):
            raise SettingsError(f"wire_dtype must be a floating torch.dtype, got {wire_dtype!r}")
        self.wire_dtype = wire_dtype


class _Worker(_ModelHost, WorkerMixin):
    """Holds an inference copy. ``sink="load_weights"`` loads through the model's
    ``load_weights`` method; ``expect_buffer_bytes``/``expect_num_buffers`` pin the buffer
    settings this worker accepts."""

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        device: str = "cpu",
        sink: str = "module",
        expect_buffer_bytes: int | None = None,
        expect_num_buffers: int | None = None,
        expect_inplace_bytes: int | None = None,
    ) -> None:
        super().__init__(model_factory, device)
        self.expect_buffer_bytes = expect_buffer_bytes
        self.expect_num_buffers = expect_num_buffers
        self.expect_inplace_bytes = expect_inplace_bytes
        if sink == "load_weights":
            load = getattr(self.model, "load_weights", None)
            if load is None:
                raise SettingsError("sink='load_weights' needs a model with a load_weights method")
            self.weightsync_sink = LoadWeightsSink(load)
        elif sink != "module":
            raise SettingsError(f"sink must be 'module' or 'load_weights', got {sink!r}")

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(model, *args, **kwargs)`` here, never while a pushed sync writes the weights."""
        with self.weightsync_reading():
            return fn(self.model, *args, **kwargs)

    def version(self) -> tuple[int | None, str]:
        return self.ws_status()


# Typed as Any: Ray's stubs do not follow ``.options(...).remote(...)`` to actor handles.
TrainerActor: Any = ray.remote(_Trainer)
WorkerActor: Any = ray.remote(_Worker)


def trainer_ranks(
    model_factory: Callable[[], nn.Module],
    world_size: int,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int = 0,
    actor_options: dict[str, Any] | None = None,
    **trainer_options: Any,
) -> list[Any]:
    """Start the ``world_size`` ranks of one sharded trainer, in rank order.

    Each is a :class:`TrainerActor` given its :class:`RankSpec`; ``model_factory`` runs in
    every rank at once and joins the group (``init_process_group("gloo")`` on CPU) before
    sharding the model. ``master_addr`` must be reachable from every rank (the default
    loopback address suits ranks on this node); port 0 picks a free one here.
    """
    specs = RankSpec.group(world_size, master_addr, master_port)
    options = actor_options or {}
    return [TrainerActor.options(**options).remote(model_factory, rank=spec, **trainer_options) for spec in specs]
