"""What a ServerWorker asks each rank of its server beyond the coordinator's protocol.

A function here is sent by reference (``Call(rank_of)``) and runs inside the server's
worker process, given the weightsync backend (``WeightsyncTransferEngine``); this module
imports nothing on its own, so the ServerWorker that sends it needs no vLLM.
"""

from __future__ import annotations

from typing import Any

from weightsync import WeightSyncError


def rank_of(engine: Any) -> Any:
    """This rank's ``RankInfo`` (``ServerWorker.ranks()``)."""
    from weightsync.vllm.extension import rank_info

    if engine.endpoint is None:
        raise WeightSyncError("no weightsync endpoint on this vLLM worker yet")
    return rank_info(engine.endpoint)


__all__ = ["rank_of"]
