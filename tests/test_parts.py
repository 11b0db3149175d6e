"""A worker of several processes (an engine's TP ranks): its description, the choice of
``rank-ipc``, and one answer for its parts. Pure functions: no Ray, no vLLM (the real
engine fed part by part is in tests/test_vllm_tp.py)."""

from __future__ import annotations

import dataclasses

import pytest

from weightsync.core.choice import choose_transport
from weightsync.core.wire.errors import PeerAborted, SettingsError, TransferTimeout, WeightSyncError
from weightsync.core.wire.messages import EndpointInfo, ReceiveResult, SyncCall
from weightsync.core.wire.outcome import Status, failed, ok
from weightsync.glue.membership import Member
from weightsync.glue.round import commits_alone
from weightsync.vllm.parts import PartRouting, combine, combine_states


def _info(node: str, pid: int = 1, device: str = "cpu", gpu: str | None = None, **extra: object) -> EndpointInfo:
    return EndpointInfo(
        node_id=node,
        node_ip="127.0.0.1",
        hostname=node,
        pid=pid,
        device=device,
        gpu_uuid=gpu,
        sink_allows_direct=False,
        **extra,  # type: ignore[arg-type]
    )


def _engine(*parts: EndpointInfo) -> EndpointInfo:
    return dataclasses.replace(parts[0], parts=parts)


def test_a_receive_result_of_parts_holds_single_parts() -> None:
    one = _received(1, "committed", 0.1)
    assert ReceiveResult(worker="w", version=1, state="committed", parts=[one, one]).parts == (one, one)
    nested = dataclasses.replace(one, parts=(one,))
    with pytest.raises(WeightSyncError, match="parts"):
        ReceiveResult(worker="w", version=1, state="committed", parts=(nested,))


def test_parts_are_single_processes_and_never_one() -> None:
    a, b = _info("n1", 10), _info("n1", 11)
    assert _engine(a, b).parts == (a, b)
    with pytest.raises(WeightSyncError, match="parts"):
        dataclasses.replace(a, parts=(a,))
    with pytest.raises(WeightSyncError, match="part has no parts"):
        dataclasses.replace(a, parts=(_engine(a, b), b))


def test_auto_feeds_each_part_from_the_rank_beside_it_when_the_layout_matches() -> None:
    gpus = [_info("n1", 10 + k, "cuda", f"GPU-{k}") for k in range(2)]
    ranks = [_info("n1", 20 + k, "cuda", f"GPU-{k}") for k in range(2)]
    engine = _engine(*gpus)
    assert choose_transport(ranks[0], engine, "auto", "vllm", ranks) == "rank-ipc"
    # One trainer process: part 0 receives and relays.
    assert choose_transport(ranks[0], engine, "auto", "vllm", ranks[:1]) == "ipc"
    with pytest.raises(SettingsError, match="counts must match") as refused:
        choose_transport(ranks[0], engine, "rank-ipc", "vllm", ranks[:1])
    assert "1 rank(s)" in str(refused.value) and "2 parts" in str(refused.value) and "'ipc'" in str(refused.value)
    # Rank 1 on another GPU than part 1: refused by rank and part, ipc into part 0 instead.
    crossed = [ranks[0], _info("n1", 21, "cuda", "GPU-7")]
    assert choose_transport(crossed[0], engine, "auto", "vllm", crossed) == "ipc"
    with pytest.raises(SettingsError, match="trainer rank 1") as apart:
        choose_transport(crossed[0], engine, "rank-ipc", "vllm", crossed)
    assert "vllm part 1" in str(apart.value) and "GPU-7" in str(apart.value)


def test_a_worker_of_one_process_is_not_fed_by_parts() -> None:
    ranks = [_info("n1", 20), _info("n1", 21)]
    with pytest.raises(SettingsError, match="one process") as refused:
        choose_transport(ranks[0], _info("n1", 10), "rank-ipc", "w", ranks)
    assert "'ipc'" in str(refused.value)
    assert choose_transport(ranks[0], _info("n1", 10), "auto", "w", ranks) == "ipc"


def test_every_rank_runs_describe_and_accept_and_every_call_once_fed_by_parts() -> None:
    class Feeds:
        feeds_parts = True

    class Relays:
        feeds_parts = False

    routing = PartRouting(2)
    assert routing.every_rank("ws_describe", ()) and routing.every_rank("ws_accept", ())
    assert not routing.every_rank("ws_receive", ())
    assert not routing.every_rank("ws_open", (Relays(), "attach"))
    routing.forwarded("ws_open", False)
    assert not routing.every_rank("ws_commit", ())
    assert routing.every_rank("ws_open", (Feeds(), "attach"))
    routing.forwarded("ws_open", True)
    assert all(routing.every_rank(m, ()) for m in ("ws_receive", "ws_commit", "ws_settle", "ws_teardown"))
    routing.forwarded("ws_teardown", True)
    assert not routing.every_rank("ws_receive", ())
    assert not PartRouting(1).every_rank("ws_describe", ())  # one rank, or vLLM's own update path


