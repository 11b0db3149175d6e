"""The wire contract: every object that crosses a process boundary, and every error.

Ray-free and transport-free; everything else in weightsync builds on it.

* :mod:`~weightsync.core.wire.errors`: every error class, with ``consequence``/``blames`` as data.
* :mod:`~weightsync.core.wire.dtypes`: the dtype allow-list.
* :mod:`~weightsync.core.wire.settings`: :class:`SyncSettings`, validated.
* :mod:`~weightsync.core.wire.manifest`: TensorSpec, the Manifest.
* :mod:`~weightsync.core.wire.casts`: the casts a worker's sink makes on load, and what each loses.
* :mod:`~weightsync.core.wire.plan`: the chunk plans (packed, broadcast) both sides derive.
* :mod:`~weightsync.core.wire.messages`: endpoint info, region handles, per-sync calls and results (each transport keeps its own setup messages).
* :mod:`~weightsync.core.wire.outcome`: :class:`Outcome` per party and call, and blame.
* :mod:`~weightsync.core.wire.session`: :class:`Session` per party and set-up, and the deadline policy.
* :mod:`~weightsync.core.wire.report`: :class:`SyncReport`.
"""

from weightsync.core.wire.casts import CastCount, TensorCast
from weightsync.core.wire.dtypes import ALLOWED_DTYPES, dtype_from_name, dtype_name
from weightsync.core.wire.errors import (
    ChecksumMismatch,
    ClosedError,
    ConcurrentSyncError,
    DeviceMismatch,
    ExportNotFound,
    ManifestError,
    ModelChangedError,
    PeerAborted,
    SessionTornDown,
    SettingsError,
    SetupError,
    StreamTimeout,
    SyncError,
    SyncInFlight,
    TransferError,
    TransferTimeout,
    UnsupportedDtypeError,
    VerificationError,
    VersionError,
    WeightSyncError,
)
from weightsync.core.wire.manifest import (
    PROTOCOL_VERSION,
    AgreedSettings,
    Manifest,
    TensorSpec,
)
from weightsync.core.wire.messages import (
    CudaIpcHandle,
    EndpointInfo,
    ReceiveResult,
    RegionHandle,
    SendResult,
    ShmHandle,
    SyncCall,
)
from weightsync.core.wire.outcome import Outcome, Status, assign_blame
from weightsync.core.wire.plan import Chunk, ChunkPiece, align_up, plan_broadcast, plan_chunks
from weightsync.core.wire.report import StageReport, SyncReport, WorkerReport
from weightsync.core.wire.session import TRAINER_PARTY, Deadlines, Session
from weightsync.core.wire.settings import (
    DEFAULT_ALIGNMENT,
    DEFAULT_BUFFER_BYTES,
    DEFAULT_NUM_BUFFERS,
    DEFAULT_TIMEOUT_S,
    SyncSettings,
)

__all__ = [
    "ALLOWED_DTYPES",
    "DEFAULT_ALIGNMENT",
    "DEFAULT_BUFFER_BYTES",
    "DEFAULT_NUM_BUFFERS",
    "DEFAULT_TIMEOUT_S",
    "PROTOCOL_VERSION",
    "TRAINER_PARTY",
    "AgreedSettings",
    "CastCount",
    "ChecksumMismatch",
    "ClosedError",
    "ConcurrentSyncError",
    "Chunk",
    "ChunkPiece",
    "CudaIpcHandle",
    "Deadlines",
    "DeviceMismatch",
    "EndpointInfo",
    "ExportNotFound",
    "Manifest",
    "ManifestError",
    "ModelChangedError",
    "Outcome",
    "PeerAborted",
    "SessionTornDown",
    "ReceiveResult",
    "RegionHandle",
    "SendResult",
    "Session",
    "SettingsError",
    "SetupError",
    "ShmHandle",
    "StreamTimeout",
    "Status",
    "SyncCall",
    "StageReport",
    "SyncError",
    "SyncInFlight",
    "SyncReport",
    "SyncSettings",
    "TensorCast",
    "TensorSpec",
    "TransferError",
    "TransferTimeout",
    "UnsupportedDtypeError",
    "VerificationError",
    "VersionError",
    "WeightSyncError",
    "WorkerReport",
    "align_up",
    "assign_blame",
    "dtype_from_name",
    "dtype_name",
    "plan_broadcast",
    "plan_chunks",
]
