"""``weightsync.vllm.AsyncVLLMWorker``: a Ray actor around vLLM's ``AsyncLLM`` that is a weightsync worker.

``AsyncLLM`` is what async RL frameworks and vLLM's server run: many requests in flight at
once, streamed. The actor is an asyncio actor, so ``generate`` calls from any number of
callers run concurrently with each other and with the coordinator's calls::

    engine = AsyncVLLMWorker.remote(model=path, dtype="bfloat16", pause_mode="keep")
    ray.get(engine.start.remote(), timeout=600)          # the engine starts (or on first use)
    with WeightSync(trainer, {"vllm": engine}) as ws:
        refs = [engine.generate.remote(batch, params) for batch in batches]   # in flight
        ws.sync(version=1)                               # pauses, loads, resumes
        outs = ray.get(refs, timeout=600)

Requests in flight when a sync starts: a sync holds generation off with vLLM's
``pause_generation(mode=pause_mode)`` from the start of its ``ws_receive`` until the
receiver leaves ``receiving`` (after ``ws_receive`` over ipc, after ``ws_commit`` over
broadcast or with verify), then ``resume_generation()``; new requests queue meanwhile.

* ``pause_mode="keep"`` (the default): in-flight requests are frozen, not lost. Their KV
  cache is dropped with the prefix cache (``clear_cache=True``), so when generation resumes
  each request recomputes its prompt and the tokens it already has with the new weights and
  samples its remaining tokens from them: a request that straddles a sync has its first
  tokens from the old weights and the rest from the new. The held-off time is the sync's
  own (pause, load, reload finalization, resume), whatever the requests' lengths.
* ``pause_mode="wait"``: the sync first waits for every in-flight request to finish, on the
  old weights; every output then comes from one version. The held-off time (for new
  requests) and the sync's wall time include that drain, bounded by ``timeout_s``.
* ``pause_mode="abort"``: in-flight requests end at once (``finish_reason="abort"``).

With ``stage_updates=True`` the engine stages each sync: every TP rank receives it into a
stage on a thread of its own while requests stream on, and the pause (``pause_mode``)
covers only the swap between two steps (``staging.py``, ``async_hold.py``).

Outputs generated entirely after a sync come from its weights, and the engine reports its
version (``weight_version()``; vLLM's ``update_weight_version`` before resuming). The
seconds from pause to resume go back with the sync's answer
(:attr:`WorkerReport.held_off_s <weightsync.core.wire.report.WorkerReport.held_off_s>`;
:meth:`last_hold` adds the requests in flight at the pause). The worker extension, TP relay,
timeouts and LoRA syncs are those of :class:`~weightsync.vllm.VLLMWorker` (``submit`` and
``generate`` use the synced adapter); the native backend path is not offered here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import ray

from weightsync import TensorSpec
from weightsync.core.stage import check_place
from weightsync.core.wire.messages import BoardOffer
from weightsync.core.wire.outcome import Outcome
from weightsync.core.wire.settings import DEFAULT_ENGINE_TIMEOUT_S
from weightsync.glue.actors import WORKER_PROTOCOL
from weightsync.glue.replies import REPLYING, on_board, reply_board_answer
from weightsync.glue.worker_mixin import LOCAL
from weightsync.vllm.async_hold import AsyncHolding
from weightsync.vllm.checkpoint import engine_specs
from weightsync.vllm.codec import Call, Reply, decode_reply, encode_call, unwrap
from weightsync.vllm.deaths import died
from weightsync.vllm.engine import EXTENSION, EngineCallError
from weightsync.vllm.extension import RankInfo, SetupInfo, encode_setup
from weightsync.vllm.hold import PAUSE_MODES, HoldRecord, SyncHold, check_pause_mode, with_held_off
from weightsync.vllm.parts import PartRouting, answer
from weightsync.vllm.requests import Requests
from weightsync.vllm.served import SYNCED, AsyncAdapterReport, ServedAdapter
from weightsync.vllm.sockets import SocketFolder
from weightsync.vllm.staging import STAGED_CALLS, Stager

log = logging.getLogger("weightsync")


def forward_worker_protocol_async(cls: type) -> type:
    """Give ``cls`` an ``async`` method for every name in :data:`WORKER_PROTOCOL`, each
    awaiting ``self.forward_weightsync(name, ...)`` (an asyncio Ray actor's methods must be
    coroutines to run on its event loop)."""

    def forwarder(method: str) -> Callable[..., Any]:
        async def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await self.forward_weightsync(method, *args, **kwargs)

        call.__name__ = call.__qualname__ = method
        call.__doc__ = f"Forwards {method} to the vLLM workers."
        return on_board(call) if method in REPLYING else call

    async def ws_reply_board(self: Any, offer: BoardOffer) -> Outcome:
        """Take the coordinator's reply board here, in the actor it calls."""
        return reply_board_answer(self, offer)

    for method in WORKER_PROTOCOL:
        if method not in vars(cls):
            setattr(cls, method, ws_reply_board if method in LOCAL else forwarder(method))
    return cls


