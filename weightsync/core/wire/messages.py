"""Every message that crosses a process boundary besides the Manifest and the outcomes.

Setup messages (where an endpoint lives, which group to join, what was exported) and the
per-sync messages (what a party is asked to do, what it did). Each validates itself on
construction, so a malformed message is refused where it arrives, by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.outcome import Outcome
from weightsync.core.wire.report import StageReport
from weightsync.core.wire.shm_names import confined_path


def _require(condition: bool, message: str | Callable[[], str]) -> None:
    """Refuse a message whose ``condition`` fails; a callable ``message`` (for messages built
    on every sync) is formatted only then."""
    if not condition:
        raise WeightSyncError(message if isinstance(message, str) else message())


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class EndpointInfo:
    """Where an endpoint lives; the coordinator picks transports from this."""

    node_id: str
    node_ip: str
    hostname: str
    pid: int
    device: str
    gpu_uuid: str | None
    sink_allows_direct: bool
    #: Memory this party could give to buffers (weightsync.core.wire.sizing.free_memory_bytes),
    #: for ``buffer_bytes="auto"``; None when it could not tell.
    free_bytes: int | None = None
    #: A trainer party's layout, for transports that send from shards: "none" (not a rank of
    #: a sharded trainer), "owned" (every tensor Shard(0) over a 1-D mesh, Replicate or plain:
    #: each rank can send what it holds), "other" (another layout: only gathering serves it).
    shards: str = "none"
    #: A worker that receives in several processes (an inference engine's tensor-parallel
    #: ranks, each loading every tensor and keeping its shard): where each part lives, in
    #: part order; empty for a worker of one process. Transports that feed each part from
    #: the trainer rank beside it read it (``rank-ipc``); the others serve part 0, this
    #: endpoint, which hands the bytes on to its other parts itself.
    parts: tuple[EndpointInfo, ...] = ()
    #: A worker whose sink keeps a sync's tensors until its commit (``LoadWeightsSink(staged=True)``,
    #: an engine's ``stage_updates``): fed part by part, its parts then commit together, in a
    #: call chained on the whole worker's receive, so a failing part leaves no part loaded.
    stages: bool = False
    #: The inode of the endpoint's pid namespace (``/proc/self/ns/pid``; 0 where unknown).
    #: Colocated transports watch their peer by pid, which means nothing across namespaces.
    pidns: int = 0

    def __post_init__(self) -> None:
        _require(self.device in ("cpu", "cuda"), f"endpoint device must be 'cpu' or 'cuda', got {self.device!r}")
        _require(isinstance(self.stages, bool), f"endpoint stages must be True or False, got {self.stages!r}")
        object.__setattr__(self, "parts", tuple(self.parts))
        _require(
            all(isinstance(p, EndpointInfo) and not p.parts for p in self.parts),
            "an endpoint's parts must be EndpointInfo of single processes (a part has no parts of its own)",
        )
        _require(len(self.parts) != 1, "an endpoint of one process lists no parts (parts is empty or two or more)")
        _require(
            self.shards in ("none", "owned", "other"), f"endpoint shards must be none/owned/other, got {self.shards!r}"
        )
        _require(
            self.free_bytes is None or (_is_int(self.free_bytes) and self.free_bytes >= 0),
            f"endpoint free_bytes must be None or a non-negative int, got {self.free_bytes!r}",
        )
        _require(_is_int(self.pid) and self.pid > 0, f"endpoint pid must be a positive int, got {self.pid!r}")
        _require(
            _is_int(self.pidns) and self.pidns >= 0, f"endpoint pidns must be a non-negative int, got {self.pidns!r}"
        )
        _require(self.device != "cuda" or bool(self.gpu_uuid), "a CUDA endpoint must report its GPU's UUID")


@dataclass(frozen=True, kw_only=True)
class SourceLayout:
    """How one trainer rank holds its model: ``sharded`` (DTensors, over a mesh of
    ``mesh_size`` ranks, this one at ``mesh_rank``) or plain (every tensor whole: 0, 0).
    The ranks of one trainer must all be sharded the same way, or all plain."""

    sharded: bool
    mesh_size: int = 0
    mesh_rank: int = 0

    def __post_init__(self) -> None:
        _require(isinstance(self.sharded, bool), f"sharded must be a bool, got {self.sharded!r}")
        _require(_is_int(self.mesh_size) and _is_int(self.mesh_rank), "mesh size and rank must be ints")
        if self.sharded:
            _require(
                0 <= self.mesh_rank < self.mesh_size, f"mesh rank {self.mesh_rank} out of range for {self.mesh_size}"
            )
        else:
            _require(self.mesh_size == 0 and self.mesh_rank == 0, "a plain (unsharded) source has no mesh")


@dataclass(frozen=True, kw_only=True)
class ShmHandle:
    """A shared-memory region as it crosses a process boundary; ``path`` may only name one
    of weightsync's regions in ``/dev/shm`` (checked here and again where it is mapped)."""

    path: str
    nbytes: int
    hostname: str
    session: str

    def __post_init__(self) -> None:
        confined_path(self.path, f"shared-memory handle (session {self.session!r})")
        _require(_is_int(self.nbytes) and self.nbytes >= 0, f"shared-memory handle size {self.nbytes!r} is not a size")


