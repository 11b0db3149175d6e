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
            return ReloadLifecycle(getattr(module, begin), getattr(module, end), (begin, end))
    import vllm

    raise WeightSyncError(
        f"vLLM {getattr(vllm, '__version__', '?')}: {_MODULE} has none of the reload functions weightsync "
        f"knows ({', '.join('/'.join(p) for p in _NAMES)}); weightsync.vllm supports vLLM 0.32 and later"
    )
