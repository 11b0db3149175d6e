"""The worker's side of a delta session: read the header, then land the payloads.

A receive half of a transport that carries deltas gets the worker's sink wrapped in a
:class:`DeltaReceiving` (when the session has deltas on) and, per sync::

    raw = <receive landing.header_nbytes bytes>            # the header, before anything else
    manifest, target = landing.open(raw)                  # dense: the session's Manifest and
                                                          # the sink; delta: the payloads'
                                                          # Manifest (None: nothing changed)
                                                          # and a DeltaLanding
    <receive manifest's plan into target, as for any sync>
    landing.finish()

A delta is applied only onto the bytes it was made against: a worker whose held token
(what it committed last) is not the header's base token refuses it, naming itself, before
any byte lands. A :class:`DeltaLanding` forwards a tensor sent dense to the sink as it is
(straight into its destination where it has one) and hands each payload to the sink's
``patch``: a module sink writes the changed elements into its tensors in place; a
``load_weights`` sink applies them to its own copy of the wire bytes and loads the result
(see :class:`~weightsync.core.sinks.LoadWeightsSink`).
"""

from __future__ import annotations

from typing import Any

import torch

from weightsync.core.delta.encoding import Kind
from weightsync.core.delta.gpu_scatter import batched_scatters, check_scatters, forget_scatters
from weightsync.core.delta.header import Mode, PayloadPlan, SyncHeader, header_nbytes, plan_payload
from weightsync.core.wire.errors import WeightSyncError
from weightsync.core.wire.manifest import Manifest


class DeltaLanding:
    """Where one delta sync's payloads land: a Landing over the payload Manifest."""

    def __init__(self, sink: Any, manifest: Manifest, plan: PayloadPlan) -> None:
        self.sink = sink
        self.manifest = manifest
        self.plan = plan
        self.keeps_references = bool(sink.keeps_references)
        self._index = {manifest.specs[i].name: i for i in plan.origin}
        forget_scatters()

    def destinations(self, payloads: Manifest) -> list[torch.Tensor | None]:
        real = self.sink.destinations(self.manifest)
        return [real[i] if self.plan.kinds[i][0] is Kind.DENSE else None for i in self.plan.origin]

    def consume(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Dense tensors to the sink, payloads to its ``patch``; a sink that patches in place
        (``patches_in_place``) gets its GPU scatters of ``items`` launched together, before
        this returns (``items`` may be reused once it has: a slot's next chunk)."""
        if getattr(self.sink, "patches_in_place", False):
            with batched_scatters():
                self._consume(items)
        else:
            self._consume(items)

    def _consume(self, items: list[tuple[str, torch.Tensor]]) -> None:
        dense = []
        for name, tensor in items:
            index = self._index[name]
            kind, count = self.plan.kinds[index]
            if kind is Kind.DENSE:
                dense.append((name, tensor))
            else:
                if dense:
                    self.sink.consume(dense)
                    dense = []
                self.sink.patch(index, self.manifest.specs[index], kind, count, tensor)
        if dense:
            self.sink.consume(dense)

    def finish(self) -> None:
        check_scatters()
        done = getattr(self.sink, "delta_done", None)
        if callable(done):
            done(self.manifest, self.plan.kinds)

    def direct_tensors(self, manifest: Manifest) -> None:
        return None

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        raise TypeError("a delta sync's payloads take no direct writes")


class HeaderCatch:
    """A Landing for the one tensor of :func:`~weightsync.core.delta.header.header_manifest`:
    keeps a copy of the header's bytes (``raw``) for :meth:`DeltaReceiving.open`."""

    keeps_references = False

    def __init__(self) -> None:
        self.raw: torch.Tensor | None = None

    def destinations(self, manifest: Manifest) -> list[torch.Tensor | None]:
        return [None]

    def consume(self, items: list[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in items:
            self.raw = tensor.clone()

    def direct_tensors(self, manifest: Manifest) -> None:
        return None

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        raise TypeError("a delta header takes no direct writes")


class DeltaReceiving:
    """A worker's sink as a delta session's receive half sees it (see the module doc)."""

    def __init__(self, sink: Any, manifest: Manifest, held_token: int | None, who: str) -> None:
        self.sink = sink
        self.manifest = manifest
        self.held_token = held_token
        self.who = who
        self.header: SyncHeader | None = None
        self._landing: DeltaLanding | None = None
        self.keeps_references = bool(sink.keeps_references)

    @property
    def header_nbytes(self) -> int:
        return header_nbytes(self.manifest)

    @property
    def took_delta(self) -> bool:
        return self.header is not None and self.header.mode is Mode.DELTA

    def open(self, raw: torch.Tensor) -> tuple[Manifest | None, Any]:
        """Read this sync's header from ``raw``; what to receive next, and into what."""
        header = SyncHeader.from_tensor(raw, self.manifest, self.who)
        if header.mode is Mode.DENSE:
            self.header = header
            return self.manifest, self.sink
        if self.held_token is None or header.base_token != self.held_token:
            raise WeightSyncError(
                f"{self.who}: sent a delta against bytes it does not hold (it holds "
                f"{'nothing a delta applies to' if self.held_token is None else 'another version'}): nothing was "
                "written; the coordinator sends such a worker a dense sync (a weightsync bug if it did not)",
                blames=[self.who],
            )
        patch = getattr(self.sink, "patch", None)
        if not callable(patch):
            raise WeightSyncError(f"{self.who}: its sink ({type(self.sink).__name__}) cannot apply a delta (no patch)")
        plan = plan_payload(self.manifest, header.codes)
        self.header = header
        self._landing = DeltaLanding(self.sink, self.manifest, plan)
        return plan.manifest, self._landing

    def finish(self) -> None:
        if self._landing is not None:
            self._landing.finish()

    # a dense sync's Landing: the sink's own --------------------------------------------
    def destinations(self, manifest: Manifest) -> list[torch.Tensor | None]:
        return self.sink.destinations(manifest)  # type: ignore[no-any-return]

    def consume(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.sink.consume(items)

    def direct_tensors(self, manifest: Manifest) -> Any:
        return self.sink.direct_tensors(manifest)

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        self.sink.rebind(index, tensor)


def landing_for(sink: Any, manifest: Manifest, half: Any, held_token: int | None, who: str) -> Any:
    """The sink as a receive ``half`` gets it: wrapped in a :class:`DeltaReceiving` in a
    delta session on a transport that carries deltas (``held_token``: what the worker
    holds, committed; None when it is not), else the sink itself."""
    if not (manifest.agreed.delta and getattr(half, "carries_deltas", False)):
        return sink
    return DeltaReceiving(sink, manifest, held_token, who)