def _received(version: int | None, state: str, seconds: float, stale: tuple[str, ...] = ()) -> ReceiveResult:
    return ReceiveResult(worker="vllm", version=version, state=state, checksums=[7, 8], seconds=seconds, stale=stale)


def test_the_engine_answers_for_its_parts_together() -> None:
    infos = [_info("n1", 10), _info("n1", 11)]
    described = combine("ws_describe", [ok("vllm", "describe", i) for i in infos], "vllm")
    assert described.ok and described.value.parts == tuple(infos) and described.value.pid == 10
    got = combine(
        "ws_receive",
        [ok("vllm", "receive", _received(3, "committed", 0.2)), ok("vllm", "receive", _received(3, "committed", 0.5))],
        "vllm",
    )
    assert (got.value.version, got.value.state, got.value.seconds) == (3, "committed", 0.5)
    # Each part's own result travels on, for its own commit to check (its chunks, its rank's).
    assert [p.seconds for p in got.value.parts] == [0.2, 0.5] and not any(p.parts for p in got.value.parts)
    mixed = combine(
        "ws_receive",
        [ok("vllm", "receive", _received(3, "committed", 0.1)), ok("vllm", "receive", _received(2, "dirty", 0.1))],
        "vllm",
    )
    assert (mixed.value.version, mixed.value.state) == (2, "dirty")
    assert combine_states([(3, "committed"), (3, "committed")]) == (3, "committed")
    assert combine_states([(3, "committed"), (None, "receiving")]) == (3, "dirty")
    assert combine("ws_status", [(4, "committed"), (3, "committed")], "vllm") == (3, "dirty")


def test_a_failing_part_fails_the_engine_naming_its_rank_and_keeping_the_blame() -> None:
    late = failed("vllm", "receive", TransferTimeout("waited for trainer-rank-1", blames=["trainer-rank-1"]))
    echo = failed("vllm", "receive", PeerAborted("trainer-rank-0 aborted", blames=["trainer-rank-0"]))
    out = combine("ws_receive", [echo, late], "vllm")
    assert out.status is Status.FAILED and out.party == "vllm" and out.consequence
    assert "TP rank 0" in out.message and "TP rank 1" in out.message and "trainer-rank-1" in out.message
    assert set(out.blames) == {"trainer-rank-0", "trainer-rank-1"}  # each part's peer
    # A part's own failure (its load refused) is the engine's: the other part's echo of
    # the abort it caused does not pass the blame on.
    own = failed("vllm", "receive", WeightSyncError("load_weights refused model.norm.weight"))
    out = combine("ws_receive", [echo, own], "vllm")
    assert out.error == "WeightSyncError" and not out.consequence and out.blames == ()
    assert "model.norm.weight" in out.message and "TP rank 1" in out.message
    only = combine("ws_commit", [ok("vllm", "commit", _received(1, "committed", 0.0)), echo], "vllm")
    assert not only.ok and only.consequence and only.message.startswith("TP rank 1")


def test_parts_that_hold_other_bytes_are_named() -> None:
    same = combine("ws_checksums", [ok("vllm", "checksums", [1, 2, 3]), ok("vllm", "checksums", [1, 2, 3])], "vllm")
    assert same.ok and same.value == [1, 2, 3]
    differ = combine("ws_checksums", [ok("vllm", "checksums", [1, 2, 3]), ok("vllm", "checksums", [1, 9, 3])], "vllm")
    assert not differ.ok and "TP rank 1" in differ.message and "#1" in differ.message


def test_a_staging_worker_fed_by_parts_commits_in_a_chained_call() -> None:
    """Parts of an engine that stages commit together (after every part received); one
    that does not stage, or a staging worker on any other transport, commits alone; what
    crosses to the parties is validated by name."""
    staged = _engine(_info("n1", 10, stages=True), _info("n1", 11, stages=True))
    plain = _engine(_info("n1", 10), _info("n1", 11))
    assert not commits_alone(Member(name="vllm", handle=None, requested="auto", transport="rank-ipc", info=staged))
    assert commits_alone(Member(name="vllm", handle=None, requested="auto", transport="rank-ipc", info=plain))
    assert commits_alone(Member(name="vllm", handle=None, requested="auto", transport="ipc", info=staged))
    assert not commits_alone(Member(name="vllm", handle=None, requested="auto", transport="broadcast", info=plain))
    with pytest.raises(WeightSyncError, match="stages"):
        _info("n1", stages="yes")
    with pytest.raises(WeightSyncError, match="chained"):
        SyncCall(seq=0, version=1, chained=["vllm"])  # type: ignore[arg-type]


def test_staging_is_refused_to_change_while_the_engine_is_fed_by_parts() -> None:
    routing = PartRouting(2)
    routing.refuse_staging_change("vllm", True, False)  # no parts-feeding session: allowed
    routing.forwarded("ws_open", True)
    routing.refuse_staging_change("vllm", True, True)  # no change: allowed
    with pytest.raises(WeightSyncError, match="stage_updates") as refused:
        routing.refuse_staging_change("vllm", False, True)
    assert "vllm" in str(refused.value)
    routing.forwarded("ws_teardown", True)
    routing.refuse_staging_change("vllm", False, True)
