"""The trainer party's delta session: its encoder, and what each sync asks of it.

Held by the sender (:class:`weightsync.core.sender.WeightSender`) for as long as it lives,
so a new setup of the same tensors keeps the base; set up without deltas, it is dropped
with its base's memory. Per sync, before the transports run::

    prepared = sending.prepare(manifest, halves, sources, call, device)   # None: no half
                                                                         # carries deltas
    ... the halves send; then prepared.complete()
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from weightsync.core.delta.encoder import DeltaEncoder, PreparedSync, half_plan
from weightsync.core.delta.header import header_manifest
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import SyncCall


class DeltaSending:
    """One trainer party's base, where it lives ("device" or "host"), and its encoder."""

    def __init__(self, where: str = "device") -> None:
        self.where = where
        self.encoder = DeltaEncoder()
        #: The encoders of halves that encode this party's own tensors (owner sends), by kind.
        self._own: dict[str, DeltaEncoder] = {}

    def encoder_for(self, kind: str) -> DeltaEncoder:
        """The encoder (and base) of a half that encodes its own tensors (``own_deltas``),
        kept as long as this party's delta session, like the common one."""
        return self._own.setdefault(kind, DeltaEncoder())

    def place(self, device: torch.device) -> torch.device:
        """Where a base is kept for tensors on ``device`` (``where``: "device" or "host")."""
        return device if self.where == "device" else torch.device("cpu")

    @staticmethod
    def carried(manifest: Manifest, halves: Mapping[str, Any], call: SyncCall) -> bool:
        """Whether ``call`` drives a half that carries deltas, in a delta session."""
        return manifest.agreed.delta and any(
            halves[kind].carries_deltas and not halves[kind].own_deltas for kind in call.kinds
        )

    def prepare(
        self, manifest: Manifest, halves: Mapping[str, Any], sources: Any, call: SyncCall, device: torch.device
    ) -> PreparedSync | None:
        """This sync encoded against the base for the workers the coordinator says hold it,
        or dense with the base brought up to date; None when no half carries deltas."""
        if not self.carried(manifest, halves, call):
            return None
        place = self.place(device)
        with torch.no_grad():
            return self.encoder.prepare(
                manifest, sources.tensors, sources.streamed, place, call.delta_holds, call.delta_token
            )


def delta_steps(
    sources: Any, manifest: Manifest, peers: Collection[str], device: torch.device
) -> list[tuple[Manifest, Sequence[torch.Tensor]]]:
    """A delta session's sync as a transport that moves chunks sends it to ``peers``: the
    header as a Manifest of its own, then the plan it announces (the session's, or the
    payloads'; left out when nothing changed), each with the tensors to read."""
    header, follows, tensors = half_plan(sources, manifest, peers)
    steps: list[tuple[Manifest, Sequence[torch.Tensor]]] = [
        (header_manifest(manifest), [header.to_tensor(manifest, device)])
    ]
    if follows is not None:
        steps.append((follows, tensors))
    return steps
