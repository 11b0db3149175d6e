"""Which LoRA adapter an engine actor's ``generate`` uses by default: the synced one.

The engine actors forward every coordinator call to their TP ranks; :class:`ServedAdapter`
watches those calls. An accepted Manifest that carries an adapter starts a LoRA session;
each commit of it at a new version makes that version the engine's synced adapter
(:class:`AdapterInfo`), which ``generate`` then uses unless told otherwise. A sync that
fails never commits, so the adapter of the last committed version keeps serving. Call
order in the actor::

    served.forwarded(method, args, outcome, state)   # after every forwarded call
    served.request("synced" | None | LoRARequest)    # what generate hands vLLM
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from weightsync.core.wire.manifest import Manifest
from weightsync.vllm.lora import SYNCED_LORA_ID, synced_request

#: ``generate(..., lora_request=SYNCED)``: the adapter weightsync synced (the default).
SYNCED = "synced"


@dataclass(frozen=True, kw_only=True)
class AdapterInfo:
    """The adapter an engine serves as its synced one (what ``adapter()`` returns)."""

    #: vLLM's name for it (``LoRARequest.lora_name``): ``weightsync-<engine name>``.
    name: str
    #: vLLM's int id for it (``LoRARequest.lora_int_id``).
    lora_int_id: int
    #: The sync version it holds.
    version: int
    #: ``LoRARequest.lora_path``: nothing is stored there (the adapter was built from memory);
    #: it names the version, so vLLM's prefix cache keeps versions apart.
    path: str
    #: The adapter's config, as ``AdapterConfig.summary()`` says it.
    config: str

    def request(self) -> Any:
        """The ``vllm.lora.request.LoRARequest`` that asks for this adapter."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_int_id, self.path)


class ServedAdapter:
    """What one engine actor serves; see the module doc."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        #: The accepted adapter's summary while a LoRA session is set up, else None.
        self._session: str | None = None
        self.info: AdapterInfo | None = None

    def forwarded(self, method: str, args: tuple[Any, ...], outcome: Any, state: tuple[int | None, str] | None) -> None:
        """After every forwarded call: its outcome, and the engine's (version, state) after it."""
        if method == "ws_accept" and getattr(outcome, "ok", False) and args:
            adapter = args[0].adapter if isinstance(args[0], Manifest) else None
            self._session = adapter.summary() if adapter is not None else None
        if state is not None and state[0] is not None and state[1] == "committed":
            self._committed(state[0])

    def _committed(self, version: int) -> None:
        if self._session is None or (self.info is not None and self.info.version == version):
            return
        request = synced_request(self.engine, version)
        self.info = AdapterInfo(
            name=request.lora_name,
            lora_int_id=SYNCED_LORA_ID,
            version=version,
            path=request.lora_path,
            config=self._session,
        )

    def request(self, choice: Any) -> Any:
        """``SYNCED``: the synced adapter's request (None before the first LoRA sync: the base
        model); None: the base model; anything else is handed to vLLM as it is."""
        if isinstance(choice, str) and choice == SYNCED:
            return self.info.request() if self.info is not None else None
        return choice


class AsyncAdapterReport:
    """Mixed into :class:`~weightsync.vllm.AsyncVLLMWorker`: its ``adapter()``, from the
    :class:`ServedAdapter` it keeps as ``_served`` (an asyncio actor's methods are coroutines)."""

    _served: ServedAdapter

    async def adapter(self) -> AdapterInfo | None:
        """The synced LoRA adapter ``generate`` uses by default, with its version (None
        before the first committed LoRA sync)."""
        return self._served.info
