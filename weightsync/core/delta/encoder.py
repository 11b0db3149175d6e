"""The trainer's side of a delta sync: the base it keeps, and one sync's encoding.

:class:`DeltaEncoder` lives as long as the trainer party (its base survives a new setup
of the same tensors). Per sync of a delta session, before any transport runs::

    prepared = encoder.prepare(manifest, tensors, streamed, device, holds)
    per transport half that carries deltas, for the workers it serves this sync:
        header, manifest, tensors = prepared.for_peers(peers)   # a delta, or dense

A worker may get a delta only when the coordinator last heard it commit the bytes the
base holds (``holds``: each worker's token); everything else is dense, and the base is brought up to date either way
(dense: as the transport reads each tensor, so the cast into the base overlaps the
sends; streamed sources: in the one walk the encoder makes). Encoding gives up on the
whole sync, going dense for everyone, when its payloads pass :data:`GIVE_UP_SYNC` of the
dense bytes read so far (after at least a sixteenth of them): then a delta would save
little and cost an encoding and an apply on every worker.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightsync.core.delta.cpu_diff import Budget
from weightsync.core.delta.diff import Differ
from weightsync.core.delta.encoding import encode_code
from weightsync.core.delta.header import Mode, PayloadPlan, SyncHeader, new_token, plan_payload
from weightsync.core.wire.manifest import Manifest, TensorSpec

GIVE_UP_SYNC = 0.5


class BaseStore:
    """The wire bytes of the last sync, one contiguous tensor per spec, on the trainer's
    device (``where="device"``) or in host memory (``"host"``); ``token`` names them
    (None: they name nothing a worker holds)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.specs: tuple[TensorSpec, ...] = ()
        self.device = torch.device("cpu")
        self.token: int | None = None

    def fit(self, manifest: Manifest, device: torch.device) -> None:
        """Hold ``manifest``'s tensors on ``device``: kept (with their token) when the specs
        and the device are those held, else allocated anew, holding nothing yet."""
        if manifest.specs == self.specs and device == self.device and self.tensors:
            return
        self.tensors = []
        self.token = None
        self.tensors = [torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in manifest.specs]
        self.specs, self.device = manifest.specs, device

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs) if self.tensors else 0

    def release(self) -> None:
        self.tensors, self.specs, self.token = [], (), None


class BaseFill(Sequence[torch.Tensor]):
    """The base's tensors, each brought up to date from the trainer's on first read (a
    dense sync of a delta session: the cast into the base is the one a dense send makes)."""

    def __init__(self, base: BaseStore, sources: Sequence[torch.Tensor], filled: Collection[int] = ()) -> None:
        self._base, self._sources = base, sources
        self._filled = set(filled)

    def __len__(self) -> int:
        return len(self._base.tensors)

    def __getitem__(self, index: int) -> torch.Tensor:  # type: ignore[override]
        held = self._base.tensors[index]
        if index not in self._filled:
            with torch.no_grad():
                held.copy_(self._sources[index])
            self._filled.add(index)
        return held


@dataclass
class PreparedSync:
    """One sync of a delta session on the trainer: the header and tensors for each half."""

    dense_header: SyncHeader
    dense: Sequence[torch.Tensor]
    delta_header: SyncHeader | None = None
    plan: PayloadPlan | None = None
    payloads: Sequence[torch.Tensor] = ()
    delta_to: frozenset[str] = frozenset()

    def for_peers(self, peers: Collection[str]) -> tuple[SyncHeader, PayloadPlan | None, Sequence[torch.Tensor]]:
        """A delta when every one of ``peers`` holds the base, else dense (one broadcast
        group or one set of ipc slots carries one stream of bytes to all its peers)."""
        if self.delta_header is not None and peers and all(p in self.delta_to for p in peers):
            return self.delta_header, self.plan, self.payloads
        return self.dense_header, None, self.dense

    def complete(self) -> None:
        """Bring every tensor of the base up to date that no half read (a dense sync whose
        halves sent from the trainer's own tensors): the base then names this sync's bytes."""
        if isinstance(self.dense, BaseFill):
            for index in range(len(self.dense)):
                self.dense[index]

    def sent_nbytes(self, peers: Collection[str], manifest: Manifest) -> int:
        _, plan, _ = self.for_peers(peers)
        return plan.nbytes if plan is not None else manifest.total_bytes


