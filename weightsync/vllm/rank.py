"""One vLLM worker rank as a weightsync receiver, with vLLM's reload lifecycle around loads.

A :class:`RankEndpoint` lives inside a vLLM worker process (made by the worker extension
or by the native backend). It is a :class:`~weightsync.glue.actors.WorkerMixin`, so it answers
every method of the coordinator's protocol, whatever that set is; its sink hands tensors
to the model's own ``load_weights`` (Hugging Face names in; vLLM fuses and shards).

A session whose Manifest carries a LoRA adapter (``lora=True``) loads nothing into the
model: the receiver takes the adapter into a staged sink (:meth:`RankEndpoint.weightsync_adapter_sink`),
and at the commit each rank installs it as the engine's synced adapter (``lora.py``); the
base weights and the reload lifecycle are left alone.

The reload lifecycle brackets one update: it begins lazily, on the first tensor batch a
call loads, and ends once the receiver has left ``receiving`` (committed or dirty), so a
sync split over several calls (receive, then commit) loads inside one bracket, and calls
that load nothing never touch the model. Call order for one protocol call::

    endpoint.serve(call) -> bytes     # every TP rank at once; rank 0 receives, the others
                                      # follow over the TP group (see relay.py), or, for
                                      # a call with every_rank, each rank runs it on its
                                      # own receiver (fed by parts, see parts.py)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from weightsync import TensorSpec, WeightSyncError, WorkerState
from weightsync.core.ownership import foreign
from weightsync.core.receiver import WeightReceiver
from weightsync.core.sinks import LoadWeightsSink, Sink
from weightsync.core.wire.manifest import Manifest
from weightsync.glue.actors import WORKER_PROTOCOL, WorkerMixin
from weightsync.vllm.codec import Call, encode_reply, failed_reply, run_call
from weightsync.vllm.lora import EngineAdapter
from weightsync.vllm.relay import Finish, RelayLoadError, TpRelay

#: Calls that may close this rank's transport: a staged receive still running is ended first.
QUIETS = ("ws_accept", "ws_open", "ws_settle", "ws_teardown")


class Staging(Protocol):
    """What this rank's endpoint asks of its staging side (``staged_rank.StagedRank``)."""

    @property
    def alive(self) -> bool:
        """False once its line to the engine actor is gone (the actor closed it)."""

    def form_relay(self, tp_group: Any) -> None: ...

    def quiet(self) -> None: ...

    def swap(self, version: int) -> float: ...


class _Alone:
    """The TP group of an engine of one rank (nothing to form)."""

    world_size = 1
    rank_in_group = 0


