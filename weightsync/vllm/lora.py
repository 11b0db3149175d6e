"""A vLLM engine's side of a LoRA sync, inside each worker process (one per TP rank).

vLLM loads LoRA adapters by path: ``LoRARequest(name, id, path)`` makes each worker read
``adapter_config.json`` and the adapter's safetensors, build a ``LoRAModel`` with
``LoRAModel.from_lora_tensors`` and register it with its LoRA manager (replacing one of the
same id with ``load_inplace=True``). weightsync runs inside every worker already (the
worker extension), so it does the same from memory: no file is written. At each commit
:class:`EngineAdapter` builds the ``LoRAModel`` from the received tensors and the Manifest's
config, then replaces the synced adapter in the worker's manager under one fixed id
(:data:`SYNCED_LORA_ID`), exactly as an in-place load does: remove, add, activate (copy into
the rank's LoRA slot, where each LoRA layer keeps its TP shard). It stays pinned in the
manager's CPU cache, so vLLM never evicts it and never looks for it on disk; requests name
it with :func:`synced_request`, whose path (never read) carries the version, so the prefix
cache, keyed on it, never serves one version's blocks to the next.

Call order, per rank::

    adapter.check(manifest, who)     # ws_accept: refuses, by name, what the engine cannot serve
    adapter.install(items, manifest)  # the sync's commit (a staged sink lands; TP rank 0
                                      # relays the tensors, every rank installs them)

A build that fails leaves the previous adapter in place; one whose install fails (vLLM
refusing it late) restores the previous one before the error is raised.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from weightsync import TensorSpec, WeightSyncError
from weightsync.core.wire.adapter import SELECTING, AdapterConfig
from weightsync.core.wire.errors import ManifestError
from weightsync.core.wire.manifest import Manifest

#: The LoRA int id of the adapter weightsync syncs into an engine (one per engine).
SYNCED_LORA_ID = 1_000_000

#: What an install uses of a vLLM worker's LoRA manager, and of the model manager inside it
#: (checked at setup, so a vLLM that moved them is refused before any byte moves).
_WORKER_MANAGER = ("lora_config", "vocab_size", "max_position_embeddings")
_MODEL_MANAGER = (
    "model",
    "supported_lora_modules",
    "packed_modules_mapping",
    "get_adapter",
    "add_adapter",
    "remove_adapter",
    "activate_adapter",
    "_pin_lora_in_cpu_cache",
)


def synced_request(engine: str, version: int) -> Any:
    """The ``LoRARequest`` naming ``engine``'s synced adapter at ``version``."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"weightsync-{engine}", SYNCED_LORA_ID, f"weightsync://{engine}/v{version}")