@forward_worker_protocol_async
class _AsyncVLLMWorker(AsyncHolding, AsyncAdapterReport):
    def __init__(
        self,
        *,
        name: str = "vllm",
        timeout_s: float = DEFAULT_ENGINE_TIMEOUT_S,
        pause_mode: str = "keep",
        expected_specs: Sequence[TensorSpec] | None = None,
        check_model: bool = True,
        env: dict[str, str] | None = None,
        stage_updates: bool = False,
        stage: str = "auto",
        keep_stage: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        extension = engine_kwargs.setdefault("worker_extension_cls", EXTENSION)
        if extension != EXTENSION:
            raise ValueError(f"AsyncVLLMWorker sets worker_extension_cls={EXTENSION!r} itself; got {extension!r}")
        os.environ.update(env or {})  # before vLLM reads its settings
        self._sockets = SocketFolder.claim()
        self.name = name
        self.timeout_s = float(timeout_s)
        self._hold = SyncHold(check_pause_mode(pause_mode))
        self._specs = tuple(expected_specs) if expected_specs is not None else None
        self._check_model = check_model
        if not isinstance(stage_updates, bool):
            raise ValueError(f"stage_updates must be True or False, got {stage_updates!r}")
        self._stage_updates = stage_updates
        self._engine_kwargs = engine_kwargs
        self._llm: Any = None
        self._broken: str | None = None
        # One coordinator call, engine start or shutdown at a time (generate only takes it
        # to start the engine: requests run concurrently with everything).
        self._lock = asyncio.Lock()
        self._stager = Stager(name, self.timeout_s, check_place(stage), keep_stage)
        self._requests = Requests(name, self.timeout_s, self._stager.count)
        self._routing = PartRouting(1)
        self._version: int | None = None  # the version last given to vLLM
        self._served = ServedAdapter(name)

    async def start(self) -> int:
        """Start the engine unless it runs; returns the actor's pid. The coordinator's first
        call starts it too (AsyncLLM is made on the actor's event loop, which it streams on)."""
        async with self._lock:
            await self._started()
        return os.getpid()

    async def _engine(self) -> Any:
        """The engine, started under the lock unless it runs (two callers never start two)."""
        if self._llm is not None and self._broken is None:
            return self._llm
        async with self._lock:
            return await self._started()

    async def _started(self) -> Any:
        """The engine, started unless it runs; the caller holds the lock."""
        if self._broken is not None:
            raise EngineCallError(f"{self.name}: the vLLM engine is unusable ({self._broken})")
        if self._llm is not None:
            return self._llm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self._engine_kwargs))
        except Exception as exc:  # vLLM's says only "see root cause above", which is in our log
            raise EngineCallError(f"{self.name}: the vLLM engine did not start: {died('start', exc)}") from exc
        try:
            specs = self._specs
            if specs is None and self._check_model:
                specs = tuple(engine_specs(self.name, self._llm.vllm_config))
            info = SetupInfo(self.name, specs, self._stager.setup(self._stage_updates))
            self._stager.expect(self._llm.vllm_config.parallel_config.world_size)
            setup = self._replies(await self._rpc("weightsync_setup", (encode_setup(info),)), "setup")
            await asyncio.to_thread(self._stager.connected)
            self._routing = PartRouting(len(setup))
        except BaseException as exc:
            # An engine whose workers have no endpoint could serve but never sync: stop it.
            self._broken = self._broken or f"its weightsync setup failed: {type(exc).__name__}: {exc}"
            llm, self._llm = self._llm, None
            try:
                llm.shutdown()
            except Exception as stop:  # the setup's failure stays the error raised
                log.error(
                    "weightsync: %s: stopping the engine after a failed setup failed too", self.name, exc_info=stop
                )
            finally:
                self._stager.close()
                self._sockets.release()
            raise
        return self._llm

    async def set_pause_mode(self, mode: str) -> None:
        """How the next syncs treat in-flight requests: "keep", "wait" or "abort" (module doc)."""
        self._hold.mode = check_pause_mode(mode)

    # bounded RPC ------------------------------------------------------------------------
    async def _bounded(self, what: str, coro: Any, slow: str = "") -> Any:
        """Await ``coro`` (a call into the engine) within ``timeout_s``; a dead engine raises by
        name. A call that may rightly take long says why in ``slow``: its timeout then
        raises with that advice and leaves the engine usable."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._broken is not None:
            coro.close()
            raise EngineCallError(
                f"{self.name}: the vLLM engine is unusable ({self._broken}); start a new AsyncVLLMWorker"
            )
        try:
            return await asyncio.wait_for(coro, self.timeout_s + 5.0)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            if slow:
                raise EngineCallError(
                    f"{self.name}: {what} did not finish within timeout_s={self.timeout_s:.0f}s: {slow}"
                ) from None
            self._broken = f"{what} got no answer within {self.timeout_s:.0f}s"
        except EngineDeadError as exc:
            self._broken = died(what, exc)
        except Exception as exc:
            if not self._llm.errored:
                raise EngineCallError(f"{self.name}: {what} failed in the engine: {type(exc).__name__}: {exc}") from exc
            self._broken = died(what, exc)
        raise EngineCallError(f"{self.name}: {self._broken}")

    async def _rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        # No timeout for vLLM itself: _bounded's is the only one (see VLLMWorker._rpc for why).
        return list(await self._bounded(method, self._llm.collective_rpc(method, None, args)))

    def _replies(self, raw: list[Any], what: str) -> list[Reply]:
        replies = [decode_reply(r, f"{self.name} (TP rank {i})", what) for i, r in enumerate(raw)]
        for i, reply in enumerate(replies):
            unwrap(reply, f"{self.name} (TP rank {i})", what)
        return replies

    # the coordinator's protocol ---------------------------------------------------------------
    async def forward_weightsync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        async with self._lock:
            if self._stage_updates and method in STAGED_CALLS:
                return await self._forward_staged(method, args, kwargs)
            try:
                llm = await self._started()  # inside: an unusable engine still ends an open hold
                # After the start: how many TP ranks there are decides the routing.
                every = self._routing.every_rank(method, args)
                payload = encode_call(Call(method, args, kwargs, every_rank=every))
                if self._hold.begins(method):
                    self._hold.start(in_flight=llm.get_num_unfinished_requests())
                    await self._pause()
                try:
                    replies = self._replies(await self._rpc("weightsync_call", (payload,)), method)
                finally:
                    self._routing.forwarded(method, every)
                    self._stager.forwarded(method, kwargs)
                value, state = answer(method, replies, every, self.name)
                self._served.forwarded(method, args, value, state)
                await self._after(state)
            except BaseException:
                try:
                    await self._resume("failed", method)
                except Exception as resume_exc:  # noqa: BLE001 - logged; the call's own error is raised
                    log.warning(
                        "weightsync: %s: resuming generation after a failed %s: %s", self.name, method, resume_exc
                    )
                raise
            if self._hold.ends(method, state):
                value = with_held_off(value, await self._resume(state[1] if state else "unknown", method))
            return value

    # for users ------------------------------------------------------------------------------
    async def generate(self, prompts: Any, sampling_params: Any = None, lora_request: Any = SYNCED) -> list[Any]:
        """Every prompt's final ``RequestOutput``, in order (run concurrently); ``lora_request``: see :meth:`submit`."""
        ids = await self.submit(prompts, sampling_params, wait_first=False, lora_request=lora_request)
        return await self.collect(ids)

    async def submit(
        self, prompts: Any, sampling_params: Any = None, wait_first: bool = True, lora_request: Any = SYNCED
    ) -> list[str]:
        """Start one request per prompt and return their ids for :meth:`collect`; with
        ``wait_first``, once every request has its first output (so each is in flight);
        ``lora_request`` as :meth:`VLLMWorker.generate <weightsync.vllm.VLLMWorker.generate>`'s."""
        from vllm import SamplingParams

        llm = await self._engine()
        if self._broken is not None:
            raise EngineCallError(f"{self.name}: the vLLM engine is unusable ({self._broken})")
        params = sampling_params if sampling_params is not None else SamplingParams()
        adapter = self._served.request(lora_request)
        return await self._requests.submit(llm, prompts, params, wait_first, EngineCallError, adapter)

    async def collect(self, request_ids: Sequence[str]) -> list[Any]:
        """The final ``RequestOutput`` of each request :meth:`submit` started, in order."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return await self._requests.collect(request_ids)
        except EngineDeadError as exc:  # vLLM's says only "see stack trace (above)"
            self._broken = self._broken or died("generate", exc)
            raise EngineCallError(f"{self.name}: {self._broken}") from exc

    async def collective_rpc(
        self, fn: str | Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """As :meth:`VLLMWorker.collective_rpc`: ``fn(worker, *args, **kwargs)`` on every TP rank."""
        async with self._lock:
            llm = await self._started()
            if isinstance(fn, str):
                return list(await self._bounded(fn, llm.collective_rpc(fn, None, tuple(args), kwargs)))
            payload = encode_call(Call(fn, tuple(args), dict(kwargs or {})))
            label = getattr(fn, "__name__", "callable")
            return [r.value for r in self._replies(await self._rpc("weightsync_call", (payload,)), label)]

    async def stage_updates(self, staged: bool, stage: str | None = None, keep_stage: bool | None = None) -> None:
        """As :meth:`VLLMWorker.stage_updates <weightsync.vllm.VLLMWorker.stage_updates>`:
        stage each sync while generation goes on and pause only for the swap (True), or
        load as the bytes arrive, paused for the whole sync (False), from the next sync on."""
        async with self._lock:
            llm = await self._started()
            self._routing.refuse_staging_change(self.name, staged, self._stage_updates)
            self._stager.stage = check_place(stage) if stage is not None else self._stager.stage
            self._stager.keep_stage = keep_stage if keep_stage is not None else self._stager.keep_stage
            setup = self._stager.setup(staged)
            self._stager.expect(llm.vllm_config.parallel_config.world_size)
            try:
                self._replies(await self._rpc("weightsync_stage", (encode_setup(setup),)), "stage_updates")
                await asyncio.to_thread(self._stager.connected)
            except BaseException:
                self._stager.failed()
                raise
            self._stage_updates = staged

    async def ranks(self) -> list[RankInfo]:
        """Each TP rank: pid, device, tensors loaded so far, version and state."""
        async with self._lock:
            await self._started()
            return [r.value for r in self._replies(await self._rpc("weightsync_ranks", (False,)), "ranks")]

    async def weight_version(self) -> str:
        llm = await self._engine()
        return str(await self._bounded("get_weight_version", llm.get_weight_version()))

    async def last_hold(self) -> HoldRecord | None:
        """The last sync's pause of generation (None before the first sync)."""
        return self._hold.last

    async def shutdown(self) -> None:
        """Stop the engine's processes (the actor stays up, and unusable); a coordinator call
        in progress ends first (within ``timeout_s``)."""
        async with self._lock:
            self._broken = self._broken or "shut down"
            self._requests.cancel()
            self._stager.close()
            try:
                if self._llm is not None:
                    self._llm.shutdown()
            finally:
                self._sockets.release()

    async def pid(self) -> int:
        return os.getpid()


#: ``AsyncVLLMWorker.remote(model=..., pause_mode="keep", **AsyncEngineArgs kwargs)``; typed
#: Any as Ray's stubs do not follow ``.options(...).remote(...)``.
AsyncVLLMWorker: Any = ray.remote(_AsyncVLLMWorker)

__all__ = ["PAUSE_MODES", "AsyncVLLMWorker", "forward_worker_protocol_async"]
