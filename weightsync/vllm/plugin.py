"""The ``vllm.general_plugins`` entry point: registers the ``weightsync`` backend.

vLLM calls every general plugin in each of its processes before the model loads, which is
when the worker creates the configured ``weight_transfer_config`` backend. Registration is
lazy (by module path), so a vLLM that never uses the backend never imports weightsync's
Ray-side code.
"""

from __future__ import annotations

BACKEND = "weightsync"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    registry = getattr(WeightTransferEngineFactory, "_registry", {})
    if BACKEND not in registry:  # plugins may load more than once per process
        WeightTransferEngineFactory.register_engine(BACKEND, "weightsync.vllm.backend", "WeightsyncTransferEngine")