@dataclass(frozen=True, kw_only=True)
class CudaIpcHandle:
    """A CUDA region as it crosses a process boundary: the GPU's UUID and torch's rebuild args."""

    gpu_uuid: str
    rebuild_args: tuple[Any, ...]
    nbytes: int
    session: str

    def __post_init__(self) -> None:
        _require(bool(self.gpu_uuid), "a CUDA IPC handle must name its GPU's UUID")
        _require(_is_int(self.nbytes) and self.nbytes >= 0, f"CUDA IPC handle size {self.nbytes!r} is not a size")


RegionHandle = ShmHandle | CudaIpcHandle


@dataclass(frozen=True, kw_only=True)
class BoardOffer:
    """A coordinator's reply board (:mod:`weightsync.mechanisms.board`), offered at setup to
    ``party``, one of its parties on its host: where to leave its answers to sync calls."""

    board: ShmHandle
    slots: int
    slot_bytes: int
    #: The coordinator's label (``WeightSync.label``); its board replaces an earlier one.
    owner: str
    party: str
    #: Where to ring once an answer is posted (the coordinator's doorbell, its key), so a
    #: coordinator on a busy CPU sleeps instead of polling; "": it polls, ring nothing.
    doorbell: str
    doorbell_key: bytes

    def __post_init__(self) -> None:
        _require(
            _is_int(self.slots) and self.slots >= 1 and _is_int(self.slot_bytes) and self.slot_bytes >= 8,
            f"a reply board needs slots >= 1 and slot_bytes >= 8, got {self.slots!r} and {self.slot_bytes!r}",
        )
        _require(bool(self.party) and isinstance(self.owner, str), "a reply board is offered to a named party")
        _require(
            isinstance(self.doorbell, str) and isinstance(self.doorbell_key, bytes),
            f"a reply board's doorbell is an address and a key, got {self.doorbell!r}",
        )


