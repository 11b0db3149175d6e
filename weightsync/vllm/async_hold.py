"""How :class:`~weightsync.vllm.AsyncVLLMWorker` holds generation off: pause, load or swap, resume.

An ``AsyncLLM`` keeps streaming while the actor's coroutines run, so generation stops only
when the actor pauses vLLM (``pause_generation(mode=pause_mode)``) and goes on at
``resume_generation()``. An unstaged sync pauses from its ``ws_receive`` until the receiver
leaves ``receiving`` (``AsyncVLLMWorker.forward_weightsync``); a staged one only around the
swap (``staging.py``)::

    staged = stager.transfer(...)           # on the ranks' staging threads; requests stream on
    pause (pause_mode)                      # "keep" / "abort": the swap goes as soon as vLLM
                                            # stopped scheduling; "wait": once drained
    collective_rpc("weightsync_swap")       # every rank, between two steps
    update_weight_version, resume           # the hold ends
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from weightsync import WorkerState
from weightsync.vllm.codec import Reply
from weightsync.vllm.hold import SyncHold
from weightsync.vllm.parts import PartRouting, State, combine_states
from weightsync.vllm.served import ServedAdapter
from weightsync.vllm.staging import Stager

log = logging.getLogger("weightsync")


class AsyncHolding:
    """The holding half of the async engine actor (a mixin: the actor holds the state)."""

    name: str
    _llm: Any
    _hold: SyncHold
    _stager: Stager
    _routing: PartRouting
    _version: int | None
    _served: ServedAdapter

    # The actor's own (AsyncVLLMWorker's): its engine, bounded calls and decoded replies.
    async def _started(self) -> Any:
        raise NotImplementedError

    async def _bounded(self, what: str, coro: Any, slow: str = "") -> Any:
        raise NotImplementedError

    async def _rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        raise NotImplementedError

    def _replies(self, raw: list[Any], what: str) -> list[Reply]:
        raise NotImplementedError

    async def _forward_staged(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A staged engine's receive or commit (``staging.py``; the caller holds the lock): the
        transfer runs on the ranks' staging threads while requests stream on; generation is
        paused (``pause_mode``) for the swap alone."""
        llm = await self._started()
        every = self._routing.every_rank(method, args)
        try:
            staged = await asyncio.to_thread(self._stager.transfer, method, args, kwargs, every)
        finally:
            self._routing.forwarded(method, every)
        if staged.ready is None:
            self._served.forwarded(method, args, staged.value, staged.state)
            return staged.value
        self._hold.start(in_flight=llm.get_num_unfinished_requests())
        self._stager.holding()
        pause = asyncio.ensure_future(self._pause())
        try:
            await self._paused(pause)
            replies = self._replies(await self._rpc("weightsync_swap", (staged.ready,)), "swap")
            await pause
            state = combine_states([r.state for r in replies])
            self._served.forwarded(method, args, staged.value, state)
            await self._after(state)
        except BaseException:
            pause.cancel()
            try:
                await self._resume("failed", method)
            except Exception as resume_exc:  # noqa: BLE001 - logged; the call's own error is raised
                log.warning("weightsync: %s: resuming generation after a failed swap: %s", self.name, resume_exc)
            raise
        swap_s = max(float(r.value) for r in replies)
        held = await self._resume(state[1] if state is not None else "unknown", method, swap_s)
        return self._stager.swapped(staged, replies, held)

    async def _paused(self, pause: asyncio.Future[None]) -> None:
        """Return once the engine stopped scheduling for ``pause``. "wait" drains the requests
        in flight first: the whole pause. "keep" and "abort" stop at once, and vLLM then only
        waits for its outputs (and, with "keep", clears its caches before it answers): the
        swap goes ahead as soon as the engine says it is paused, its utility calls run in
        order, so the swap runs after the pause and before the resume, between two steps."""
        if self._hold.mode == "wait":
            await pause
            return
        while not pause.done():
            if await self._bounded("is_paused", self._llm.is_paused()):
                return
        await pause  # raises the pause's failure, if it failed

    async def _pause(self) -> None:
        pause = self._llm.pause_generation(mode=self._hold.mode, clear_cache=True)
        slow = "pause_mode='wait' waits for every request in flight; use 'keep' or raise timeout_s"
        await self._bounded(f"pause_generation(mode={self._hold.mode!r})", pause, slow)
        self._hold.paused()

    async def _after(self, reply_state: State | None) -> None:
        """A newly committed version goes to vLLM before generation resumes (every call
        reports the receiver's state: only a commit that changed the version counts)."""
        if reply_state is None:
            return
        version, state = reply_state
        if state == WorkerState.COMMITTED.value and version is not None and version != self._version:
            await self._bounded("update_weight_version", self._llm.update_weight_version(str(version)))
            self._version = version

    async def _resume(self, state: str, method: str, swap_s: float | None = None) -> float:
        """Resume generation if a hold is open, recorded as ended by ``method`` (``swap_s``: a
        staged sync's swap); returns its seconds (pause to resume)."""
        if not self._hold.open:
            return 0.0
        try:
            await self._bounded("resume_generation", self._llm.resume_generation())
        finally:
            window = self._stager.window if swap_s is not None else (None, None)
            seconds = self._hold.stop(state, method, swap_s, window)
        return seconds