class EngineAdapter:
    """The synced adapter of one vLLM worker. ``runner`` returns the worker's model runner
    (None where adapters cannot be served, as on the native weight-transfer path);
    ``expected``: the engine's checkpoint tensors, which each adapter tensor's shape is
    checked against."""

    def __init__(self, runner: Callable[[], Any] | None, expected: Sequence[TensorSpec] | None, name: str) -> None:
        self._runner = runner
        self._base = {s.name: s.shape for s in expected or ()}
        self.name = name

    # the handshake --------------------------------------------------------------------------
    def check(self, manifest: Manifest, who: str) -> None:
        """Refuse, naming ``who`` and what to change, an adapter this engine cannot serve."""
        config = manifest.adapter
        assert config is not None
        wm = self._manager(who, config)
        unsupported = [name for name, _ in config.options if name not in SELECTING]
        if unsupported:
            raise ManifestError(
                f"{who}: the trainer's adapter ({config.summary()}) uses {', '.join(unsupported)}, which vLLM "
                "does not serve; train a plain LoRA adapter for this engine"
            )
        helper = self._helper(wm, config, who)
        problems = self._tensor_problems(wm, helper, manifest.specs)
        if problems:
            raise ManifestError(
                f"{who}: the trainer's adapter does not fit this engine ({len(problems)} problem(s)):\n  "
                + "\n  ".join(problems[:20])
            )

    def _manager(self, who: str, config: AdapterConfig) -> Any:
        if self._runner is None:
            raise ManifestError(
                f"{who}: takes LoRA adapters through weightsync's worker extension only (vLLM's native "
                "weight-update path drops every adapter when an update finishes); call use_native(False)"
            )
        wm = getattr(self._runner(), "lora_manager", None)
        if wm is None:
            raise ManifestError(
                f"{who}: the trainer sends a LoRA adapter ({config.summary()}) and this engine was started "
                f"without LoRA: start it with enable_lora=True and max_lora_rank of at least {config.r}"
            )
        manager = getattr(wm, "_adapter_manager", None)
        missing = [f"lora_manager.{n}" for n in _WORKER_MANAGER if not hasattr(wm, n)]
        missing += [f"lora_manager._adapter_manager.{n}" for n in _MODEL_MANAGER if not hasattr(manager, n)]
        if missing:
            import vllm

            raise ManifestError(
                f"{who}: this vLLM ({getattr(vllm, '__version__', '?')}) has no {', '.join(missing)}, which "
                "weightsync builds adapters in memory with (vLLM 0.32's LoRA manager); sync the whole model"
            )
        return wm

    @staticmethod
    def _helper(wm: Any, config: AdapterConfig, who: str) -> Any:
        from vllm.lora.peft_helper import PEFTHelper

        try:
            helper = PEFTHelper.from_dict(
                {**config.peft_dict(), "vllm_max_position_embeddings": wm.max_position_embeddings}
            )
            helper.validate_legal(wm.lora_config)
        except ValueError as exc:
            raise ManifestError(f"{who}: vLLM refuses the trainer's adapter ({config.summary()}): {exc}") from exc
        return helper

    def _tensor_problems(self, wm: Any, helper: Any, specs: Sequence[TensorSpec]) -> list[str]:
        """One line per adapter tensor vLLM would not load here, or whose shape does not fit
        the engine's base layer (as the checkpoint it started from has it)."""
        from vllm.lora.utils import parse_fine_tuned_lora_name

        manager = wm._adapter_manager
        expected: set[str] = set()
        for module in manager.supported_lora_modules:
            expected.update(manager.packed_modules_mapping.get(module, [module]))
        mapper, _ = _mapping(manager.model)
        saved = set(helper.modules_to_save or ())
        problems = []
        for spec in specs:
            try:
                module, _ = parse_fine_tuned_lora_name(spec.name, mapper)
                peft_module, is_a = parse_fine_tuned_lora_name(spec.name)
            except ValueError:
                problems.append(f"{spec.name}: not a tensor vLLM loads as part of a LoRA adapter")
                continue
            if module.rsplit(".", 1)[-1] not in expected | saved:
                problems.append(
                    f"{spec.name}: module {module} is not one vLLM applies LoRA to here ({sorted(expected)})"
                )
                continue
            problem = self._shape_problem(spec, peft_module, is_a, helper)
            if problem:
                problems.append(problem)
        return problems

    def _shape_problem(self, spec: TensorSpec, module: str, is_a: bool, helper: Any) -> str | None:
        base = self._base.get(f"{module}.weight")
        if base is None or len(base) != 2 or len(spec.shape) != 2:
            return None  # a module the checkpoint does not list (a tied head): vLLM checks it on load
        rank, _ = helper.get_rank_and_scaling(module)
        embedding = "lora_embedding_" in spec.name
        out_dim, in_dim = (base[1], base[0]) if embedding else base
        want = (rank, in_dim) if is_a else (out_dim, rank)
        if spec.shape != want:
            return f"{spec.name}: shape {list(spec.shape)}, this engine's {module} takes {list(want)} (rank {rank})"
        return None

    # each commit ----------------------------------------------------------------------------
    def install(self, items: Sequence[tuple[str, torch.Tensor]], manifest: Manifest) -> None:
        """Make ``items`` (every tensor of the Manifest's adapter) the synced adapter, in place."""
        config = manifest.adapter
        assert config is not None
        tensors = dict(items)
        if set(tensors) != set(manifest.names):
            missing = sorted(set(manifest.names) - set(tensors))
            raise WeightSyncError(f"{self.name}: the adapter arrived without {len(missing)} tensor(s): {missing[:5]}")
        wm = self._manager(self.name, config)
        manager = wm._adapter_manager
        lora = self._build(wm, config, tensors)
        previous = manager.get_adapter(SYNCED_LORA_ID)
        manager.remove_adapter(SYNCED_LORA_ID)
        try:
            manager.add_adapter(lora)
            manager.activate_adapter(SYNCED_LORA_ID)
        except BaseException:
            manager.remove_adapter(SYNCED_LORA_ID)
            if previous is not None:
                manager.add_adapter(previous)
                manager.activate_adapter(SYNCED_LORA_ID)
                manager._pin_lora_in_cpu_cache(SYNCED_LORA_ID)
            raise
        manager._pin_lora_in_cpu_cache(SYNCED_LORA_ID)

    def _build(self, wm: Any, config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> Any:
        """The ``LoRAModel`` of ``tensors``, validated as vLLM validates one it loads from disk."""
        from vllm.lora.lora_model import LoRAModel

        manager = wm._adapter_manager
        mapper, skip = _mapping(manager.model)
        lora = LoRAModel.from_lora_tensors(
            SYNCED_LORA_ID,
            tensors,
            self._helper(wm, config, self.name),
            device="cpu",
            dtype=wm.lora_config.lora_dtype,
            model_vocab_size=wm.vocab_size,
            weights_mapper=mapper,
            skip_prefixes=skip,
        )
        for check in ("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora"):
            validate = getattr(manager, check, None)
            if callable(validate):
                validate(lora)
        return lora


def _mapping(model: Any) -> tuple[Any, Any]:
    """The model's checkpoint-name renames for adapters, and the prefixes it skips (as vLLM
    reads them when it loads an adapter from disk)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    return mapper, getattr(model, "lora_skip_prefixes", None)