class DeltaEncoder:
    """Keeps the base and encodes each sync against it (see the module doc)."""

    def __init__(self) -> None:
        self.base = BaseStore()
        self.differ = Differ()

    def prepare(
        self,
        manifest: Manifest,
        tensors: Sequence[torch.Tensor],
        streamed: bool,
        device: torch.device,
        holds: Collection[tuple[str, int]] = (),
        token: int = 0,
    ) -> PreparedSync:
        """Encode this sync for the workers that hold the base's bytes (``holds``: per
        worker, the token of what it holds), or prepare it dense; the base takes the new
        bytes either way, named ``token`` (0: a fresh name)."""
        base = self.base
        base.fit(manifest, device)
        old, new = base.token, token or new_token()
        base.token = None  # until every tensor of the base holds this sync's bytes
        dense_header = SyncHeader(Mode.DENSE, 0, new)
        delta_to = {worker for worker, token in holds if old is not None and token == old}
        wanted = bool(delta_to)
        if not wanted:
            if streamed:
                self._fill(manifest, tensors, 0)
                prepared = PreparedSync(dense_header, base.tensors)
            else:
                prepared = PreparedSync(dense_header, BaseFill(base, tensors))
            base.token = new
            return prepared
        assert old is not None
        prepared = self._encode(manifest, tensors, streamed, dense_header)
        if prepared.delta_header is not None:
            prepared.delta_header = SyncHeader(Mode.DELTA, old, new, prepared.delta_header.codes)
            prepared.delta_to = frozenset(delta_to)
        base.token = new
        return prepared

    def _encode(
        self, manifest: Manifest, tensors: Sequence[torch.Tensor], streamed: bool, dense_header: SyncHeader
    ) -> PreparedSync:
        base = self.base
        budget = Budget(manifest.total_bytes, GIVE_UP_SYNC)
        diffs = self.differ.diff_all(manifest.specs, tensors, base.tensors, budget, stop=not streamed)
        if budget.gave_up:  # dense for everyone; the rest of the base filled as it is read
            if streamed:
                return PreparedSync(dense_header, base.tensors)
            return PreparedSync(dense_header, BaseFill(base, tensors, range(len(diffs))))
        codes = tuple(encode_code(d.kind, d.count) for d in diffs)
        plan = plan_payload(manifest, codes)
        payloads = {i: d.payload for i, d in enumerate(diffs) if d.payload is not None}
        sources = [payloads[i] if i in payloads else base.tensors[i] for i in plan.origin]
        return PreparedSync(
            dense_header,
            base.tensors,
            delta_header=SyncHeader(Mode.DELTA, 0, 0, codes),
            plan=plan,
            payloads=sources,
        )

    def _fill(self, manifest: Manifest, tensors: Sequence[torch.Tensor], start: int) -> None:
        """Copy (casting) the trainer's tensors from ``start`` on into the base, in order."""
        with torch.no_grad():
            for index in range(start, len(manifest.specs)):
                self.base.tensors[index].copy_(tensors[index])


def half_plan(
    sources: Any, manifest: Manifest, peers: Collection[str]
) -> tuple[SyncHeader, Manifest | None, Sequence[torch.Tensor]]:
    """What a send half of a delta session sends its ``peers``: the header, the Manifest of
    what follows it (the session's, or the payloads'; None: nothing changed) and the tensors
    to read. ``sources.delta`` is the sync as the encoder prepared it (None: a dense header
    naming nothing, and the trainer's own tensors)."""
    prepared: PreparedSync | None = sources.delta
    if prepared is None:
        return SyncHeader(Mode.DENSE, 0, 0), manifest, sources.tensors
    header, plan, tensors = prepared.for_peers(peers)
    return header, (plan.manifest if plan is not None else manifest), tensors
