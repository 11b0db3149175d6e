"""``weightsync.vllm.VLLMWorker``: a Ray actor that owns a vLLM engine and is a weightsync worker.

::

    engine = VLLMWorker.remote(model=path, dtype="bfloat16", enforce_eager=True)
    with WeightSync(trainer, {"vllm": engine}, transport="auto") as ws:   # ipc on one host
        ray.get(trainer.call.remote(train_step))
        ws.sync(version=1)
        outs = ray.get(engine.generate.remote(["Hello"], SamplingParams(max_tokens=8)))

The keyword arguments are vLLM ``LLM``'s. The actor adds ``worker_extension_cls`` (every
coordinator call is forwarded to each TP rank as bytes through
:class:`~weightsync.vllm.WorkerExtension`), or with ``native=True`` sets
``weight_transfer_config={"backend": "weightsync"}`` and forwards through vLLM's own
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``.

Around a sync, generation is blocked: ``LLM.generate`` and the coordinator's calls take
one lock, so a ``generate`` call running when a sync starts finishes first, on the old
weights, and the sync waits for it. Generation stays blocked from the start of the sync's
``ws_receive`` until the receiver leaves ``receiving`` (after ``ws_receive`` over ipc, after
``ws_commit`` over broadcast or with verify), so no ``generate`` runs on a model whose
reload is half done; the coordinator's calls run in a concurrency group of their own
(``weightsync``), so a ``generate`` that waits for a commit never keeps the commit out. That time is the sync's held-off time
(:attr:`WorkerReport.held_off_s <weightsync.core.wire.report.WorkerReport.held_off_s>`;
:meth:`last_hold`). Once a sync commits a new version, the prefix cache (built from the
old weights) is reset and the version goes to vLLM (``set_weight_version``), so vLLM's
outputs carry it. With ``lora=True`` the engine (started with ``enable_lora=True``) takes the
trainer's LoRA adapter instead of its weights, as its synced adapter, which ``generate``
uses unless told otherwise (:mod:`weightsync.vllm.served`; :meth:`adapter` reports it and its
version). For vLLM's ``AsyncLLM``, which pauses and resumes generation instead,
see :class:`~weightsync.vllm.AsyncVLLMWorker`.

With ``stage_updates=True`` (``stage=``, ``keep_stage=``; or :meth:`stage_updates`) the
engine stages each sync instead: every TP rank receives it into a stage on a thread of its
own while ``generate`` calls go on (``staging.py``), and generation is held off only for the
swap between two steps (``blocking.py``); a sync that fails before its swap never touches
the model.

Every call into the engine is bounded by ``timeout_s``: one that does not answer, or an
engine that died, raises :class:`EngineCallError` naming the worker and the call, and the
actor refuses further calls with the same cause (vLLM cannot recover a dead engine).

The coordinator sees the whole engine as one worker. TP rank 0 is the receiver; the other
TP ranks load the same tensors over vLLM's TP group (see ``relay.py``). :meth:`ranks`
lists each rank with what it loaded. The sink is ``load_weights`` (vLLM fuses and shards
on load), so ``auto`` picks ``ipc`` on the trainer's host and ``broadcast`` elsewhere;
``direct`` is refused by the coordinator, by name.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import ray

from weightsync import TensorSpec, WeightSyncError
from weightsync.core.stage import check_place
from weightsync.core.wire.settings import DEFAULT_ENGINE_TIMEOUT_S
from weightsync.glue.actors import WORKER_PROTOCOL, forward_worker_protocol
from weightsync.vllm.blocking import Blocking
from weightsync.vllm.checkpoint import engine_specs
from weightsync.vllm.codec import Call, Reply, decode_reply, encode_call, unwrap
from weightsync.vllm.deaths import died
from weightsync.vllm.extension import RankInfo, SetupInfo, encode_setup
from weightsync.vllm.hold import HoldRecord, SyncHold, with_held_off
from weightsync.vllm.parts import PartRouting, answer
from weightsync.vllm.plugin import BACKEND
from weightsync.vllm.served import SYNCED, AdapterInfo, ServedAdapter
from weightsync.vllm.sockets import SocketFolder
from weightsync.vllm.staging import STAGED_CALLS, Stager

EXTENSION = "weightsync.vllm.WorkerExtension"


class EngineCallError(WeightSyncError):
    """A call into the vLLM engine got no answer in time, or the engine died."""


@forward_worker_protocol
class _VLLMWorker(Blocking):
    def __init__(
        self,
        *,
        name: str = "vllm",
        timeout_s: float = DEFAULT_ENGINE_TIMEOUT_S,
        native: bool = False,
        expected_specs: Sequence[TensorSpec] | None = None,
        check_model: bool = True,
        env: dict[str, str] | None = None,
        stage_updates: bool = False,
        stage: str = "auto",
        keep_stage: bool = False,
        **llm_kwargs: Any,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if not isinstance(stage_updates, bool):
            raise ValueError(f"stage_updates must be True or False, got {stage_updates!r}")
        if native and stage_updates:
            raise ValueError("stage_updates=True works through the worker extension; drop native=True")
        os.environ.update(env or {})  # before vLLM reads its settings
        extension = llm_kwargs.setdefault("worker_extension_cls", EXTENSION)
        if extension != EXTENSION:
            raise ValueError(f"VLLMWorker sets worker_extension_cls={EXTENSION!r} itself; got {extension!r}")
        # The native backend is configured unless the caller brought another one, so
        # either path can carry a session (see use_native).
        self._has_backend = "weight_transfer_config" not in llm_kwargs
        if self._has_backend:
            llm_kwargs["weight_transfer_config"] = {"backend": BACKEND}
        elif native:
            raise ValueError("native=True needs VLLMWorker to configure weight_transfer_config itself; drop yours")
        self.name = name
        self.timeout_s = float(timeout_s)
        self.native = native
        self._broken: str | None = None
        self._lock = threading.Lock()
        # generate waits on it while a sync holds generation off (between receive and commit)
        self._idle = threading.Condition(self._lock)
        self._hold = SyncHold("block")
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weightsync-vllm-rpc")
        self._version: int | None = None
        self._rank_pids: list[int] = []
        self._staged = stage_updates
        self._stager = Stager(name, self.timeout_s, check_place(stage), keep_stage)
        self._swap_wanted = False  # a staged sync waits for the running generate to end
        self._routing = PartRouting(1)
        self._served = ServedAdapter(name)
        self._sockets = SocketFolder.claim()  # vLLM reads it as the engine starts
        try:
            self._start(llm_kwargs, expected_specs, check_model)
        except BaseException:
            self._stop()  # else the engine's processes and socket folder outlive the failed actor
            raise

    def _start(
        self, llm_kwargs: dict[str, Any], expected_specs: Sequence[TensorSpec] | None, check_model: bool
    ) -> None:
        """Start the engine, then set weightsync up in each of its ranks (and, staging, its
        line and staging group; then the native backend), with the specs a manifest is
        checked against (see the actor's arguments)."""
        from vllm import LLM

        try:
            self.llm = LLM(**llm_kwargs)
        except Exception as exc:  # vLLM's says only "see root cause above", which is in our log
            raise EngineCallError(f"{self.name}: the vLLM engine did not start: {died('start', exc)}") from exc
        config = self.llm.llm_engine.vllm_config
        if expected_specs is None and check_model:
            expected_specs = engine_specs(self.name, config)
        specs = tuple(expected_specs) if expected_specs is not None else None
        info = SetupInfo(self.name, specs, self._stager.setup(self._staged))
        self._stager.expect(config.parallel_config.world_size)
        self._replies(self._rpc("weightsync_setup", args=(encode_setup(info),)), "setup")
        self._stager.connected()
        if self._has_backend:
            rows = None if specs is None else [[s.name, list(s.shape), s.dtype] for s in specs]
            init_info = {"name": self.name, "expected_specs": rows}
            self._check(self._rpc("init_weight_transfer_engine", kwargs={"init_info": init_info}))
        self._rank_pids = [r.pid for r in self.ranks()]
        self._routing = PartRouting(1 if self.native else len(self._rank_pids))

    def use_native(self, native: bool) -> None:
        """Send the coordinator's calls through the native backend (True) or the worker
        extension (False). Each path has its own receiver: switch between WeightSync
        sessions, then run setup again (a new WeightSync does)."""
        if native and not self._has_backend:
            raise WeightSyncError(f"{self.name}: started with another weight_transfer_config; the native path is off")
        if native and self._staged:
            raise WeightSyncError(
                f"{self.name}: stages its updates (stage_updates), which the native path does not; "
                "call stage_updates(False) first"
            )
        with self._lock:
            self.native = bool(native)
            self._routing = PartRouting(1 if self.native else len(self._rank_pids))

    # bounded RPC ------------------------------------------------------------------------
    def _rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``llm.collective_rpc`` bounded by ``timeout_s``; a dead engine raises by name.

        The bound is this actor's alone: vLLM is given no timeout of its own. Its timeout
        would end the wait with a plain error while the TP ranks still run the call, and
        their late replies, which carry no call id, would answer the next call. A call
        past this bound instead leaves the engine unusable (``start a new VLLMWorker``)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._broken is not None:
            raise EngineCallError(f"{self.name}: the vLLM engine is unusable ({self._broken}); start a new VLLMWorker")
        future: concurrent.futures.Future[Any] = self._pool.submit(self.llm.collective_rpc, method, None, args, kwargs)
        try:
            return list(future.result(timeout=self.timeout_s + 5.0))
        except concurrent.futures.TimeoutError:
            self._broken = f"{method} got no answer within {self.timeout_s:.0f}s"
        except EngineDeadError as exc:
            self._broken = died(method, exc)
        except Exception as exc:
            # A call pending when the engine died fails with a plain error ("cancelled");
            # the engine's own flag says whether that is what happened.
            if not self._engine_dead():
                raise EngineCallError(
                    f"{self.name}: {method} failed in the engine: {type(exc).__name__}: {exc}"
                ) from exc
            self._broken = died(method, exc)
        raise EngineCallError(f"{self.name}: {self._broken}")

    def _engine_dead(self) -> bool:
        """The engine client's own flag, or a vLLM worker process that is gone (the engine
        core answers the pending call before it notices and dies itself)."""
        import psutil

        resources = getattr(getattr(self.llm.llm_engine, "engine_core", None), "resources", None)
        if getattr(resources, "engine_dead", False):
            return True
        for pid in self._rank_pids:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
        return False

    def _check(self, results: list[Any]) -> None:
        if any(r is not None for r in results):
            raise WeightSyncError(f"{self.name}: unexpected answers from the vLLM workers: {results!r}")

    def _replies(self, raw: list[Any], what: str) -> list[Reply]:
        replies = [decode_reply(r, self._rank_name(i), what) for i, r in enumerate(raw)]
        for i, reply in enumerate(replies):
            unwrap(reply, self._rank_name(i), what)
        return replies

    def _rank_name(self, rank: int) -> str:
        return f"{self.name} (TP rank {rank})"

    # the coordinator's protocol ---------------------------------------------------------------
    def forward_weightsync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._staged and not self.native and method in STAGED_CALLS:
            return self._forward_staged(method, args, kwargs)
        with self._lock:
            every = self._routing.every_rank(method, args)
            payload = encode_call(Call(method, args, kwargs, every_rank=every))
            if self._hold.begins(method):
                # No generate runs from here (the lock, then the hold) until the hold ends.
                self._hold.start(in_flight=0)
            target = "weightsync_native_call" if self.native else "weightsync_call"
            try:
                try:
                    replies = self._replies(self._rpc(target, args=(payload,)), method)
                finally:
                    self._routing.forwarded(method, every)
                    self._stager.forwarded(method, kwargs)
                value, state = answer(method, replies, every, self.name)
                self._served.forwarded(method, args, value, state)
                self._after(state)
            except BaseException:
                self._release("failed", method)
                raise
            if self._hold.ends(method, state):
                value = with_held_off(value, self._release(state[1] if state is not None else "unknown", method))
            return value

    # for users ------------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: Any = None, lora_request: Any = SYNCED) -> Any:
        """vLLM's ``LLM.generate``; never runs during a sync (it waits for the sync's commit,
        up to ``timeout_s``). ``lora_request``: ``"synced"`` (the default) uses the adapter
        synced with ``lora=True``, if any; None the base model; a ``LoRARequest`` that one."""
        with self._lock:
            if not self._idle.wait_for(lambda: not self._hold.open and not self._swap_wanted, timeout=self.timeout_s):
                raise EngineCallError(
                    f"{self.name}: a sync has held generation off for over timeout_s={self.timeout_s:.0f}s "
                    "(it received weights and was never committed, settled or torn down); close the WeightSync "
                    "that drives this engine, or raise timeout_s"
                )
            if self._broken is not None:
                raise EngineCallError(f"{self.name}: the vLLM engine is unusable ({self._broken})")
            from vllm.v1.engine.exceptions import EngineDeadError

            request = self._served.request(lora_request)
            try:
                outputs = self.llm.generate(prompts, sampling_params, use_tqdm=False, lora_request=request)
            except EngineDeadError as exc:  # vLLM's says only "see stack trace (above)"
                self._broken = died("generate", exc)
                raise EngineCallError(f"{self.name}: {self._broken}") from exc
            self._stager.count(sum(len(c.token_ids) for o in outputs for c in o.outputs))
            return outputs

    def collective_rpc(
        self, fn: str | Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """Run ``fn(worker, *args, **kwargs)`` on every TP rank (a callable is pickled by
        weightsync, no insecure serialization needed); returns one value per rank. A
        string names a worker method, called through vLLM's RPC as usual."""
        with self._lock:
            if isinstance(fn, str):
                return self._rpc(fn, tuple(args), kwargs)
            payload = encode_call(Call(fn, tuple(args), dict(kwargs or {})))
            label = getattr(fn, "__name__", "callable")
            return [r.value for r in self._replies(self._rpc("weightsync_call", args=(payload,)), label)]

    def stage_updates(self, staged: bool, stage: str | None = None, keep_stage: bool | None = None) -> None:
        """Stage each sync (True): every TP rank receives it into a stage while the engine
        keeps generating from its version, and generation is held off only for the swap
        between two steps; a sync that fails before its swap never reaches the model. Costs
        a second copy of the model's bytes per rank during a sync (``stage``: "auto",
        "device" or "host"; ``keep_stage`` keeps it between syncs). False: load as the
        bytes arrive, generation held off for the whole sync (the default). Takes effect
        from the next sync; extension mode only; refused while a WeightSync feeds the
        engine part by part (``rank-ipc``), which read the engine's staging at setup."""
        with self._lock:
            if self.native:
                raise WeightSyncError(
                    f"{self.name}: stage_updates works through the worker extension, and this engine syncs through "
                    "vLLM's native backend; call use_native(False) first"
                )
            self._routing.refuse_staging_change(self.name, staged, self._staged)
            self._stager.stage = check_place(stage) if stage is not None else self._stager.stage
            self._stager.keep_stage = keep_stage if keep_stage is not None else self._stager.keep_stage
            setup = self._stager.setup(staged)
            self._stager.expect(len(self._rank_pids))
            try:
                self._replies(self._rpc("weightsync_stage", args=(encode_setup(setup),)), "stage_updates")
                self._stager.connected()
            except BaseException:
                self._stager.failed()
                raise
            self._staged = staged

    def ranks(self) -> list[RankInfo]:
        """Each TP rank: pid, device, tensors loaded so far, version and state."""
        with self._lock:
            return [r.value for r in self._replies(self._rpc("weightsync_ranks", args=(self.native,)), "ranks")]

    def last_hold(self) -> HoldRecord | None:
        """The last sync's hold of generation (None before the first sync)."""
        with self._lock:
            return self._hold.last

    def adapter(self) -> AdapterInfo | None:
        """The synced LoRA adapter ``generate`` uses by default, with its version (None
        before the first committed LoRA sync)."""
        with self._lock:
            return self._served.info

    def weight_version(self) -> str:
        """The version vLLM holds. Under the lock: vLLM's engine client is not thread-safe, and
        a ``generate`` call may run on another thread (it finishes first)."""
        with self._lock:
            return str(self.llm.llm_engine.engine_core.get_weight_version())

    def shutdown(self) -> None:
        """Stop the engine's processes (the actor stays up, and unusable)."""
        self._broken = self._broken or "shut down"
        self._stop()

    def _stop(self) -> None:
        """Stop the engine's processes, if it started, then remove its socket folder."""
        self._stager.close()
        try:
            llm = getattr(self, "llm", None)
            engine_core = None if llm is None else getattr(llm.llm_engine, "engine_core", None)
            if engine_core is not None:
                engine_core.shutdown()
        finally:
            self._sockets.release()

    def pid(self) -> int:
        return os.getpid()


#: ``VLLMWorker.remote(model=..., **LLM kwargs)``; typed Any as Ray's stubs do not follow
#: ``.options(...).remote(...)``.
# The coordinator's calls get a thread of their own: a generate waiting for a commit (or an
# inspection call) holds a thread of the default group, never the commit's.
for _method in WORKER_PROTOCOL:
    setattr(_VLLMWorker, _method, ray.method(concurrency_group="weightsync")(getattr(_VLLMWorker, _method)))
VLLMWorker: Any = ray.remote(concurrency_groups={"weightsync": 1}, max_concurrency=2)(_VLLMWorker)  # type: ignore[call-overload]

__all__ = ["EXTENSION", "EngineCallError", "VLLMWorker"]
