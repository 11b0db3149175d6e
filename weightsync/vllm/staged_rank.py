"""A TP rank's side of a staged sync: the receive on a thread of its own, the swap between steps.

An engine that stages (``stage_updates=True``) keeps serving its version while the next one
arrives. Inside each vLLM worker process the receive runs on the rank's staging thread (its
end of the engine actor's line, ``lines.py``), never on the thread that runs the model, so
vLLM goes on generating; the bytes land in the rank's stage (``weightsync.core.stage``),
never in the model. Only the swap runs on the model's thread, between two generation steps,
through ``collective_rpc``: every rank loads its stage through the model's ``load_weights``
inside vLLM's layerwise reload and ends the reload. Per staged sync, on every rank::

    staging thread:  serve("call", ws_receive)   rank 0 (or, fed part by part, each rank)
                                                 receives into its stage; relayed, rank 0's
                                                 stage then goes to the others (stage_relay.py)
                     serve("call", ws_commit)    when the transport commits in a second call
                                                 (broadcast, verify, rank-ipc): the checks
    model thread:    swap(version)               the loads and the end of the reload, then the
                                                 ranks agree: every rank swapped, or the engine
                                                 is dirty at its old version
    after a failure: serve("discard")            every rank drops what it staged

Nothing is swapped unless every rank staged the sync and its receiver(s) marked it ready
(the engine actor checks the replies before it asks for the swap), so a sync that fails
before its swap leaves every rank's model as it was.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from weightsync import WeightSyncError, WorkerState
from weightsync.core.sinks import LoadWeightsSink
from weightsync.core.wire.outcome import Outcome, failed
from weightsync.vllm.codec import Call, Reply, decode_call, encode_reply, failed_reply
from weightsync.vllm.lines import LineInfo, RankLine
from weightsync.vllm.stage_relay import StageRelay

if TYPE_CHECKING:
    from weightsync.vllm.rank import RankEndpoint

log = logging.getLogger("weightsync")

#: The protocol calls a staged engine runs on its ranks' staging threads.
STAGED_CALLS = ("ws_receive", "ws_commit")


class StagedRank:
    """The staging side of one rank's :class:`~weightsync.vllm.rank.RankEndpoint`."""

    def __init__(self, endpoint: RankEndpoint, line: LineInfo, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.relay: StageRelay | None = None
        self.line = RankLine(line, endpoint.tp_rank, self.serve, endpoint.name)

    @property
    def alive(self) -> bool:
        """Whether the line to the engine actor still serves jobs."""
        return self.line.alive

    # set-up (the model's thread, every rank at once) -----------------------------------
    def form_relay(self, tp_group: Any) -> None:
        """(Re)form the staging group of the TP ranks (after any failure it may be broken)."""
        if self.relay is not None:
            self.relay.comm.abort()
            self.relay = None
        if int(tp_group.world_size) > 1:
            self.relay = StageRelay.form(tp_group, self.timeout_s)

    # the staging thread -----------------------------------------------------------------
    def serve(self, kind: str, payload: bytes) -> bytes:
        """One job from the engine actor (never raises: failures go back in the reply)."""
        try:
            if kind == "call":
                return self._call(decode_call(payload))
            if kind == "discard":
                self.discard()
                return self._reply(None)
            raise WeightSyncError(f"{self.endpoint.name}: unknown staging job {kind!r}")
        except Exception as exc:  # noqa: BLE001 - encoded for the actor, who re-raises it
            return encode_reply(failed_reply(exc, self.endpoint.receiver_state()))

    def _call(self, call: Call) -> bytes:
        ep = self.endpoint
        if call.target not in STAGED_CALLS:
            raise WeightSyncError(f"{ep.name}: {call.target!r} does not run on the staging thread")
        if call.every_rank or ep.tp_rank == 0:
            outcome: Outcome = getattr(ep, str(call.target))(*call.args, **call.kwargs)
            if not call.every_rank and self.relay is not None and call.target == "ws_receive":
                outcome = self._share(outcome)
            return self._reply(outcome)
        if call.target == "ws_receive":
            self._follow()
        return self._reply(None)

    def _share(self, outcome: Outcome) -> Outcome:
        """Rank 0: its stage to the other ranks (or word that it has none)."""
        assert self.relay is not None
        ep = self.endpoint
        staging = _sink(ep).staging
        stage = staging.stage if outcome.ok and staging.pending else None
        try:
            self.relay.share(stage.buffer if stage is not None else None)
        except Exception as exc:  # noqa: BLE001 - the sync fails; this rank drops its stage
            ep._wr().settle()
            return failed(ep.name, outcome.phase, exc)
        if stage is not None:
            ep.relayed += len(stage.views)
        return outcome

    def _follow(self) -> None:
        """Rank k: rank 0's stage into this rank's own (opened on this rank's device)."""
        assert self.relay is not None, "a follower stages through the relay"
        ep = self.endpoint
        sink = _sink(ep)
        manifest = ep._wr().manifest
        buffer = problem = None
        try:
            if manifest is None:
                raise WeightSyncError(f"{ep.name} (TP rank {ep.tp_rank}): no manifest accepted; run setup()")
            sink.destinations(manifest)
            stage = sink.staging.stage
            assert stage is not None
            buffer = stage.buffer
        except Exception as exc:  # noqa: BLE001 - every rank is told (a refusal), then raised
            problem = exc
        try:
            took = self.relay.follow(buffer)
        except BaseException:
            if buffer is not None:  # only what this job opened: never a stage still pending
                sink.discard()
            raise
        if took:
            sink.seal()
        elif buffer is not None:
            sink.discard()
        if problem is not None:
            raise problem

    def _reply(self, value: Any) -> bytes:
        ep = self.endpoint
        receiver = ep._wr()
        staging = _sink(ep).staging
        return encode_reply(
            Reply(
                ok=True,
                value=value,
                state=ep.receiver_state(),
                staged=staging.pending,
                ready=receiver.ready,
                stage=staging.report(),
            )
        )

    def discard(self) -> None:
        """Drop what this rank staged: a receiver still receiving goes back to its version."""
        receiver = self.endpoint._wr()
        if receiver.state is WorkerState.RECEIVING:
            receiver.settle()
        _sink(self.endpoint).discard()

    # the model's thread -----------------------------------------------------------------
    def swap(self, version: int) -> float:
        """Load this rank's stage into the model inside vLLM's reload and end the reload;
        then every rank learns whether all swapped (the engine is dirty at its old version
        if any did not). Returns the seconds of the load and the end of the reload."""
        ep = self.endpoint
        receiver = ep._wr()
        before = receiver.version
        start = time.perf_counter()
        failure: BaseException | None = None
        ep.alone = True  # each rank loads its own stage: nothing is handed on
        try:
            if receiver.ready is not None:
                receiver.swap()
            else:  # a follower: its stage came from rank 0
                _sink(ep).land()
                ep.fed_by = "relay"
                receiver.version, receiver.state = version, WorkerState.COMMITTED
                ep.mirrored_state = (version, WorkerState.COMMITTED.value)
        except BaseException as exc:  # noqa: BLE001 - the reload still ends; raised below
            failure = exc
        finally:
            ep.alone = False
        try:
            ep.end_reload()
        except BaseException as exc:  # noqa: BLE001 - the first failure is the one raised
            failure = failure or exc
        seconds = time.perf_counter() - start
        self._agree_swapped(failure is None, before)
        if failure is not None:
            raise failure
        return seconds

    def _agree_swapped(self, swapped: bool, before: int | None) -> None:
        """All ranks at once: when any rank did not swap, each marks itself dirty at the version
        it held before (its receiver, and a follower's copy of rank 0's state)."""
        refused = [] if self.relay is None else self.relay.comm.agree(not swapped, time.monotonic() + self.timeout_s)
        if swapped and not refused:
            return
        receiver = self.endpoint._wr()
        receiver.version, receiver.state = before, WorkerState.DIRTY
        if self.endpoint.mirrored_state is not None:
            self.endpoint.mirrored_state = (before, WorkerState.DIRTY.value)

    def quiet(self) -> None:
        """Before a call that closes this rank's transport: a staged receive still running on
        the staging thread (its actor gave up waiting) is torn down and waited for. One that
        still runs after ``timeout_s`` keeps its transport (its mappings are not released
        under it; the process frees them when it ends) and the call goes on, in step with
        the other ranks."""
        if not self.line.busy.is_set():
            return
        receiver = self.endpoint._wr()
        half = receiver.active_half
        if half is not None:
            half.tear_down(f"{self.endpoint.name}'s teardown")
        if not self.line.idle(self.timeout_s):
            log.warning(
                "weightsync: %s (TP rank %d): a staged receive still runs %.0fs after its teardown; its transport is "
                "left to it",
                self.endpoint.name,
                self.endpoint.tp_rank,
                self.timeout_s,
            )
            receiver.active_half = None

    def close(self) -> None:
        self.line.close()
        if self.relay is not None:
            self.relay.close()
            self.relay = None


def _sink(endpoint: RankEndpoint) -> LoadWeightsSink:
    """The sink this rank's session receives into: the model's, or with ``lora=True`` the
    adapter's (both stage on a staged engine)."""
    sink = endpoint._wr().sink
    if not isinstance(sink, LoadWeightsSink) or not sink.staged:
        raise WeightSyncError(f"{endpoint.name} (TP rank {endpoint.tp_rank}): this session's sink does not stage")
    return sink
