"""The trainer's side of a LoRA sync: a sender whose tensors are its PEFT adapter's.

:func:`send_adapter` runs on every trainer party at every setup, before the Manifest is
built: with ``lora=True`` it gives the :class:`~weightsync.core.sender.WeightSender` an
:class:`AdapterSource` (its ``source``: the adapter's tensors, the model's own parameters
under PEFT's checkpoint names) and that source's config (its ``adapter``: what goes into the
Manifest); with ``lora=False`` it points the sender back at the whole model. Each sync
then checks, as for any model, that the tensors still match the Manifest, and also that
the adapter's config did not change (a new alpha with the same tensors would mean
something else on every worker).
"""

from __future__ import annotations

import torch

from weightsync.core.lora.peft_model import PeftAdapter
from weightsync.core.sender import WeightSender
from weightsync.core.sharded import ShardedSender
from weightsync.core.wire.adapter import AdapterConfig
from weightsync.core.wire.errors import ModelChangedError, SettingsError


class AdapterSource:
    """The adapter active at setup of ``sender``'s PEFT model, as its ``source``."""

    def __init__(self, adapter: PeftAdapter) -> None:
        self.adapter = adapter
        #: The config the last Manifest carries; every later call checks the model still has it.
        self.agreed: AdapterConfig | None = None

    def config(self) -> AdapterConfig:
        """The adapter's config now, which every sync of this session is checked against."""
        self.agreed = self.adapter.config()
        return self.agreed

    def __call__(self) -> list[tuple[str, torch.Tensor]]:
        if self.agreed is not None:
            now = self.adapter.config()
            if now != self.agreed:
                changed = "; ".join(self.agreed.differences(now, "the model now"))
                raise ModelChangedError(
                    f"{self.adapter.who}: the config of LoRA adapter {self.adapter.name!r} changed since setup "
                    f"(nothing was sent): {changed}; run WeightSync.setup() again once every worker holds it"
                )
        return self.adapter.tensors()


def send_adapter(sender: WeightSender, lora: bool) -> None:
    """Point ``sender`` at its PEFT model's active adapter (``lora``) or at the whole model.

    Refused, naming the party and the setting: a model that is no PEFT model, one without
    exactly one active LoRA adapter, a sharded (DTensor) trainer, a sender given its own
    ``source`` or ``transform``.
    """
    ours = isinstance(sender.source, AdapterSource)
    if not lora:
        if ours:
            sender.source, sender.adapter = None, None
        return
    who = sender.name
    if isinstance(sender, ShardedSender):
        raise SettingsError(
            f"{who}: lora=True is not supported for a sharded (FSDP2/DTensor) trainer yet; sync the whole model "
            "(lora=False) or send the adapter from one unsharded trainer process"
        )
    if (sender.source is not None and not ours) or sender.transform is not None:
        raise SettingsError(
            f"{who}: lora=True sends the PEFT model's adapter, and this sender was given its own "
            f"{'source' if sender.source is not None else 'transform'}; drop it or sync with lora=False"
        )
    if sender.model is None:
        raise SettingsError(f"{who}: lora=True needs the trainer's model (a PEFT model); this sender has none")
    source = AdapterSource(PeftAdapter(sender.model, who, error=SettingsError))
    sender.source, sender.adapter = source, source.config