@dataclass(frozen=True, kw_only=True)
class SyncCall:
    """What every party of one sync is told: the same numbers on every side.

    ``seq`` counts the syncs completed in this transport session (colocated parties derive
    their control-block counters from it); ``version`` is what workers commit.
    """

    seq: int
    version: int
    verify: bool = False
    force: bool = False
    #: Per transport the trainer party drives this time, in the order it drives them, the
    #: workers it writes (all of its workers on it, or only those re-exported). None: every
    #: open half with all its peers (a single-process caller that opened them itself).
    targets: dict[str, tuple[str, ...]] | None = None
    #: The workers the coordinator sends a commit after their receive, beyond those whose
    #: transport cannot tell that the sender finished and every worker with ``verify``: a
    #: worker named here never commits in its receive.
    chained: tuple[str, ...] = ()
    #: The label of the coordinator whose session this sync runs in (``WeightSync.label``):
    #: a trainer party keeps one session per coordinator and picks it by this; a worker set
    #: up by another coordinator since refuses it by name. "": the party's only session.
    owner: str = ""
    #: Delta sessions: per worker, the token of the bytes the coordinator last heard it
    #: commit (workers holding none are left out). A trainer party sends a delta only to
    #: workers holding its base's token (a transport only when every peer it serves does).
    delta_holds: tuple[tuple[str, int], ...] = ()
    #: Delta sessions: the name of this sync's bytes, which every trainer rank gives its
    #: base and every worker holds once it commits (0: each trainer party picks its own).
    #: One name for every rank, so a worker fed by several ranks (owner sends) holds one.
    delta_token: int = 0
    #: Where this party also leaves its answer to the call: (slot, round tag) of the reply
    #: board of coordinator ``owner`` (:mod:`weightsync.glue.replies`); None: through Ray only.
    reply: tuple[int, int] | None = None
    #: A push through ``WeightSync.sync``: per party, the slot of ``reply``'s board round where
    #: it also leaves its part of the push's answer as soon as it has it (the trainer party its
    #: send's outcome, each listening worker its PushAnswer), so the coordinator reads the
    #: answer without the trainer relaying the workers' (:meth:`part`).
    parts: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        _require(
            _is_int(self.seq) and self.seq >= 0, lambda: f"sync sequence must be a non-negative int, got {self.seq!r}"
        )
        _require(
            isinstance(self.parts, tuple)
            and all(
                isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and _is_int(p[1]) and p[1] >= 0
                for p in self.parts
            ),
            lambda: f"parts must be a tuple of (party name, slot >= 0) pairs, got {self.parts!r}",
        )
        _require(
            not self.parts or self.reply is not None, lambda: f"parts {self.parts!r} need a reply slot's round tag"
        )
        _require(
            self.reply is None
            or (
                isinstance(self.reply, tuple)
                and len(self.reply) == 2
                and all(_is_int(n) for n in self.reply)
                and self.reply[0] >= 0
                and self.reply[1] >= 1
            ),
            lambda: f"a reply slot is None or (slot >= 0, round tag >= 1), got {self.reply!r}",
        )
        _require(
            isinstance(self.owner, str), lambda: f"a sync's owner must be a coordinator's label, got {self.owner!r}"
        )
        _require(
            isinstance(self.delta_holds, tuple) and all(isinstance(w, str) and _is_int(t) for w, t in self.delta_holds),
            lambda: f"delta_holds must be a tuple of (worker name, token) pairs, got {self.delta_holds!r}",
        )
        _require(
            _is_int(self.delta_token) and self.delta_token >= 0,
            lambda: f"delta_token must be a non-negative int, got {self.delta_token!r}",
        )
        _require(
            isinstance(self.chained, tuple) and all(isinstance(w, str) for w in self.chained),
            lambda: f"chained must be a tuple of worker names, got {self.chained!r}",
        )
        _require(_is_int(self.version), lambda: f"version must be an int, got {self.version!r}")
        _require(
            isinstance(self.verify, bool) and isinstance(self.force, bool), "verify and force must be True or False"
        )
        _require(
            self.targets is None or isinstance(self.targets, dict),
            lambda: f"targets must map transports to workers, got {self.targets!r}",
        )
        for kind, workers in (self.targets or {}).items():
            if not (isinstance(kind, str) and isinstance(workers, tuple) and all(isinstance(w, str) for w in workers)):
                raise WeightSyncError(f"targets[{kind!r}] must be a tuple of worker names, got {workers!r}")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The transports the trainer party drives this time, in order (once resolved)."""
        return tuple(self.targets or ())

    def to(self, kind: str) -> tuple[str, ...]:
        """The workers of transport ``kind`` written this time (once resolved)."""
        return (self.targets or {}).get(kind, ())

    def part(self, party: str) -> tuple[int, int] | None:
        """The (slot, round tag) where ``party`` leaves its part of this push's answer, or
        None when it leaves none."""
        slot = dict(self.parts).get(party)
        return None if slot is None or self.reply is None else (slot, self.reply[1])


@dataclass(frozen=True, kw_only=True)
class SendResult:
    """The trainer's answer to one sync: checksums per transport and the stale direct workers.

    ``tensor_checksums`` (with ``verify``): per tensor, the checksum of the bytes this trainer
    party sent (after the wire cast), what each worker's destination is compared with.
    """

    checksums: dict[str, list[int]] = field(default_factory=dict)
    stale: tuple[str, ...] = ()
    seconds: float = 0.0
    tensor_checksums: list[int] = field(default_factory=list)
    #: Per transport, the bytes it moved (a broadcast's once, whatever its receivers).
    sent_bytes: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ReceiveResult:
    """A worker's answer to one sync call."""

    worker: str
    version: int | None
    state: str
    checksums: list[int] = field(default_factory=list)
    seconds: float = 0.0
    #: Direct transport: tensors whose storage moved since the export (nothing written).
    stale: tuple[str, ...] = ()
    #: The transport the bytes came over (what a later commit checks them against).
    transport: str = ""
    #: With ``verify``: per tensor, the checksum of what the worker's sink holds after
    #: loading (see ``Sink.checksums``); its commit compares them with the reference trainer's.
    held: list[int] | None = None
    #: Seconds this worker held generation off for this sync (an inference engine that
    #: pauses or blocks generation around its loads); None when it does not say.
    held_off_s: float | None = None
    #: A worker fed part by part (``EndpointInfo.parts``): each part's own result, in part
    #: order, which that part's commit checks (its chunks against its own rank's); the
    #: fields above then describe the worker as a whole.
    parts: tuple[ReceiveResult, ...] = ()
    #: Per tensor its sink cast to a narrower range on load (fp16 from fp32 or bf16), how
    #: many values became ``inf`` in this sync; tensors without any are left out.
    overflows: dict[str, int] = field(default_factory=dict)
    #: Delta sessions: True when this sync's bytes came as a delta, False when dense; None
    #: for a transport without delta headers (or a session without deltas).
    delta: bool | None = None
    #: The token of the bytes this worker holds after this call, committed (0: none a
    #: delta may be applied to).
    token: int = 0
    #: A staged worker: where its stage lived, and the swap once it ran (None otherwise).
    stage: StageReport | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", tuple(self.parts))
        _require(
            self.stage is None or isinstance(self.stage, StageReport),
            lambda: f"{self.worker}: a receive result's stage must be a StageReport, got {type(self.stage).__name__}",
        )
        _require(
            all(isinstance(p, ReceiveResult) and not p.parts for p in self.parts),
            lambda: f"{self.worker}: a receive result's parts must be ReceiveResults of single parts",
        )


