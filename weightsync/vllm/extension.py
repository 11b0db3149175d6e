"""``weightsync.vllm.WorkerExtension``: weightsync inside every vLLM worker process.

Give it to vLLM as ``worker_extension_cls="weightsync.vllm.WorkerExtension"``; vLLM mixes
it into each worker (one per TP rank), and ``collective_rpc`` reaches its methods. Every
argument and result is ``bytes`` that weightsync encodes itself (see ``codec.py``), every
method returns bytes and never raises, so nothing it returns can stall vLLM's RPC::

    llm.collective_rpc("weightsync_setup", args=(encode_setup(name, expected_specs),))
    llm.collective_rpc("weightsync_call", args=(encode_call(Call("ws_accept", (...))),))
    llm.collective_rpc("weightsync_native_call", args=(payload,))   # via the native backend

:class:`~weightsync.vllm.VLLMWorker` does all of this (with a timeout on every call);
drive it by hand only for an engine you hold yourself.

Method names must not clash with vLLM's worker (vLLM refuses the extension otherwise), so
everything here is prefixed ``weightsync_`` / ``_weightsync_``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch

from weightsync import TensorSpec, WeightSyncError
from weightsync.core.stage import check_place
from weightsync.vllm.amx import request_amx_tiles
from weightsync.vllm.backend import WeightsyncTransferEngine
from weightsync.vllm.codec import decode_call, encode_reply, failed_reply, run_call
from weightsync.vllm.lines import LineInfo
from weightsync.vllm.rank import RankEndpoint
from weightsync.vllm.relay import tp_relay
from weightsync.vllm.reload import lifecycle
from weightsync.vllm.staged_rank import StagedRank


@dataclass(frozen=True)
class StageSetup:
    """How a rank stages (``stage_updates``): every rank is told at once."""

    #: Receive each sync into a stage while the model keeps serving, and swap it in
    #: between generation steps (``weightsync.vllm.staged_rank``).
    staged: bool = False
    #: Where the stage lives: "auto", "device" or "host" (``weightsync.core.stage``).
    stage: str = "auto"
    #: Keep the stage allocated between syncs.
    keep_stage: bool = False
    #: The engine actor's line for the rank's staging thread (None: no line yet, or unstaged).
    line: LineInfo | None = None
    #: How long a staging wait may last (the actor's ``timeout_s``).
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.staged, bool) or not isinstance(self.keep_stage, bool):
            raise ValueError(f"StageSetup.staged and keep_stage must be True or False, got {self!r}")
        check_place(self.stage, "stage")
        if self.staged and self.line is None:
            raise ValueError("StageSetup: staging needs the engine actor's line (line=None)")
        if not self.timeout_s > 0:
            raise ValueError(f"StageSetup.timeout_s must be positive, got {self.timeout_s!r}")


@dataclass(frozen=True)
class SetupInfo:
    """What every rank needs once: the worker's name, the tensors it expects, its staging."""

    name: str
    expected_specs: tuple[TensorSpec, ...] | None = None
    staging: StageSetup = StageSetup()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"SetupInfo.name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.staging, StageSetup):
            raise ValueError(f"SetupInfo.staging must be a StageSetup, got {type(self.staging).__name__}")


@dataclass(frozen=True)
class RankInfo:
    """One TP rank as the engine actor reports it."""

    tp_rank: int
    pid: int
    device: str
    loaded_tensors: int
    version: int | None
    state: str
    #: How the last weights loaded here arrived: this rank's own transport ("rank-ipc": fed
    #: by the trainer rank beside it), "relay" (handed on by TP rank 0), or "" before any.
    fed_by: str = ""
    #: Tensors this rank handed on to the other ranks over the TP group (rank 0, relay).
    relayed_tensors: int = 0


def encode_setup(info: SetupInfo | StageSetup) -> bytes:
    return bytes(cloudpickle.dumps(info))


def _staging(endpoint: RankEndpoint, setup: StageSetup) -> Callable[[], StagedRank]:
    """Makes the rank's staging side, connected to the engine actor's line."""
    line = setup.line
    assert line is not None, "StageSetup refuses staging without a line"
    return lambda: StagedRank(endpoint, line, setup.timeout_s)


def rank_info(endpoint: RankEndpoint) -> RankInfo:
    state = endpoint.receiver_state() or (None, "committed")
    return RankInfo(
        endpoint.tp_rank,
        os.getpid(),
        str(endpoint.device),
        endpoint.loaded,
        state[0],
        state[1],
        endpoint.fed_by,
        endpoint.relayed,
    )


class WorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the vLLM worker (``model_runner``,
    ``device``, ``vllm_config``, and the weight-transfer methods)."""

    _weightsync_endpoint: RankEndpoint | None = None
    _weightsync_session_open: bool = False

    # setup ------------------------------------------------------------------------------
    def weightsync_setup(self, payload: bytes) -> bytes:
        """Make this rank's endpoint (extension mode): the model's ``load_weights`` inside
        vLLM's reload lifecycle; on CPU, first ask for the AMX tiles vLLM's attention uses."""

        def setup() -> None:
            info = cloudpickle.loads(payload)
            if not isinstance(info, SetupInfo):
                raise TypeError(f"weightsync_setup takes SetupInfo bytes, got {type(info).__name__}")
            worker: Any = self
            if torch.device(worker.device).type == "cpu":
                request_amx_tiles()  # before the first request (amx.py says why)
            model = worker.model_runner.get_model
            staging = info.staging
            self._weightsync_endpoint = endpoint = RankEndpoint(
                model=model,
                device=torch.device(worker.device),
                begin=lambda: lifecycle().begin(model()),
                end=lambda: lifecycle().end(model(), worker.vllm_config.model_config),
                expected_specs=info.expected_specs,
                relay=tp_relay(torch.device(worker.device)),
                name=info.name,
                staged=staging.staged,
                stage=staging.stage,
                keep_stage=staging.keep_stage,
                runner=lambda: worker.model_runner,
            )
            if staging.staged:
                endpoint.set_staging(_staging(endpoint, staging))

        return run_call(setup, lambda: None)

    def _weightsync_ep(self) -> RankEndpoint:
        if self._weightsync_endpoint is None:
            raise WeightSyncError("weightsync_setup was not called on this vLLM worker")
        return self._weightsync_endpoint

    @contextlib.contextmanager
    def _weightsync_config(self) -> Iterator[None]:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            yield

    # calls ------------------------------------------------------------------------------
    def weightsync_call(self, payload: bytes) -> bytes:
        """One weightsync call on this rank (extension mode); returns Reply bytes."""
        try:
            call = decode_call(payload)
            endpoint = self._weightsync_ep() if isinstance(call.target, str) else self._weightsync_endpoint
            with self._weightsync_config():
                if endpoint is None:  # a callable before setup: no endpoint needed
                    return run_call(lambda: call.target(self, *call.args, **call.kwargs), lambda: None)  # type: ignore[operator]
                return endpoint.serve(call, self)
        except Exception as exc:  # noqa: BLE001 - encoded for the caller, who re-raises it
            return encode_reply(failed_reply(exc))

    def weightsync_native_call(self, payload: bytes) -> bytes:
        """One weightsync call through vLLM's own weight-update methods and the native
        ``weightsync`` backend: ``start_weight_update`` (once per update), ``update_weights``
        (the call), and ``finish_weight_update`` once the receiver left ``receiving``."""
        worker: Any = self
        try:
            engine = getattr(worker, "weight_transfer_engine", None)
            if not isinstance(engine, WeightsyncTransferEngine):
                raise WeightSyncError(
                    f"this vLLM worker's weight-transfer backend is {type(engine).__name__}, not weightsync's: "
                    "start the engine with weight_transfer_config={'backend': 'weightsync'}"
                )
            if not self._weightsync_session_open:
                worker.start_weight_update()
                self._weightsync_session_open = True
            worker.update_weights({"call": payload})
            reply = engine.take_reply()
            if engine.endpoint is not None and engine.endpoint.settles():
                self._weightsync_session_open = False
                try:
                    worker.finish_weight_update()
                except Exception:
                    # vLLM ends its update session only once the backend's finish returned:
                    # without a second finish (the reload bracket is closed by now, so the
                    # backend's part is a no-op) every later start_weight_update is refused.
                    worker.finish_weight_update()
                    raise
            return reply
        except Exception as exc:  # noqa: BLE001 - encoded for the caller, who re-raises it
            self._weightsync_session_open = False
            return encode_reply(failed_reply(exc))

    def weightsync_stage(self, payload: bytes) -> bytes:
        """Stage whole syncs on this rank from the next sync on, or stop (extension mode);
        ``payload`` is a :class:`StageSetup`. Every rank at once: staging forms a group."""

        def stage() -> None:
            setup = cloudpickle.loads(payload)
            if not isinstance(setup, StageSetup):
                raise TypeError(f"weightsync_stage takes StageSetup bytes, got {type(setup).__name__}")
            endpoint = self._weightsync_ep()
            endpoint.weightsync_sink.set_staged(setup.staged, setup.stage, setup.keep_stage)
            if setup.staged:
                with self._weightsync_config():
                    endpoint.set_staging(_staging(endpoint, setup))

        return run_call(stage, lambda: None)

    def weightsync_swap(self, version: int) -> bytes:
        """Swap this rank's staged sync into the model (the model's thread, between steps):
        the load through ``load_weights`` inside vLLM's reload, and the end of the reload.
        The reply's value is the seconds it took."""
        try:
            endpoint = self._weightsync_ep()
            if endpoint.staging is None:
                raise WeightSyncError(f"{endpoint.name}: this rank does not stage; nothing to swap")
            staging = endpoint.staging
            with self._weightsync_config():
                return run_call(lambda: staging.swap(version), endpoint.receiver_state)
        except Exception as exc:  # noqa: BLE001 - encoded for the caller, who re-raises it
            return encode_reply(failed_reply(exc))

    def weightsync_ranks(self, native: bool) -> bytes:
        """This rank's :class:`RankInfo`, of the native backend's endpoint or the extension's."""

        def info() -> RankInfo:
            engine = getattr(self, "weight_transfer_engine", None)
            endpoint = getattr(engine, "endpoint", None) if native else self._weightsync_endpoint
            if endpoint is None:
                raise WeightSyncError("no weightsync endpoint on this vLLM worker yet")
            return rank_info(endpoint)

        return run_call(info, lambda: None)
