"""Ray actors for the trainer and the workers, and the mixins they are made of.

Real RLHF stacks already have their own trainer and inference actors: mix
:class:`TrainerMixin` or :class:`WorkerMixin` into them (they need ``self.model``, or an
override of ``weightsync_model()``) and hand the actor handles to
:class:`~weightsync.glue.coordinator.WeightSync`. The ``ws_*`` methods are the coordinator's
protocol; they are public so the mixins work inside any actor, not for calling by hand.
Each answers with an :class:`~weightsync.core.wire.outcome.Outcome` (failures as data: the
error's class, message and whom it blames), never by raising.

:class:`TrainerActor` and :class:`WorkerActor` are ready-made actors around a
``model_factory``; their options are declared arguments, so a misspelt one fails the
actor's construction (and setup names the worker)::

    trainer = TrainerActor.remote(model_factory, device="cpu", wire_dtype=torch.bfloat16)
    worker = WorkerActor.remote(model_factory, device="cpu", sink="module")

A sharded trainer is a list of rank actors whose models hold DTensors (FSDP2): give each
rank a :class:`~weightsync.glue.ranks.RankSpec` (``rank=``), so its ``model_factory`` can call
``torch.distributed.init_process_group()`` and ``fully_shard``; :func:`trainer_ranks`
starts them all::

    ranks = trainer_ranks(fsdp_factory, world_size=2, wire_dtype=torch.bfloat16)
    WeightSync(ranks, workers)
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import ray
import torch
from torch import nn

from weightsync.core.sinks import LoadWeightsSink, ModuleSink, Sink
from weightsync.core.wire.dtypes import check_wire_dtype
from weightsync.core.wire.errors import SettingsError
from weightsync.glue.protocol import resolve_device
from weightsync.glue.ranks import RankSpec
from weightsync.glue.trainer_mixin import TrainerMixin
from weightsync.glue.worker_mixin import WORKER_PROTOCOL, WorkerMixin, forward_worker_protocol

__all__ = [
    "WORKER_PROTOCOL",
    "TrainerActor",
    "TrainerHost",
    "WorkerHost",
    "TrainerMixin",
    "WorkerActor",
    "WorkerMixin",
    "forward_worker_protocol",
    "trainer_ranks",
]


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
        self.device = resolve_device(device)
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


class TrainerHost(_ModelHost, TrainerMixin):
    """The class behind :data:`TrainerActor` (subclass it, then ``ray.remote``, to add
    methods). Holds the policy being trained. ``wire_dtype`` (e.g. torch.bfloat16) casts floating
    tensors on the wire; ``rank`` makes it one rank of a sharded trainer (see the module doc)."""

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        device: str = "cpu",
        wire_dtype: torch.dtype | None = None,
        rank: RankSpec | None = None,
    ) -> None:
        super().__init__(model_factory, device, rank)
        check_wire_dtype(wire_dtype)
        self.wire_dtype = wire_dtype


class WorkerHost(_ModelHost, WorkerMixin):
    """The class behind :data:`WorkerActor` (subclass it, then ``ray.remote``, to add
    methods). Holds an inference copy. ``sink="load_weights"`` loads through the model's
    ``load_weights`` method; ``expect_buffer_bytes``/``expect_num_buffers`` pin the buffer
    settings this worker accepts.

    ``stage`` ("auto", "device" or "host"; default None, off): receive each sync into a
    stage and swap it into the model at the commit with one copy (``weightsync.core.stage``),
    so :meth:`call` keeps reading the last version while the next one arrives and waits
    only for the swap. Give the actor a second thread for that
    (``WorkerActor.options(max_concurrency=2)``): its calls then run while a sync's
    ``ws_receive`` runs. ``keep_stage`` keeps the stage allocated between syncs."""

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        device: str = "cpu",
        sink: str = "module",
        expect_buffer_bytes: int | None = None,
        expect_num_buffers: int | None = None,
        expect_inplace_bytes: int | None = None,
        stage: str | None = None,
        keep_stage: bool = False,
    ) -> None:
        super().__init__(model_factory, device)
        self.expect_buffer_bytes = expect_buffer_bytes
        self.expect_num_buffers = expect_num_buffers
        self.expect_inplace_bytes = expect_inplace_bytes
        self.weightsync_sink: Sink | None = None
        if sink == "load_weights":
            load = getattr(self.model, "load_weights", None)
            if load is None:
                raise SettingsError("sink='load_weights' needs a model with a load_weights method")
            self.weightsync_sink = LoadWeightsSink(
                load, staged=stage is not None, stage=stage or "auto", keep_stage=keep_stage, device=self.device
            )
        elif sink == "module":
            if stage is not None:
                self.weightsync_sink = ModuleSink(self.model, stage=stage, keep_stage=keep_stage)
        else:
            raise SettingsError(f"sink must be 'module' or 'load_weights', got {sink!r}")

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(model, *args, **kwargs)`` here, never while a pushed sync writes the weights."""
        with self.weightsync_reading():
            return fn(self.model, *args, **kwargs)

    def version(self) -> tuple[int | None, str]:
        return self.ws_status()


# Typed as Any: Ray's stubs do not follow ``.options(...).remote(...)`` to actor handles.
TrainerActor: Any = ray.remote(TrainerHost)
WorkerActor: Any = ray.remote(WorkerHost)


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
