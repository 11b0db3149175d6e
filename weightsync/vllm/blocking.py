"""How :class:`~weightsync.vllm.VLLMWorker` holds generation off: no ``generate`` call runs.

``LLM.generate`` blocks its caller until every request it was given is done, and the actor
runs one at a time under its lock. To hold generation off, the actor takes that lock (a
call running finishes first, on the old weights) and keeps new calls waiting on the hold.
An unstaged sync holds from its ``ws_receive`` until the receiver leaves ``receiving``
(``VLLMWorker.forward_weightsync``); a staged one only around the swap (``staging.py``)::

    staged = stager.transfer(...)           # on the ranks' staging threads; generate runs on
    swap wanted: new generate calls wait    # a running one finishes first, on the old weights
    collective_rpc("weightsync_swap")       # every rank, between two steps
    prefix cache reset, version to vLLM     # the hold ends; waiting calls run on the new weights
"""

from __future__ import annotations

import threading
from typing import Any

from weightsync import WorkerState
from weightsync.vllm.codec import Reply
from weightsync.vllm.hold import SyncHold
from weightsync.vllm.parts import PartRouting, State, combine_states
from weightsync.vllm.served import ServedAdapter
from weightsync.vllm.staging import Stager


class Blocking:
    """The holding half of the engine actor (a mixin: the actor holds the state)."""

    name: str
    llm: Any
    _lock: threading.Lock
    _idle: threading.Condition
    _hold: SyncHold
    _stager: Stager
    _routing: PartRouting
    _version: int | None
    _swap_wanted: bool
    _served: ServedAdapter

    # The actor's own (VLLMWorker's): its bounded calls and decoded replies.
    def _rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        raise NotImplementedError

    def _replies(self, raw: list[Any], what: str) -> list[Reply]:
        raise NotImplementedError

    def _forward_staged(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A staged engine's receive or commit (``staging.py``): the transfer runs on the ranks'
        staging threads while ``generate`` calls go on; generation is held off for the swap."""
        with self._lock:
            every = self._routing.every_rank(method, args)
        try:
            staged = self._stager.transfer(method, args, kwargs, every)
        finally:
            self._routing.forwarded(method, every)
        if staged.ready is None:
            self._served.forwarded(method, args, staged.value, staged.state)
            return staged.value
        self._swap_wanted = True  # generate calls not yet running wait from here on
        with self._lock:  # a generate call running finishes first, on the old weights
            self._hold.start(in_flight=0)
            self._stager.holding()
            try:
                replies = self._replies(self._rpc("weightsync_swap", args=(staged.ready,)), "swap")
                state = combine_states([r.state for r in replies])
                self._served.forwarded(method, args, staged.value, state)
                self._after(state)
            except BaseException:
                self._release("failed", method)
                raise
            swap_s = max(float(r.value) for r in replies)
            held = self._release(state[1] if state is not None else "unknown", method, swap_s)
            return self._stager.swapped(staged, replies, held)

    def _release(self, state: str, method: str, swap_s: float | None = None) -> float:
        """End an open hold (under the lock), recorded as ended by ``method``, and wake the
        waiting ``generate`` calls; ``swap_s``: a staged sync's swap."""
        self._swap_wanted = False
        if not self._hold.open:
            self._idle.notify_all()
            return 0.0
        seconds = self._hold.stop(state, method, swap_s, self._stager.window if swap_s is not None else (None, None))
        self._idle.notify_all()
        return seconds

    def _after(self, reply_state: State | None) -> None:
        """A newly committed version: drop the old prefix cache, tell vLLM the version."""
        if reply_state is None:
            return
        version, state = reply_state
        if state == WorkerState.COMMITTED.value and version is not None and version != self._version:
            self._version = version
            self.llm.reset_prefix_cache()
            self.llm.llm_engine.set_weight_version(str(version))