class RankEndpoint(WorkerMixin):
    """``model`` and ``begin``/``end`` are callables so the native backend can retarget
    them (vLLM's ``set_weight_update_target``) without a new endpoint. ``runner``: the
    vLLM worker's model runner, where its LoRA manager lives (None: adapters refused)."""

    def __init__(
        self,
        model: Callable[[], torch.nn.Module],
        device: torch.device,
        begin: Callable[[], None],
        end: Callable[[], None],
        expected_specs: Sequence[TensorSpec] | None,
        relay: TpRelay | None,
        name: str,
        staged: bool = False,
        runner: Callable[[], Any] | None = None,
        stage: str = "auto",
        keep_stage: bool = False,
    ) -> None:
        self._model = model
        self.device = device
        self._begin, self._end = begin, end
        self._relay = relay if relay is not None and relay.size > 1 else None
        self._reloading = False
        self.loaded = 0  # tensors loaded on this rank, all syncs
        self.relayed = 0  # tensors this rank handed on over the TP group, all syncs
        #: How the last tensors loaded here arrived: the kind of this rank's own transport,
        #: "relay" (handed on by rank 0), or "" before any.
        self.fed_by = ""
        self.mirrored_state: tuple[int | None, str] | None = None  # a follower's copy of rank 0's
        #: True while the current call runs on this rank alone (nothing is relayed).
        self.alone = False
        #: True from a parts-feeding transport's opening until a call is led by rank 0 again.
        self.fed_by_parts = False
        self.name = name
        #: Which part of the engine this rank is (read by WorkerMixin for its receiver).
        self.weightsync_part = (self.tp_rank, self._relay.size if self._relay is not None else 1)
        # Not copies_immediately: vLLM's layerwise reload keeps the tensors it is handed
        # until each layer has all its weights (a layer with padding, such as the
        # vocabulary-padded embedding, until the reload ends), so views into a receive
        # buffer that the next chunk refills would be read stale. Each tensor is cloned.
        # With ``staged``, a sync lands in a stage (on ``device`` or the host, by ``stage``)
        # and is loaded only at its swap: a failed sync never reaches the model.
        # reload_all: vLLM's layerwise reload rebuilds a layer only from all of its tensors.
        self.weightsync_sink = LoadWeightsSink(
            self._load,
            copies_immediately=False,
            expected_specs=expected_specs,
            staged=staged,
            stage=stage,
            keep_stage=keep_stage,
            device=device,
            reload_all=True,
        )
        #: The staging thread and group, once the engine actor set staging up (staged_rank.py).
        self.staging: Staging | None = None
        self.lora = EngineAdapter(runner, expected_specs, name)

    def weightsync_adapter_sink(self, manifest: Manifest, who: str) -> Sink:
        """Where a LoRA sync lands on this rank (the receiver asks at accept): a sink that keeps
        the adapter's tensors until the sync commits, then installs them (see ``lora.py``), so
        a sync that fails before its commit leaves the previous adapter serving."""
        self.lora.check(manifest, who)
        self.lora.name = who
        return LoadWeightsSink(self._load, copies_immediately=False, staged=True)

    def _adapter_session(self) -> Manifest | None:
        """The accepted Manifest when it carries a LoRA adapter (this rank's session syncs one)."""
        receiver = getattr(self, "_ws_receiver", None)
        manifest = receiver.manifest if receiver is not None else None
        return manifest if manifest is not None and manifest.adapter is not None else None

    @property
    def tp_rank(self) -> int:
        return self._relay.rank if self._relay is not None else 0

    def _wr(self) -> WeightReceiver:
        receiver = super()._wr()
        # A staged engine swaps between generation steps, not in the call that commits.
        receiver.swap_later = self.staging is not None and self.weightsync_sink.staged
        return receiver

    def _foreign(self, call: Call) -> bool:
        """A settle or teardown from a coordinator that no longer holds this engine's session
        (another took it over): it leaves the current one's staged receive alone."""
        receiver = getattr(self, "_ws_receiver", None)
        owner = str(call.kwargs.get("owner", ""))
        return call.target in ("ws_settle", "ws_teardown") and receiver is not None and foreign(receiver.owner, owner)

    def set_staging(self, make: Callable[[], Staging]) -> None:
        """This rank's staging thread (``make`` connects it to the engine actor, once), then a
        fresh staging group of the TP ranks; every rank at once, on the model's thread."""
        if self.staging is None or not self.staging.alive:
            self.staging = make()
        self.staging.form_relay(self._tp_group())

    def _tp_group(self) -> Any:
        return self._relay.group if self._relay is not None else _Alone()

    def weightsync_model(self) -> torch.nn.Module:
        return self._model()

    def weightsync_device(self) -> torch.device:
        return self.device

    # loading ----------------------------------------------------------------------------
    def _load(self, weights: Any) -> None:
        items = list(weights)
        if self._relay is not None and self.tp_rank == 0 and not self.alone:
            self._relay.send(items)
            self.relayed += len(items)
        receiver = getattr(self, "_ws_receiver", None)
        half = receiver.active_half if receiver is not None else None
        self.fed_by = half.kind if half is not None else ""
        self._load_here(items)

    def _load_here(self, items: list[tuple[str, torch.Tensor]]) -> None:
        adapter = self._adapter_session()
        if adapter is not None:
            self.lora.install(items, adapter)
            self.loaded += len(items)
            return
        if not self._reloading:
            self._begin()
            self._reloading = True
        load = getattr(self._model(), "load_weights", None)
        if not callable(load):
            raise WeightSyncError(f"{self.name}: the vLLM model {type(self._model()).__name__} has no load_weights")
        with torch.no_grad():
            load(items)
        self.loaded += len(items)

    def _load_relayed(self, items: list[tuple[str, torch.Tensor]]) -> None:
        self.fed_by = "relay"
        self._load_here(items)

    def reload_open(self) -> bool:
        return self._reloading

    def end_reload(self) -> None:
        if self._reloading:
            self._reloading = False
            self._end()

    def receiver_state(self) -> tuple[int | None, str] | None:
        """This rank's (version, state): its own receiver's, or on a follower fed by relay,
        rank 0's as last mirrored."""
        receiver = getattr(self, "_ws_receiver", None)
        follower = self.tp_rank != 0 and not self.fed_by_parts and self.mirrored_state is not None
        if receiver is None or follower:
            return self.mirrored_state
        return receiver.version, receiver.state.value

    def settles(self) -> bool:
        state = self.receiver_state()
        return state is not None and state[1] != WorkerState.RECEIVING.value

    # calls -----------------------------------------------------------------------------
    def serve(self, call: Call, worker: Any, settle: bool = True) -> bytes:
        """Run ``call`` on this rank and encode the outcome (never raises).

        A protocol method (``ws_*``) runs on this endpoint, on TP rank 0 only, mirrored
        onto the other ranks; a callable runs as ``fn(worker, *args, **kwargs)`` on every
        rank. With ``settle``, the reload bracket ends once the receiver left ``receiving``.
        """
        if isinstance(call.target, str):
            if call.target not in WORKER_PROTOCOL:
                return encode_reply(
                    failed_reply(WeightSyncError(f"{self.name}: {call.target!r} is not a weightsync protocol method"))
                )
            method = getattr(self, call.target)
            if self.staging is not None and call.target in QUIETS and not self._foreign(call):
                self.staging.quiet()  # a staged receive left running must not lose its transport
                if call.target == "ws_accept":
                    self.staging.form_relay(self._tp_group())  # a new session: a fresh group
            if call.every_rank:
                return self._alone_call(call.target, lambda: method(*call.args, **call.kwargs), settle)
            self.fed_by_parts = False
            if self.tp_rank != 0:
                return self._follow(settle)
            return self._lead(lambda: method(*call.args, **call.kwargs), settle)
        fn = call.target
        return run_call(lambda: fn(worker, *call.args, **call.kwargs), lambda: None)

    def _lead(self, body: Callable[[], Any], settle: bool) -> bytes:
        out = run_call(body, self.receiver_state)
        finishing = settle and self._reloading and self.settles()
        try:
            if self._relay is not None:
                self._relay.finish(Finish(finishing, self.receiver_state()))
            if finishing:
                self.end_reload()
        except Exception as exc:  # noqa: BLE001 - encoded for the caller, who re-raises it
            return encode_reply(failed_reply(exc, self.receiver_state()))
        return out

    def _alone_call(self, target: str, body: Callable[[], Any], settle: bool) -> bytes:
        """Run a call on this rank's own receiver, handing nothing on; the reload bracket
        ends once this rank's receiver left ``receiving``."""
        if target == "ws_open":
            self.fed_by_parts = True
        # This rank's receiver speaks for it from here; what rank 0 last relayed is stale.
        self.mirrored_state = None
        self.alone = True
        try:
            out = run_call(body, self.receiver_state)
        finally:
            self.alone = False
        if settle and self._reloading and self.settles():
            try:
                self.end_reload()
            except Exception as exc:  # noqa: BLE001 - encoded for the caller, who re-raises it
                return encode_reply(failed_reply(exc, self.receiver_state()))
        return out

    def _follow(self, settle: bool) -> bytes:
        assert self._relay is not None

        def body() -> None:
            assert self._relay is not None
            try:
                finish = self._relay.follow(self._load_relayed)
            except RelayLoadError as exc:
                # Rank 0's call has ended: close the reload as it did, but this rank does
                # not hold what rank 0 holds, so its state is not mirrored.
                if exc.finish.settle and settle:
                    self.end_reload()
                raise
            self.mirrored_state = finish.state
            if finish.state is None or finish.state[1] != WorkerState.RECEIVING.value:
                self.weightsync_sink.discard()  # rank 0 holds no staged sync: neither does this rank
            receiver = getattr(self, "_ws_receiver", None)
            if receiver is not None and finish.state is not None:
                # This rank holds what rank 0 holds: a later session that feeds it on its
                # own starts from there (the version it checks a sync against).
                receiver.version, receiver.state = finish.state[0], WorkerState(finish.state[1])
            if finish.settle and settle:
                self.end_reload()

        return run_call(body, self.receiver_state)