@dataclass(frozen=True, kw_only=True)
class PushAnswer:
    """A listening worker's answer to one pushed sync: its outcome and what it holds after."""

    outcome: Outcome
    version: int | None
    state: str

    def __post_init__(self) -> None:
        _require(isinstance(self.outcome, Outcome), lambda: f"a push answer carries an Outcome, got {self.outcome!r}")


@dataclass(frozen=True, kw_only=True)
class PushResult:
    """The trainer's answer to a pushed sync: its own send and each listening worker's answer."""

    version: int
    sent: Outcome
    workers: dict[str, PushAnswer]
    seconds: float = 0.0
    #: Nothing ran: an earlier push failed, so the transports must be set up again first.
    setup_needed: bool = False

    @property
    def ok(self) -> bool:
        return self.sent.ok and all(a.outcome.ok for a in self.workers.values())

    def summary(self) -> str:
        """One line: the version, the time, what each worker holds, and every failure."""
        if self.setup_needed:
            return f"push of version {self.version}: not run (an earlier push failed; run WeightSync.setup())"
        held = ", ".join(f"{name} {a.state}@{a.version}" for name, a in sorted(self.workers.items()))
        failed = [o.line() for o in (self.sent, *(a.outcome for a in self.workers.values())) if not o.ok]
        return (
            f"push of version {self.version} {'ok' if self.ok else 'FAILED'} in {self.seconds * 1e3:.1f} ms to "
            f"{len(self.workers)} worker(s) ({held})" + "".join(f"; {line}" for line in failed)
        )

    def __repr__(self) -> str:
        return f"PushResult({self.summary()})"
