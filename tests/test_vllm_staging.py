"""The engine actor's staging bookkeeping (``weightsync.vllm.staging``) and its lines to the
ranks (``weightsync.vllm.lines``), without an engine: the ranks' answers are scripted, the
lines are real sockets between threads. Real engines: tests/test_vllm_staged.py."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="weightsync.vllm's staging modules load vLLM's worker-side helpers")

from weightsync import SyncInFlight, WeightSyncError
from weightsync.core.wire.messages import ReceiveResult, SyncCall
from weightsync.core.wire.outcome import ok
from weightsync.core.wire.report import StageReport
from weightsync.vllm.codec import RemoteCallError, Reply, decode_call, encode_reply, failed_reply
from weightsync.vllm.lines import EngineLines, LineError, RankLine
from weightsync.vllm.staging import Stager, merge_stages


def stage(nbytes: int = 100) -> StageReport:
    return StageReport(where=("device",), part_bytes=(nbytes,))


class ScriptedLines:
    """The actor's lines, answering each job from a script (one reply per rank)."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.jobs: list[str] = []
        self.replies: list[list[Reply]] = []

    def run(self, kind: str, payload: bytes, timeout_s: float) -> list[bytes]:
        self.jobs.append(kind if kind != "call" else str(decode_call(payload).target))
        if kind == "discard":
            return [encode_reply(Reply(ok=True)) for _ in range(self.ranks)]
        return [encode_reply(r) for r in self.replies.pop(0)]


def received(version: int, state: str) -> Any:
    return ok("vllm", "receive", ReceiveResult(worker="vllm", version=None, state=state))


def stager(ranks: int) -> tuple[Stager, ScriptedLines]:
    s = Stager("vllm", 30.0)
    lines = ScriptedLines(ranks)
    s.lines = lines  # type: ignore[assignment]
    return s, lines


def test_a_receive_while_a_staged_sync_waits_for_its_commit_is_refused_until_that_sync_ends() -> None:
    s, lines = stager(2)
    lines.replies.append(
        [
            Reply(ok=True, value=received(7, "receiving"), state=(None, "receiving"), staged=True, stage=stage()),
            Reply(ok=True, staged=True, stage=stage()),
        ]
    )
    staged = s.transfer("ws_receive", (SyncCall(seq=0, version=7),), {}, False)
    assert staged.ready is None and s.waiting == 7  # broadcast: the commit comes in a second call
    with pytest.raises(SyncInFlight) as refused:
        s.transfer("ws_receive", (SyncCall(seq=1, version=8),), {}, False)
    assert "vllm" in str(refused.value) and "version 8" in str(refused.value) and "version 7" in str(refused.value)
    assert lines.jobs == ["ws_receive"]  # the ranks never saw the second receive
    s.forwarded("ws_accept", {"owner": "WeightSync a"})
    s.waiting = 7
    s.forwarded("ws_settle", {"owner": "WeightSync b"})  # a coordinator that no longer holds the engine
    assert s.waiting == 7
    s.forwarded("ws_settle", {"owner": "WeightSync a"})  # its own, after a failure elsewhere
    assert s.waiting is None


def test_the_swap_waits_for_every_rank_to_hold_its_stage_and_every_part_to_be_ready() -> None:
    s, lines = stager(2)
    ready0 = Reply(ok=True, value=received(3, "receiving"), state=(None, "receiving"), staged=True, ready=3)
    lines.replies.append([ready0, Reply(ok=True, staged=False)])  # relayed: rank 1 holds nothing
    with pytest.raises(WeightSyncError, match=r"TP rank\(s\) \[1\]"):
        s.transfer("ws_receive", (SyncCall(seq=0, version=3),), {}, False)
    assert lines.jobs[-1] == "discard" and s.waiting is None
    lines.replies.append([ready0, Reply(ok=True, staged=True)])
    assert s.transfer("ws_receive", (SyncCall(seq=0, version=3),), {}, False).ready == 3
    parts = [
        Reply(ok=True, value=received(3, "receiving"), state=(None, "receiving"), staged=True, ready=v)
        for v in (3, None)
    ]
    lines.replies.append(parts)  # fed part by part: rank 1 did not mark it ready
    with pytest.raises(WeightSyncError, match=r"TP rank\(s\) \[1\]"):
        s.transfer("ws_commit", (SyncCall(seq=0, version=3),), {}, True)
    unready = [Reply(ok=True, value=received(3, "receiving"), state=(None, "receiving"), staged=True)] * 2
    lines.replies.append(unready)  # fed part by part, chained: neither part commits in its receive
    assert s.transfer("ws_receive", (SyncCall(seq=0, version=3),), {}, True).ready is None and s.waiting == 3


def test_a_rank_that_fails_its_part_fails_the_call_by_name_and_every_rank_drops_its_stage() -> None:
    s, lines = stager(2)
    lines.replies.append(
        [
            Reply(ok=True, value=received(4, "receiving"), state=(None, "receiving"), staged=True, ready=4),
            failed_reply(RuntimeError("no room for the stage")),
        ]
    )
    with pytest.raises(RemoteCallError, match=r"TP rank 1.*no room"):
        s.transfer("ws_receive", (SyncCall(seq=0, version=4),), {}, False)
    assert lines.jobs == ["ws_receive", "discard"] and s.waiting is None


def test_merged_stages_list_every_rank_and_the_slowest_swap() -> None:
    merged = merge_stages([stage(10), None, StageReport(where=("host",), part_bytes=(12,))], 0.25, 1.5, 42)
    assert merged is not None
    assert (merged.where, merged.part_bytes, merged.swap_s, merged.transfer_s, merged.generated_tokens) == (
        ("device", "host"),
        (10, 12),
        0.25,
        1.5,
        42,
    )
    assert merge_stages([None], 0.1, None, None) is None
    with pytest.raises(ValueError, match="where"):
        StageReport(where=("gpu",), part_bytes=(1,))


def test_lines_carry_each_job_to_every_rank_and_name_a_rank_whose_line_closed() -> None:
    lines = EngineLines.listen("vllm")
    lines.accept(2)
    served: list[tuple[int, str]] = []

    def rank(k: int) -> RankLine:
        def serve(kind: str, payload: bytes) -> bytes:
            served.append((k, kind))
            return payload + bytes([k])

        return RankLine(lines.info, k, serve, "vllm")

    ends = {k: rank(k) for k in (1, 0)}  # rank 1 connects first
    lines.accepted(30)
    assert lines.run("call", b"ab", 30) == [b"ab\x00", b"ab\x01"]  # in rank order
    assert sorted(served) == [(0, "call"), (1, "call")] and all(e.alive for e in ends.values())
    ends[1].close()
    with pytest.raises(LineError, match="TP rank 1"):
        lines.run("call", b"x", 30)
    lines.close()
    ends[0].close()


def test_a_line_without_the_key_is_refused_and_the_ranks_still_connect() -> None:
    lines = EngineLines.listen("vllm")
    lines.accept(1)
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
        Client(lines.info.address, family="AF_UNIX", authkey=b"x" * 32)
    rank = RankLine(lines.info, 0, lambda kind, payload: payload, "vllm")
    lines.accepted(30)
    assert lines.run("call", b"ok", 30) == [b"ok"]
    lines.close()
    rank.close()


def test_ranks_that_never_connect_are_named_by_the_deadline() -> None:
    lines = EngineLines.listen("vllm")
    lines.accept(2)
    with pytest.raises(LineError, match="did not all connect"):
        lines.accepted(0.5)
