"""vLLM's weight-reload lifecycle, found in whichever vLLM is installed.

vLLM's loaders may post-process weights after loading (its CPU kernels repack linear
weights and drop the plain tensor), so a later ``model.load_weights`` outside the reload
lifecycle fails (``'Parameter' object has no attribute 'weight_loader'``). Around every
update: ``begin(model)``, any number of ``model.load_weights(...)``, ``end(model, config)``.
vLLM 0.32 names these ``initialize_layerwise_reload`` / ``finalize_layerwise_reload``
(``vllm.model_executor.model_loader.reload``); later versions call them ``start_reload`` /
``finish_reload``. The names move between minor versions, so they are looked up here, once.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weightsync import WeightSyncError

_MODULE = "vllm.model_executor.model_loader.reload"
#: (begin, end) pairs by vLLM version, newest first.
_NAMES = (("start_reload", "finish_reload"), ("initialize_layerwise_reload", "finalize_layerwise_reload"))


@dataclass(frozen=True)
class ReloadLifecycle:
    begin: Callable[[Any], Any]
    end: Callable[[Any, Any], Any]
    names: tuple[str, str]


@functools.cache
def lifecycle() -> ReloadLifecycle:
    module = importlib.import_module(_MODULE)
    for begin, end in _NAMES:
        if callable(getattr(module, begin, None)) and callable(getattr(module, end, None)):
            finish = getattr(module, end)

            def end_and_refresh(model: Any, model_config: Any, finish: Callable[..., Any] = finish) -> None:
                finish(model, model_config)
                refresh_tied(model)

            return ReloadLifecycle(getattr(module, begin), end_and_refresh, (begin, end))
    import vllm

    raise WeightSyncError(
        f"vLLM {getattr(vllm, '__version__', '?')}: {_MODULE} has none of the reload functions weightsync "
        f"knows ({', '.join('/'.join(p) for p in _NAMES)}); weightsync.vllm supports vLLM 0.32 and later"
    )


def refresh_tied(model: Any) -> list[str]:
    """Post-process again every module that shares a parameter with an earlier one.

    vLLM's layerwise reload processes a tied tensor through its first owner only (its own
    docs list this limitation): with tied embeddings, ``lm_head`` keeps the kernel it built
    from the old weights at startup (vLLM's CPU build packs it for oneDNN), so the engine
    computes logits from stale weights although every parameter is new. Running the
    module's unquantized ``process_weights_after_loading`` again rebuilds that kernel from
    the parameter it shares. Returns the names of the modules refreshed.
    """
    first_owner: dict[int, str] = {}
    refreshed = []
    for module_name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False))
        shared = [p for _, p in params if id(p) in first_owner]
        for _, p in params:
            first_owner.setdefault(id(p), module_name)
        method = getattr(module, "quant_method", None)
        if shared and method is not None and all(p.numel() > 0 for _, p in params):
            process = getattr(method, "process_weights_after_loading", None)
            if callable(process):
                process(module)
                refreshed.append(module_name)
    return refreshed
