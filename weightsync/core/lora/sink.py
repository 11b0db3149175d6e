"""The worker's side of a LoRA sync: which sink takes the adapter, checked at accept.

:func:`session_sink` is what a :class:`~weightsync.core.receiver.WeightReceiver` asks at
every accept: for a Manifest without an adapter, the worker's own sink; with one, a sink
for the adapter, made by the worker's ``adapter_sink`` factory if it has one (an engine
that serves adapters its own way) or, for a ``ModuleSink`` of a PEFT model, an
:class:`AdapterSink` over that model's active adapter, whose config must equal the
trainer's (every difference named by field). Any other worker is refused, by name.

:class:`AdapterSink` writes into the adapter's own parameters (the base model is never
touched): ipc and broadcast copy into them, direct exports them, ``verify`` reads them back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from weightsync.core.lora.peft_model import PeftAdapter, is_peft_model, peft_installed
from weightsync.core.packing import tensor_checksums
from weightsync.core.sinks import ModuleSink, Sink
from weightsync.core.wire.errors import ManifestError, ModelChangedError
from weightsync.core.wire.manifest import Manifest, TensorSpec

#: ``factory(manifest, who)`` -> the sink that takes the Manifest's adapter on ``who``, or
#: ManifestError naming what ``who`` cannot serve.
AdapterSinkFactory = Callable[[Manifest, str], Sink]


class AdapterSink:
    """A PEFT model's adapter as a sink: tensors by checkpoint name, written in place."""

    keeps_references = False
    records_checksums = True
    #: The wire's bytes land in the adapter's parameters: a dtype difference cannot be cast.
    casts_on_load = False

    def __init__(self, adapter: PeftAdapter) -> None:
        self.adapter = adapter
        self._order: list[torch.Tensor] = []

    def held(self) -> dict[str, torch.Tensor]:
        return dict(self.adapter.tensors())

    def local_specs(self) -> list[TensorSpec]:
        held = self.adapter.tensors()
        meta = [name for name, t in held if t.is_meta]
        if meta:
            raise ManifestError(
                f"{self.adapter.who}: {len(meta)} tensor(s) of its adapter are on the meta device "
                f"({', '.join(meta[:5])}): materialize the model before the setup"
            )
        return [TensorSpec.of(name, t) for name, t in held]

    def _in_order(self, manifest: Manifest) -> list[torch.Tensor]:
        held = self.held()
        missing = [s.name for s in manifest.specs if s.name not in held]
        if missing:
            raise ModelChangedError(
                f"{self.adapter.who}: adapter tensors of the manifest no longer in the model: "
                f"{', '.join(missing[:5])}; run setup() again"
            )
        order = [held[s.name] for s in manifest.specs]
        problems = [p for s, t in zip(manifest.specs, order) if (p := s.mismatch(t)) is not None]
        if problems:
            raise ModelChangedError(
                f"{self.adapter.who}: adapter tensors changed since setup (nothing was written): "
                f"{'; '.join(problems)}; run setup() again"
            )
        self._order = order
        return order

    def destinations(self, manifest: Manifest) -> list[torch.Tensor | None]:
        return [t.data if t.is_contiguous() else None for t in self._in_order(manifest)]

    def consume(self, items: list[tuple[str, torch.Tensor]]) -> None:
        held = self.held()
        with torch.no_grad():
            for name, tensor in items:
                held[name].copy_(tensor)

    def direct_tensors(self, manifest: Manifest) -> list[torch.Tensor]:
        return self._in_order(manifest)

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        self._order[index].data = tensor

    def checksums(self, manifest: Manifest) -> list[int]:
        return tensor_checksums(self._in_order(manifest))


def session_sink(base: Sink, manifest: Manifest, who: str, factory: AdapterSinkFactory | None) -> Sink:
    """The sink ``who`` receives this session into (see the module doc)."""
    adapter = manifest.adapter
    if adapter is None:
        return base
    if factory is not None:
        return factory(manifest, who)
    module = getattr(base, "module", None)
    if not (isinstance(base, ModuleSink) and is_peft_model(module)):
        raise ManifestError(
            f"{who}: the trainer sends only its LoRA adapter ({adapter.summary()}; lora=True), and {who} "
            f"{_holds(base, module)}; give it the same PEFT model (peft.get_peft_model with an equal LoraConfig), "
            "or sync the whole model (lora=False)"
        )
    assert module is not None
    mine = PeftAdapter(module, who)
    problems = adapter.differences(mine.config(), who)
    if problems:
        raise ManifestError(
            f"{who}: its LoRA adapter {mine.name!r} differs from the trainer's in what it computes:\n  "
            + "\n  ".join(problems)
            + f"\nBuild {who}'s PEFT model with the trainer's LoraConfig"
        )
    return AdapterSink(mine)


def _holds(base: Sink, module: object) -> str:
    if isinstance(base, ModuleSink):
        return f"holds a {type(module).__name__}, not a PEFT model" + (
            "" if peft_installed() else " (PEFT is not installed)"
        )
    return f"loads whole models through its {type(base).__name__}, which takes no adapter"
