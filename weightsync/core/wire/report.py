"""What one sync did, as the coordinator reports it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from weightsync.core.wire.casts import CastCount


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
        if held is None:
            return ""
        return f"; generation held off {held * 1e3:.1f} ms of {self.seconds * 1e3:.1f} ms sync"
