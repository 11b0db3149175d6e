"""What one sync did, as the coordinator reports it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from weightsync.core.wire.casts import CastCount

#: Where a stage may live: the worker's device, or host memory (pinned on a GPU).
STAGE_PLACES = ("device", "host")


@dataclass(frozen=True, kw_only=True)
class StageReport:
    """Where a staged worker kept one sync's bytes until its swap, and what the swap took.

    A staged worker receives into a stage while it keeps serving (or reading) its version;
    only the swap, one load of the staged tensors into the model, holds generation off
    (``weightsync.core.stage``, docs/vllm.md). Per part (an engine's TP ranks, in rank order;
    one for any other worker): where its stage lived and how many bytes it held."""

    #: "device" or "host", per part.
    where: tuple[str, ...]
    #: Bytes staged, per part.
    part_bytes: tuple[int, ...]
    #: True when the stage stays allocated for the next sync (``keep_stage``).
    kept: bool = False
    #: Seconds the swap took: the load of the staged tensors into the model (for a vLLM
    #: engine, through ``load_weights`` inside vLLM's reload, with the end of the reload),
    #: the slowest part's; 0 when the sync did not reach its swap.
    swap_s: float = 0.0
    #: Seconds the transfer ran while generation went on (engines; None elsewhere).
    transfer_s: float | None = None
    #: Tokens the engine generated while the transfer ran (None where nobody counts them).
    generated_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "where", tuple(self.where))
        object.__setattr__(self, "part_bytes", tuple(self.part_bytes))
        if not self.where or len(self.where) != len(self.part_bytes):
            raise ValueError(
                f"StageReport needs one place and one byte count per part, got {self.where!r} and {self.part_bytes!r}"
            )
        if any(w not in STAGE_PLACES for w in self.where):
            raise ValueError(f"StageReport.where must name {' or '.join(STAGE_PLACES)} per part, got {self.where!r}")
        if any(not isinstance(b, int) or b < 0 for b in self.part_bytes):
            raise ValueError(f"StageReport.part_bytes must be non-negative integers, got {self.part_bytes!r}")
        if not self.swap_s >= 0:
            raise ValueError(f"StageReport.swap_s must be >= 0, got {self.swap_s!r}")

    def line(self) -> str:
        places = sorted(set(self.where))
        per_part = max(self.part_bytes) / 1e6
        parts = f" on each of {len(self.part_bytes)} parts" if len(self.part_bytes) > 1 else ""
        return f"staged {per_part:.1f} MB{parts} on {'/'.join(places)}, swap {self.swap_s * 1e3:.1f} ms"


@dataclass(frozen=True, kw_only=True)
class WorkerReport:
    name: str
    transport: str
    version: int | None
    state: str
    seconds: float
    #: Seconds this worker held generation off for the sync, from pausing (or blocking)
    #: generation to resuming it, as the worker measured it; None for a worker that does
    #: not serve generation or does not say (see ``weightsync.vllm``).
    held_off_s: float | None = None
    #: The casts its sink makes on load, counted by (wire dtype, held dtype), each with what
    #: it loses ("range", "precision" or None); empty when it holds the wire's dtypes.
    casts: tuple[CastCount, ...] = ()
    #: Per tensor cast to a narrower range on load, how many of its values became ``inf`` in
    #: this sync (fp16 cannot hold the wire's value); tensors without any are left out.
    overflows: dict[str, int] = field(default_factory=dict)

    def overflow_line(self) -> str:
        """``"<worker>: N value(s) in K tensor(s) (first <tensor>: n)"``, or "" without any."""
        if not self.overflows:
            return ""
        first, count = next(iter(self.overflows.items()))
        total = sum(self.overflows.values())
        return f"{self.name}: {total} value(s) in {len(self.overflows)} tensor(s) (first {first}: {count})"

    #: How this worker's bytes came: "delta", "dense", or "" (a session without deltas,
    #: or a transport that carries none).
    encoding: str = ""
    #: Bytes that crossed to this worker: what its transport moved (every trainer rank's
    #: part with owner sends; a delta's header and payloads in a delta session).
    sent_bytes: int = 0
    #: A staged worker's stage and swap (None for a worker that loads as bytes arrive).
    stage: StageReport | None = None


@dataclass(frozen=True, kw_only=True)
class SyncReport:
    """What one sync did: bytes, chunks, wall time, and each worker's resulting version.

    ``chunks`` counts the manifest's chunk plan: the broadcast plan when a broadcast worker
    took part (``inplace`` of its chunks are single tensors sent in place), else the packed
    plan ipc uses (direct writes the same bytes without packing them). ``verified`` is True
    only when a check of the bytes ran on every worker before it committed. Each
    worker's ``casts`` counts the tensors it holds in another dtype than the wire's, and its
    ``overflows`` the values such a cast turned into ``inf`` in this sync.
    """

    version: int
    bytes: int
    chunks: int
    seconds: float
    gbps: float
    transports: dict[str, int]
    workers: list[WorkerReport] = field(default_factory=list)
    verified: bool = False
    #: Seconds the trainer spent inside its send call: the transfer itself. The rest of
    #: ``seconds`` is Ray hand-offs and bookkeeping.
    send_seconds: float = 0.0
    inplace: int = 0
    #: Bytes of tensor data that crossed to each worker in this sync: ``bytes`` for a dense
    #: sync; with ``lora=True`` only the adapter's, the base model's never; in a delta
    #: session the header and what each transport moved, the most any worker got (each
    #: worker's own: ``workers[i].sent_bytes``).
    sent_bytes: int = 0
    #: The adapter this sync sent, as ``AdapterConfig.summary()`` says it ("LoRA r=8 ..."),
    #: or "" for a sync of the whole model.
    adapter: str = ""

    @property
    def held_off_s(self) -> float | None:
        """The longest time any worker held generation off for this sync (None: none said)."""
        held = [w.held_off_s for w in self.workers if w.held_off_s is not None]
        return max(held) if held else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def summary(self) -> str:
        kinds = ", ".join(f"{k}={v}" for k, v in sorted(self.transports.items()))
        lossy = [f"{w.name} {c.line()}" for w in self.workers for c in w.casts if c.loses]
        overflowed = [line for w in self.workers if (line := w.overflow_line())]
        return (
            f"weightsync: version {self.version} -> {len(self.workers)} worker(s) [{kinds}]: "
            f"{f'{self.adapter} adapter, ' if self.adapter else ''}{self.bytes / 1e6:.1f} MB in {self.seconds * 1e3:.1f} ms ({self.gbps:.2f} GB/s), "
            f"{self._sent_text()}"
            f"{self.chunks} chunk(s){f' ({self.inplace} in place)' if self.inplace else ''}"
            f"{', verified' if self.verified else ''}"
            f"{'; lossy casts on load: ' + '; '.join(lossy) if lossy else ''}"
            f"{'; values that became inf on load: ' + '; '.join(overflowed) if overflowed else ''}"
            f"{self._held_off_text()}"
        )

    def _sent_text(self) -> str:
        """What crossed the transports, and per worker dense or delta (delta sessions)."""
        coded = [w for w in self.workers if w.encoding]
        if not coded and self.sent_bytes in (0, self.bytes):
            return ""
        ways = ", ".join(f"{w.name} {w.encoding}" for w in coded)
        share = f" ({100 * self.sent_bytes / self.bytes:.1f}%)" if self.bytes else ""
        return f"sent {self.sent_bytes / 1e6:.1f} MB{share}{f' [{ways}]' if ways else ''}, "

    def _held_off_text(self) -> str:
        held = self.held_off_s
        staged = [w.stage for w in self.workers if w.stage is not None]
        stage = f" ({staged[0].line()})" if len(staged) == 1 else f" ({len(staged)} staged)" if staged else ""
        if held is None:
            return f"; {staged[0].line()}" if len(staged) == 1 else ""
        return f"; generation held off {held * 1e3:.1f} ms of {self.seconds * 1e3:.1f} ms sync{stage}"
