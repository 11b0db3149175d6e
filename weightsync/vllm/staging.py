"""An engine actor's staged syncs: the transfer while vLLM generates, the swap between steps.

With ``stage_updates=True`` an engine keeps serving version N while N+1 arrives: the
coordinator's ``ws_receive`` and ``ws_commit`` go to the ranks' staging threads over the
actor's lines (``lines.py``, ``staged_rank.py``), never through ``collective_rpc``, so vLLM
keeps stepping and the actor keeps taking ``generate`` calls. Once every rank staged the
sync and its receivers checked it (it is *ready*), the actor holds generation off for the
swap alone. Both engine actors share this; only how they hold generation differs. Call
order in an actor, for a coordinator call in :data:`STAGED_CALLS`::

    staged = stager.transfer(method, args, kwargs, every)  # lines; generation goes on
    if staged.ready is None: return staged.value           # failed, or waits for ws_commit
    <hold generation off: VLLMWorker blocks new generate calls and waits for a running one;
     AsyncVLLMWorker pauses vLLM with pause_mode>
    replies = <collective_rpc("weightsync_swap", (staged.ready,))>   # between two steps
    <prefix cache reset, the version to vLLM, generation resumed>
    return stager.swapped(staged, replies, held_s)

A failed staged call makes every rank drop what it staged (the coordinator settles the
engine too), so the model stays what it was. A ``ws_receive`` while a staged sync waits
for its commit is refused by name (:class:`~weightsync.SyncInFlight`): two syncs never mix.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightsync.core.ownership import foreign
from weightsync.core.wire.errors import SyncInFlight, WeightSyncError
from weightsync.core.wire.messages import ReceiveResult
from weightsync.core.wire.outcome import Outcome
from weightsync.core.wire.report import StageReport
from weightsync.vllm.codec import Call, Reply, decode_reply, encode_call, unwrap
from weightsync.vllm.extension import StageSetup
from weightsync.vllm.lines import EngineLines
from weightsync.vllm.parts import State, answer, combine_states
from weightsync.vllm.staged_rank import STAGED_CALLS

log = logging.getLogger("weightsync")
#: Coordinator calls after which no staged sync waits for its commit any more.
ENDS_A_SYNC = ("ws_accept", "ws_open", "ws_settle", "ws_teardown")

__all__ = ["STAGED_CALLS", "Staged", "Stager"]


@dataclass(frozen=True)
class Staged:
    """A staged call's result before any swap."""

    #: The engine's answer as its ranks gave it (an Outcome), and its (version, state).
    value: Any
    state: State | None
    #: The version every rank staged and checked, to swap now (None: nothing to swap yet).
    ready: int | None
    #: Each rank's stage, in rank order (None where a rank reported none).
    stages: tuple[StageReport | None, ...]
    #: Seconds the call ran on the staging threads.
    seconds: float


