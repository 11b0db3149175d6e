"""One adapter of a PEFT model, as a sync reads and writes it.

PEFT decides which tensors make up an adapter and what they are called in a checkpoint
(``get_peft_model_state_dict``: the A/B matrices of every target module, DoRA magnitudes,
lora biases, embedding factors, ``modules_to_save`` copies, trained biases; names without
the adapter's own name). :class:`PeftAdapter` asks PEFT once per setup (and again only when
the module tree changed), then maps every one of those names to the model's own tensor, so
a trainer sends from its parameters and a worker writes into its own, in place, with no
state dict built per sync. ``save_embedding_layers=False``: the base model's embeddings
are never part of what travels.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from weightsync.core.tensor_paths import TensorPaths
from weightsync.core.wire.adapter import AdapterConfig
from weightsync.core.wire.errors import ManifestError, WeightSyncError


def is_peft_model(module: object) -> bool:
    """True for a PEFT model (``peft.PeftModel``); False also when PEFT is not installed."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(module, PeftModel)


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


class PeftAdapter:
    """The adapter ``name`` of the PEFT model ``model`` (default: its one active adapter,
    fixed here). ``who`` names the party in errors; ``error`` is the class they raise
    (a trainer's refusal is a setting, a worker's a handshake)."""

    def __init__(
        self, model: nn.Module, who: str, name: str | None = None, error: type[WeightSyncError] = ManifestError
    ) -> None:
        self.who, self._error = who, error
        if not is_peft_model(model):
            raise error(
                f"{who}: a LoRA sync needs a PEFT model (peft.get_peft_model(model, LoraConfig(...))), and {who} "
                f"holds a {type(model).__name__}" + ("" if peft_installed() else "; PEFT is not installed here")
            )
        self.model = model
        self.name = name if name is not None else self._active()
        configs = getattr(model, "peft_config", {})
        if self.name not in configs:
            raise error(f"{who}: the PEFT model has no adapter {self.name!r} (it has {sorted(configs)})")
        self._pairs: list[tuple[str, torch.Tensor]] = []
        self._paths: TensorPaths | None = None

    def _active(self) -> str:
        active = list(getattr(self.model, "active_adapters", None) or [])
        if len(active) != 1:
            raise self._error(
                f"{self.who}: a LoRA sync sends one adapter, and the PEFT model has {len(active)} active "
                f"({active}); activate one with model.set_adapter(name)"
            )
        return str(active[0])

    def config(self) -> AdapterConfig:
        """The adapter's config as the handshake carries it (read now)."""
        try:
            return AdapterConfig.of_peft(self.model.peft_config[self.name])  # type: ignore[index]
        except ManifestError as exc:
            raise self._error(f"{self.who}: adapter {self.name!r}: {exc}") from exc

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the adapter, (checkpoint name, the model's own tensor), in PEFT's
        order; asks PEFT again only when the module tree changed since it last did."""
        if self._paths is None or not self._paths.unchanged():
            self._read()
        return self._pairs

    def _read(self) -> None:
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.model, adapter_name=self.name, save_embedding_layers=False)
        if not state:
            raise self._error(f"{self.who}: adapter {self.name!r} has no tensors to sync")
        live: dict[tuple[Any, ...], tuple[str, torch.Tensor]] = {}
        for path, tensor in [*self.model.named_parameters(remove_duplicate=False), *self.model.named_buffers()]:
            live.setdefault(_storage_key(tensor), (path, tensor))
        pairs, paths, lost = [], [], []
        for wire, tensor in state.items():
            found = live.get(_storage_key(tensor)) if tensor.numel() > 0 else None
            if found is None:
                lost.append(wire)
                continue
            paths.append(found[0])
            pairs.append((wire, found[1]))
        if lost:
            raise self._error(
                f"{self.who}: PEFT's state of adapter {self.name!r} holds tensors that are not the model's own "
                f"(computed, empty, or on the meta device): {', '.join(lost[:5])}; they cannot be synced in place"
            )
        self._pairs = pairs
        self._paths = TensorPaths(self.model, paths)


def peft_installed() -> bool:
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    return True
