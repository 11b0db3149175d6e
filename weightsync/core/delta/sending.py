"""The trainer party's delta session: its encoder, and what each sync asks of it.

Held by the sender (:class:`weightsync.core.sender.WeightSender`) for as long as it lives,
so a new setup of the same tensors keeps the base; set up without deltas, it is dropped
with its base's memory. Per sync, before the transports run::

    prepared = sending.prepare(manifest, halves, sources, call, device)   # None: no half
                                                                         # carries deltas
    ... the halves send; then prepared.complete()
    sending.sent_bytes(manifest, halves, call, prepared)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from weightsync.core.delta.encoder import DeltaEncoder, PreparedSync
from weightsync.core.delta.header import header_nbytes
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import SyncCall


class DeltaSending:
    """One trainer party's base, where it lives ("device" or "host"), and its encoder."""

    def __init__(self, where: str = "device") -> None:
        self.where = where
        self.encoder = DeltaEncoder()

    @staticmethod
    def carried(manifest: Manifest, halves: Mapping[str, Any], call: SyncCall) -> bool:
        """Whether ``call`` drives a half that carries deltas, in a delta session."""
        return manifest.agreed.delta and any(halves[kind].carries_deltas for kind in call.kinds)

    def prepare(
        self, manifest: Manifest, halves: Mapping[str, Any], sources: Any, call: SyncCall, device: torch.device
    ) -> PreparedSync | None:
        """This sync encoded against the base for the workers the coordinator says hold it,
        or dense with the base brought up to date; None when no half carries deltas."""
        if not self.carried(manifest, halves, call):
            return None
        place = device if self.where == "device" else torch.device("cpu")
        with torch.no_grad():
            return self.encoder.prepare(manifest, sources.tensors, sources.streamed, place, call.delta_holds)

    @staticmethod
    def sent_bytes(
        manifest: Manifest, halves: Mapping[str, Any], call: SyncCall, prepared: PreparedSync | None
    ) -> dict[str, int]:
        """Per transport of ``call``, the bytes it moved (a delta header included)."""
        sent = {}
        for kind in call.kinds:
            if prepared is not None and halves[kind].carries_deltas:
                sent[kind] = header_nbytes(manifest) + prepared.sent_nbytes(call.to(kind), manifest)
            else:
                sent[kind] = manifest.total_bytes
        return sent
