"""weightsync: move model weights from an RL trainer to its inference workers, exactly.

The Python API in one place::

    import weightsync
    trainer = weightsync.TrainerActor.remote(make_model)
    workers = [weightsync.WorkerActor.remote(make_model) for _ in range(2)]
    with weightsync.WeightSync(trainer, workers) as ws:
        report = ws.sync(version=1)

Everything below the actors (the wire contract, packing, transports, endpoints, sinks)
imports no Ray and runs in one process; ``weightsync.glue.actors`` and ``weightsync.glue.coordinator``
load Ray on first use of the names that need it. ``pack_tensors``, ``unpack_tensor`` and
``PackedChunk`` are those of :mod:`weightsync.packed_tensor`, the drop-in for vLLM's
packed-tensor helpers.
"""

from __future__ import annotations

from typing import Any

from weightsync.compat.packed_tensor import PackedChunk, pack_tensors, unpack_tensor
from weightsync.core.plugin import Mode, Transport
from weightsync.core.receiver import WeightReceiver, WorkerState
from weightsync.core.registry import register as register_transport
from weightsync.core.sender import WeightSender
from weightsync.core.sinks import LoadWeightsSink, ModuleSink
from weightsync.core.wire import (
    ALLOWED_DTYPES,
    CastCount,
    ClosedError,
    ConcurrentSyncError,
    Manifest,
    ModelChangedError,
    Outcome,
    SettingsError,
    SetupError,
    StageReport,
    Status,
    SyncError,
    SyncInFlight,
    SyncReport,
    SyncSettings,
    TensorCast,
    TensorSpec,
    VerificationError,
    VersionError,
    WeightSyncError,
)

__version__ = "0.1.0"

_RAY_NAMES = {
    "TrainerActor": "weightsync.glue.actors",
    "WorkerActor": "weightsync.glue.actors",
    "TrainerMixin": "weightsync.glue.actors",
    "TrainerHost": "weightsync.glue.actors",
    "WorkerHost": "weightsync.glue.actors",
    "WorkerMixin": "weightsync.glue.actors",
    "trainer_ranks": "weightsync.glue.actors",
    "WeightSync": "weightsync.glue.coordinator",
}


def __getattr__(name: str) -> Any:
    module = _RAY_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "ALLOWED_DTYPES",
    "CastCount",
    "ClosedError",
    "ConcurrentSyncError",
    "LoadWeightsSink",
    "Manifest",
    "ModelChangedError",
    "Mode",
    "ModuleSink",
    "Outcome",
    "PackedChunk",
    "SettingsError",
    "SetupError",
    "StageReport",
    "Status",
    "SyncError",
    "SyncInFlight",
    "SyncReport",
    "SyncSettings",
    "TensorCast",
    "TensorSpec",
    "TrainerActor",
    "TrainerHost",
    "TrainerMixin",
    "Transport",
    "VerificationError",
    "VersionError",
    "WeightReceiver",
    "WeightSender",
    "WeightSync",
    "WeightSyncError",
    "WorkerActor",
    "WorkerHost",
    "WorkerMixin",
    "WorkerState",
    "__version__",
    "trainer_ranks",
    "pack_tensors",
    "register_transport",
    "unpack_tensor",
]