class Stager:
    """One engine actor's staging: its lines to the ranks and what it staged (not thread-safe:
    the actor calls it for one coordinator call at a time)."""

    def __init__(self, name: str, timeout_s: float, stage: str = "auto", keep_stage: bool = False) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.stage = stage
        self.keep_stage = keep_stage
        self.lines: EngineLines | None = None
        #: A staged sync's version, received and waiting for its commit (None: none).
        self.waiting: int | None = None
        #: The coordinator whose setup this engine took last (``ws_accept``'s ``owner``).
        self.owner = ""
        #: Tokens the engine generated so far (the actor counts them: :meth:`count`).
        self.tokens = 0
        self._started: tuple[float, int] | None = None  # the transfer's start, and tokens then
        #: The last transfer: its seconds until generation was held off for the swap, and
        #: the tokens generated meanwhile (set by :meth:`holding`).
        self.window: tuple[float | None, int | None] = (None, None)

    def count(self, tokens: int) -> None:
        """Tokens generated (the actor's generate paths call it)."""
        self.tokens += tokens

    def holding(self) -> None:
        """Generation is held off for the swap now: the transfer's window closes."""
        if self._started is not None:
            start, tokens = self._started
            self.window = (time.perf_counter() - start, self.tokens - tokens)
            self._started = None

    def setup(self, staged: bool) -> StageSetup:
        """What every rank is told (``weightsync_setup`` / ``weightsync_stage``); when staging,
        the lines are listened on (once), and :meth:`connected` waits for the ranks."""
        if staged and self.lines is None:
            self.lines = EngineLines.listen(self.name)
        line = self.lines.info if staged and self.lines is not None else None
        return StageSetup(
            staged=staged, stage=self.stage, keep_stage=self.keep_stage, line=line, timeout_s=self.timeout_s
        )

    def expect(self, ranks: int) -> None:
        """Before the RPC that connects the ranks: start taking their lines."""
        if self.lines is not None and self.lines.ranks == 0:
            self.lines.accept(ranks)

    def connected(self) -> None:
        """After that RPC: every rank's line is up (raises naming what is missing)."""
        if self.lines is not None and self.lines.ranks == 0:
            self.lines.accepted(self.timeout_s)

    def failed(self) -> None:
        """The RPC that set staging up failed: stop listening, so that the next attempt
        starts afresh (the ranks make new lines when theirs are gone)."""
        self.close()

    def forwarded(self, method: str, kwargs: Mapping[str, Any]) -> None:
        """A coordinator call that went to the ranks the usual way: one that settles, tears
        down or sets up again ends a staged sync still waiting for its commit (the ranks
        drop its stage themselves in that call), unless it came from a coordinator another
        one took this engine over from (``owner``: :mod:`weightsync.core.ownership`)."""
        owner = str(kwargs.get("owner", ""))
        if method == "ws_accept":
            self.owner = owner
        elif foreign(self.owner, owner):
            return
        if method in ENDS_A_SYNC:
            self.waiting, self._started = None, None

    # one staged call ----------------------------------------------------------------------
    def transfer(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], every: bool) -> Staged:
        """Run ``method`` on every rank's staging thread (blocking; generation goes on)."""
        assert self.lines is not None, "staging is set up before any staged call"
        call = args[0] if args else None
        if method == "ws_receive" and self.waiting is not None:
            version = getattr(call, "version", "?")
            raise SyncInFlight(
                f"{self.name}: version {version}'s receive refused: the sync of version {self.waiting} is staged "
                "and waits for its commit; one sync at a time per engine: wait for it to commit or fail"
            )
        start = time.perf_counter()
        if method == "ws_receive":
            self._started, self.window = (start, self.tokens), (None, None)
        payload = encode_call(Call(method, args, kwargs, every_rank=every))
        try:
            raw = self.lines.run("call", payload, 2 * self.timeout_s + 10.0)
            replies = [decode_reply(r, self._rank(k), method) for k, r in enumerate(raw)]
            for k, reply in enumerate(replies):
                unwrap(reply, self._rank(k), method)
            value, state = answer(method, replies, every, self.name)
        except BaseException:
            self.discard()
            raise
        seconds = time.perf_counter() - start
        stages = tuple(r.stage for r in replies)
        if not (isinstance(value, Outcome) and value.ok):
            self.discard()
            return Staged(value, state, None, stages, seconds)
        ready = _ready(replies, every)
        marked = [r.ready for r in (replies if every else replies[:1]) if r.ready is not None]
        if ready is None and marked:  # a receiver committed, yet not every rank holds that sync
            self.discard()
            lacking = [k for k, r in enumerate(replies) if not r.staged or (every and r.ready is None)]
            raise WeightSyncError(
                f"{self.name}: version {marked[0]} is ready on some TP ranks but TP rank(s) {lacking} hold no stage "
                "of it; no rank swaps, the engine keeps its version"
            )
        self.waiting = getattr(call, "version", None) if ready is None and method == "ws_receive" else None
        return Staged(value, state, ready, stages, seconds)

    def swapped(self, staged: Staged, replies: Sequence[Reply], held_s: float) -> Any:
        """The engine's answer once the swap ran: its ReceiveResult with the engine's state
        after the swap, the held-off time, and every rank's stage with the slowest swap."""
        self.waiting = None
        state = combine_states([r.state for r in replies])
        swap_s = max(float(r.value) for r in replies)
        stage = merge_stages(staged.stages, swap_s, *self.window)
        value = staged.value
        result = value.value
        if isinstance(result, ReceiveResult) and state is not None:
            result = dataclasses.replace(result, version=state[0], state=state[1], held_off_s=held_s, stage=stage)
            value = dataclasses.replace(value, value=result)
        return value

    def discard(self) -> None:
        """Every rank drops what it staged (after a failure); problems are logged: the
        coordinator settles the engine next anyway."""
        self.waiting, self._started = None, None
        if self.lines is None or not self.lines.ranks:
            return
        try:
            for k, raw in enumerate(self.lines.run("discard", b"", self.timeout_s + 5.0)):
                unwrap(decode_reply(raw, self._rank(k), "discard"), self._rank(k), "discard")
        except Exception as exc:  # noqa: BLE001 - logged; the call's own failure is what is raised
            log.warning("weightsync: %s: dropping a failed sync's stage: %s", self.name, exc)

    def close(self) -> None:
        if self.lines is not None:
            self.lines.close()
            self.lines = None

    def _rank(self, k: int) -> str:
        return f"{self.name} (TP rank {k})"


def _ready(replies: Sequence[Reply], every: bool) -> int | None:
    """The version to swap: relayed, rank 0's receiver marked it ready and every rank holds
    its stage; fed part by part, every part marked the same version ready."""
    if not all(r.staged for r in replies):
        return None
    if every:
        versions = {r.ready for r in replies}
        return versions.pop() if len(versions) == 1 else None
    return replies[0].ready


def merge_stages(
    stages: Sequence[StageReport | None], swap_s: float, transfer_s: float | None, tokens: int | None
) -> StageReport | None:
    """One report for the engine: each rank's stage, in rank order, and the slowest swap."""
    known = [s for s in stages if s is not None]
    if not known:
        return None
    return StageReport(
        where=tuple(w for s in known for w in s.where),
        part_bytes=tuple(b for s in known for b in s.part_bytes),
        kept=all(s.kept for s in known),
        swap_s=swap_s,
        transfer_s=transfer_s,
        generated_tokens=tokens,
    )
