"""A LoRA adapter's meaning as the handshake carries it: :class:`AdapterConfig`.

With ``WeightSync(..., lora=True)`` the trainer sends only its PEFT adapter's tensors, and
those tensors mean something only together with the settings that say how the adapter is
applied: the rank, alpha and how the scaling is derived from them, which modules carry it,
DoRA's magnitudes, trained biases, and the other options that change what the adapter
computes. The trainer puts them in the Manifest (``Manifest.adapter``); every worker
compares them with what it can serve before any byte moves, and refuses a difference by
field (:meth:`AdapterConfig.differences`). Dropout is left out: it does nothing at inference.

Call order::

    AdapterConfig.of_peft(peft_model.peft_config[name])   # the trainer, at every setup
    manifest.adapter.differences(worker_config, who)       # a PEFT module worker, at accept
    manifest.adapter.peft_dict()                           # a vLLM engine, to build its adapter

This module reads PEFT's config through plain attributes; it imports no PEFT.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from weightsync.core.wire.errors import ManifestError

#: LoraConfig options, beyond the fields of :class:`AdapterConfig`, that change what an
#: adapter computes or which tensors it has; each one set (not None, False or empty) is
#: carried in ``options`` by name and value and compared like the rest.
OPTIONS = (
    "exclude_modules",
    "layers_to_transform",
    "layers_pattern",
    "trainable_token_indices",
    "target_parameters",
    "alora_invocation_tokens",
    "use_qalora",
    "layer_replication",
    "use_bdlora",
    "megatron_config",
    "velora_config",
    "monteclora_config",
    "kasa_config",
    "arrow_config",
)
#: Of :data:`OPTIONS`, those that only choose which modules carry the adapter (what the
#: tensor names show anyway): an engine that serves plain LoRA serves them too.
SELECTING = ("exclude_modules", "layers_to_transform", "layers_pattern")

#: Fields not compared between trainer and worker (see :meth:`AdapterConfig.differences`).
NOT_COMPARED = ("init_lora_weights",)


def _fail(message: str) -> None:
    raise ManifestError(f"LoRA adapter config: {message}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class AdapterConfig:
    """What a LoRA adapter's tensors mean, fixed by the trainer at setup. Validated on
    construction (and again by :meth:`Manifest.validate` on what arrives)."""

    peft_type: str = "LORA"
    """PEFT's adapter type; only ``"LORA"`` is carried."""

    r: int
    """The rank: lora_A is ``[r, in]``, lora_B ``[out, r]`` (unless ``rank_pattern`` says otherwise)."""

    lora_alpha: float
    """Scales the adapter's output by ``lora_alpha / r`` (``/ sqrt(r)`` with ``use_rslora``)."""

    target_modules: tuple[str, ...] | str
    """The modules that carry the adapter, sorted (or PEFT's regular expression, as given)."""

    use_rslora: bool = False
    """Rank-stabilized scaling: ``lora_alpha / sqrt(r)``."""

    rank_pattern: tuple[tuple[str, int], ...] = ()
    """Per-module ranks, ``(pattern, rank)``, sorted."""

    alpha_pattern: tuple[tuple[str, float], ...] = ()
    """Per-module alphas, ``(pattern, alpha)``, sorted."""

    use_dora: bool = False
    """Weight-decomposed LoRA: the adapter has magnitude vectors and computes differently."""

    bias: str = "none"
    """Which of the base model's biases were trained with the adapter (and travel with it)."""

    lora_bias: bool = False
    """lora_B has a bias of its own."""

    fan_in_fan_out: bool = False
    """The base layer stores its weight transposed (GPT-2's Conv1D)."""

    modules_to_save: tuple[str, ...] = ()
    """Modules trained in full beside the adapter, sorted; their copies travel with it."""

    options: tuple[tuple[str, str], ...] = ()
    """Every other option of :data:`OPTIONS` that is set, as ``(name, repr(value))``, sorted."""

    init_lora_weights: str = "True"
    """How the adapter was initialized, as text. Carried, not compared: it does not change
    what a synced adapter computes, except for inits that rewrite the base weights (PiSSA,
    OLoRA, CorDA, LoftQ), which an engine that serves the unmodified base refuses."""

    def __post_init__(self) -> None:
        if self.peft_type != "LORA":
            _fail(f"peft_type {self.peft_type!r}: weightsync syncs LoRA adapters only (peft.LoraConfig)")
        if not _is_int(self.r) or self.r < 1:
            _fail(f"r must be a positive integer, got {self.r!r}")
        if not _number(self.lora_alpha):
            _fail(f"lora_alpha must be a finite number, got {self.lora_alpha!r}")
        object.__setattr__(self, "lora_alpha", float(self.lora_alpha))
        targets = self.target_modules
        if isinstance(targets, str):
            if not targets:
                _fail("target_modules is an empty string")
        elif not isinstance(targets, tuple) or not all(isinstance(t, str) and t for t in targets):
            _fail(f"target_modules must be a tuple of module names or a pattern, got {targets!r}")
        for name in ("use_rslora", "use_dora", "lora_bias", "fan_in_fan_out"):
            if not isinstance(getattr(self, name), bool):
                _fail(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.bias, str) or not self.bias:
            _fail(f"bias must be PEFT's bias mode ('none', 'all', 'lora_only'), got {self.bias!r}")
        self._check_pairs("rank_pattern", lambda v: _is_int(v) and v > 0)
        self._check_pairs("alpha_pattern", _number)
        self._check_pairs("options", lambda v: isinstance(v, str))
        if not isinstance(self.modules_to_save, tuple) or not all(isinstance(m, str) for m in self.modules_to_save):
            _fail(f"modules_to_save must be a tuple of module names, got {self.modules_to_save!r}")
        if not isinstance(self.init_lora_weights, str):
            _fail(f"init_lora_weights is carried as text, got {self.init_lora_weights!r}")

    def _check_pairs(self, name: str, good: Any) -> None:
        pairs = getattr(self, name)
        if not isinstance(pairs, tuple) or not all(
            isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and good(p[1]) for p in pairs
        ):
            _fail(f"{name} must be a tuple of (name, value) pairs, got {pairs!r}")

    @classmethod
    def of_peft(cls, config: Any) -> AdapterConfig:
        """The carried form of a ``peft.LoraConfig`` (anything else is refused, naming its type)."""
        kind = getattr(config, "peft_type", None)
        kind = getattr(kind, "value", kind)
        if kind != "LORA":
            _fail(f"the adapter is a {kind or type(config).__name__} adapter; weightsync syncs LoRA adapters only")
        targets = config.target_modules
        options = tuple(
            sorted((name, repr(_plain(value))) for name in OPTIONS if _set(value := getattr(config, name, None)))
        )
        return cls(
            r=config.r,
            lora_alpha=config.lora_alpha,
            target_modules=targets if isinstance(targets, str) else tuple(sorted(set(targets or ()))),
            use_rslora=bool(config.use_rslora),
            rank_pattern=_pairs(config.rank_pattern),
            alpha_pattern=_pairs(config.alpha_pattern),
            use_dora=bool(config.use_dora),
            bias=str(config.bias),
            lora_bias=bool(getattr(config, "lora_bias", False)),
            fan_in_fan_out=bool(config.fan_in_fan_out),
            modules_to_save=tuple(sorted(set(config.modules_to_save or ()))),
            options=options,
            init_lora_weights=str(config.init_lora_weights),
        )

    def differences(self, other: AdapterConfig, who: str) -> list[str]:
        """One line per compared field where ``other`` (``who``'s adapter) differs from this one
        (the trainer's); empty when ``who`` computes what the trainer's adapter computes."""
        lines = []
        for f in fields(self):
            if f.name in NOT_COMPARED:
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                lines.append(f"{f.name}: {mine!r} on the trainer, {theirs!r} on {who}")
        return lines

    def peft_dict(self) -> dict[str, Any]:
        """The config as PEFT writes it (``adapter_config.json``'s fields this carries),
        for loaders that read that form, such as vLLM's."""
        init: bool | str = {"True": True, "False": False}.get(self.init_lora_weights, self.init_lora_weights)
        targets = self.target_modules
        return {
            "peft_type": self.peft_type,
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "target_modules": targets if isinstance(targets, str) else list(targets),
            "use_rslora": self.use_rslora,
            "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
            "use_dora": self.use_dora,
            "bias": self.bias,
            "lora_bias": self.lora_bias,
            "fan_in_fan_out": self.fan_in_fan_out,
            "modules_to_save": list(self.modules_to_save) or None,
            "init_lora_weights": init,
        }

    def summary(self) -> str:
        targets = self.target_modules if isinstance(self.target_modules, str) else ",".join(self.target_modules)
        alpha = f"{self.lora_alpha:g}"
        extra = "".join(f", {flag}" for flag in ("use_rslora", "use_dora") if getattr(self, flag))
        return f"LoRA r={self.r} alpha={alpha} on {targets}{extra}"


def _set(value: object) -> bool:
    return value is not None and value is not False and value != {} and value != [] and value != ()


def _plain(value: object) -> object:
    """A set becomes a sorted list, so its text does not depend on hash order."""
    if isinstance(value, set | frozenset):
        return sorted(value, key=repr)
    return value


def _pairs(mapping: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((str(k), v) for k, v in (mapping or {}).items()))
