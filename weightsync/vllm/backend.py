"""weightsync as a native vLLM weight-transfer backend (``weight_transfer_config={"backend": "weightsync"}``).

vLLM 0.32's ``vllm.distributed.weight_transfer`` lets a backend own the worker side of an
update: ``init_weight_transfer_engine(init_info)`` once, then per update
``start_weight_update()``, ``update_weights(update_info)`` (any number), and
``finish_weight_update()`` (reachable from ``LLM.collective_rpc``, ``AsyncLLM`` and the HTTP
server). This backend makes one :class:`~weightsync.vllm.rank.RankEndpoint` per worker at
init; each ``update_weights({"call": bytes})`` runs one weightsync protocol call on it (the
coordinator's calls, encoded by :mod:`weightsync.vllm.codec`), and its answer is kept for
:meth:`WeightsyncTransferEngine.take_reply`. Layerwise reload runs inside the update, as
vLLM's checkpoint-format engines do: it begins at the first tensor batch (so an update that
loads nothing leaves the model alone) and is finalized in ``finish_weight_update``. The
version goes to vLLM with ``finish_weight_update(weight_version=...)`` on ``AsyncLLM`` or
``set_weight_version`` on the engine, which :class:`~weightsync.vllm.VLLMWorker` does.

A :class:`~weightsync.vllm.ServerWorker` drives the same backend in a running vLLM server
through its RL routes: its init carries a sealed session (``init_info["server"]``, see
:mod:`weightsync.vllm.remote`), each ``update_info["call"]`` is then sealed text rather than
bytes, and each rank sends its answer back on its own connection instead of keeping it.

The backend is registered in every vLLM process by the ``vllm.general_plugins`` entry point
(``weightsync.vllm.plugin:register``), before the model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightsync import TensorSpec, WeightSyncError
from weightsync.vllm.amx import request_amx_tiles
from weightsync.vllm.codec import decode_call, encode_reply, failed_reply
from weightsync.vllm.rank import RankEndpoint
from weightsync.vllm.relay import tp_relay
from weightsync.vllm.reload import lifecycle
from weightsync.vllm.remote import RemoteLink, hand_over


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """Plain data (msgpack-safe): the worker's name, and the expected tensors as
    ``[name, shape, dtype name]`` rows (None accepts any trainer)."""

    name: str = "vllm"
    expected_specs: list[list[Any]] | None = None
    #: A ServerWorker's sealed session (``weightsync.vllm.remote.seal_init``); it then
    #: names the worker and its expected tensors itself.
    server: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")

    def specs(self) -> list[TensorSpec] | None:
        if self.expected_specs is None:
            return None
        return [TensorSpec(str(n), tuple(int(d) for d in shape), str(dtype)) for n, shape, dtype in self.expected_specs]


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """One encoded weightsync call (``weightsync.vllm.codec.encode_call``): bytes in process,
    or a ServerWorker's sealed text (``weightsync.vllm.remote.seal_call``) over HTTP."""

    call: bytes | str = field(default=b"")

    def __post_init__(self) -> None:
        if not isinstance(self.call, bytes | bytearray | str) or not self.call:
            raise ValueError(
                "update_info['call'] must be one encoded weightsync call: non-empty bytes, or a ServerWorker's "
                "sealed text"
            )


class WeightsyncTransferEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        if torch.device(device).type == "cpu":
            request_amx_tiles()  # made as the model loads, before any request (amx.py says why)
        self.endpoint: RankEndpoint | None = None
        self._reply: bytes | None = None
        #: A ServerWorker's session, when one initialised this backend over HTTP.
        self.link: RemoteLink | None = None
        #: Whether vLLM's update session (start ... finish) is open: vLLM opens it once this
        #: backend's start returned, and ends it by resetting the update target.
        self.updating = False

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        link = RemoteLink.accept(init_info.server) if init_info.server is not None else None
        last = self.endpoint
        self.shutdown()  # a new init replaces the last session: its transports and link close
        self.endpoint = RankEndpoint(
            model=lambda: self.model,
            device=torch.device(self.device),
            begin=lambda: lifecycle().begin(self.model),
            end=lambda: lifecycle().end(self.model, self.model_config),
            expected_specs=link.init.specs(self.vllm_config) if link is not None else init_info.specs(),
            relay=tp_relay(torch.device(self.device)),
            name=link.init.name if link is not None else init_info.name,
        )
        if last is not None:
            hand_over(last, self.endpoint)
        if link is not None:
            link.connect(*self.endpoint.weightsync_part, updating=self.updating)
            self.link = link

    def start_weight_update(self) -> None:
        """Nothing yet: the layerwise reload begins at this update's first tensor batch."""
        if self.endpoint is None:
            raise WeightSyncError("weightsync backend: init_weight_transfer_engine was not called")
        self.updating = True

    def reset_weight_update_target(self) -> None:
        super().reset_weight_update_target()
        self.updating = False  # vLLM resets after a finish and after a failed update or start

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        if isinstance(update_info.call, str):
            self._serve_remote(update_info.call)
            return
        if self.endpoint is None:
            self._reply = encode_reply(
                failed_reply(WeightSyncError("weightsync backend: init_weight_transfer_engine was not called"))
            )
            return
        try:
            call = decode_call(bytes(update_info.call))
        except Exception as exc:  # noqa: BLE001 - encoded for the caller, who re-raises it
            self._reply = encode_reply(failed_reply(exc))
            return
        self._reply = self.endpoint.serve(call, None, settle=False)

    def _serve_remote(self, text: str) -> None:
        """Run a ServerWorker's sealed call and send the answer back on this rank's connection.
        A call whose seal or session does not hold raises (the HTTP call fails; nothing runs)."""
        if self.link is None or self.endpoint is None:
            raise WeightSyncError(
                "this vLLM server's weightsync backend holds no ServerWorker session: a ServerWorker must call "
                "/init_weight_transfer_engine first (it does so as it connects)"
            )
        payload = self.link.open_call(text)
        try:
            reply = self.endpoint.serve(decode_call(payload), self, settle=False)
        except Exception as exc:  # noqa: BLE001 - encoded for the ServerWorker, who re-raises it
            reply = encode_reply(failed_reply(exc))
        self.link.reply(reply)

    def take_reply(self) -> bytes:
        """The encoded answer of the last ``update_weights`` call, once."""
        reply, self._reply = self._reply, None
        if reply is None:
            return encode_reply(failed_reply(WeightSyncError("weightsync backend: no update_weights call to answer")))
        return reply

    def finish_weight_update(self) -> None:
        if self.endpoint is not None:
            self.endpoint.end_reload()

    def shutdown(self) -> None:
        receiver = getattr(self.endpoint, "_ws_receiver", None)
        try:
            if receiver is not None:
                receiver.close_transports(abort=True)
        finally:
            if self.link is not None:
                self.link.close()
                self.link = None
