"""Owner sends: every rank of a sharded trainer (FSDP2 over gloo on CPU) broadcasts only the
rows it holds, each worker assembles them in place; the plan, the choice, bit-exact syncs
beside colocated transports, refusals and a rank killed mid-sync.

The ranks are started once for the module; the test that kills a rank runs last.
"""

from __future__ import annotations

import math
import os
import signal
import threading
from functools import partial
from typing import Any

import pytest
import ray

from tests import fsdp_model as fm
from tests.conftest import RAY_TIMEOUT, ActorPool
from tests.helpers import assert_bit_equal
from weightsync import WeightSync, WorkerActor
from weightsync.core.wire.errors import SetupError, SyncError
from weightsync.core.wire.outcome import Status
from weightsync.glue.actors import TrainerHost
from weightsync.glue.ranks import RankSpec

SHAPE = {"vocab": 64, "dim": 128, "blocks": 8}
BUFFER = 128 * 1024


def get(ref: Any) -> Any:
    return ray.get(ref, timeout=RAY_TIMEOUT)


# --- through Ray, with FSDP2 ranks ----------------------------------------------------------


def stop_here() -> None:
    """Stop this process (SIGSTOP) before the calling thread goes on. Sent to this thread:
    a stop sent to the process may begin on another of its threads, and this one would run
    on until that one is scheduled."""
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


class _Rank(TrainerHost):
    """A TrainerActor that can be told to die while sending its owned segments."""

    def die_at_segment(self, bucket: int) -> None:
        def hook(index: int) -> None:
            if index == bucket:
                os._exit(1)

        self._ws().halves["owners"].on_segment = hook  # type: ignore[attr-defined]

    def freeze_at_segment(self, bucket: int) -> None:
        """Stop this process (SIGSTOP) once its segment of ``bucket`` is on its way."""

        def hook(index: int) -> None:
            if index == bucket:
                stop_here()

        self._ws().halves["owners"].on_segment = hook  # type: ignore[attr-defined]

    def freeze_before_writing(self, worker: str) -> None:
        """Stop this process (SIGSTOP) just before it writes its part into ``worker``."""

        def hook(name: str) -> None:
            if name == worker:
                stop_here()

        self._ws().halves["owner-writes"].on_write = hook  # type: ignore[attr-defined]

    def freeze_mid_copy(self, worker: str, copied: int) -> None:
        """Stop this process (SIGSTOP) once it copied ``copied`` tensors into ``worker``."""
        seen: list[int] = []

        def hook(name: str, index: int) -> None:
            if name == worker:
                seen.append(index)
                if len(seen) == copied + 1:
                    stop_here()

        self._ws().halves["owner-writes"].on_copy = hook  # type: ignore[attr-defined]

    def walk_stats(self) -> tuple[int, int, int]:
        """The last sync's buckets gathered, the buckets of one pass over the model, and the
        most bytes of gathered tensors held at once."""
        sender = self._ws()
        walk = sender.last_walk  # type: ignore[attr-defined]
        return walk.gathered, len(sender._buckets), walk.peak_bytes  # type: ignore[attr-defined]

    def owned_rows(self) -> tuple[bool, ...]:
        return self._ws().owned_layout().rows  # type: ignore[attr-defined, no-any-return]


Rank: Any = ray.remote(_Rank)


@pytest.fixture(scope="module")
def two(pool: ActorPool) -> dict[str, Any]:
    """Two FSDP2 ranks with tied embeddings; two owners workers and two colocated ones."""
    specs = RankSpec.group(2)
    ranks = [pool.add(Rank.options(num_cpus=0).remote(partial(fm.fsdp_lm, tied=True, **SHAPE), rank=s)) for s in specs]
    worker = partial(fm.plain_lm, tied=True, **SHAPE)
    workers = {name: pool.add(WorkerActor.options(num_cpus=0).remote(worker)) for name in ("o0", "o1", "i1", "d0")}
    return {"ranks": ranks, "workers": workers}


def train(ranks: list[Any], steps: int, seed: int) -> None:
    losses = get([r.call.remote(fm.train, steps, seed) for r in ranks])
    assert all(math.isfinite(loss) and loss == losses[0] for loss in losses)


def assert_synced(ranks: list[Any], workers: dict[str, Any]) -> None:
    full = get([r.call.remote(fm.full_state) for r in ranks])[0]  # a collective: every rank takes part
    for worker, handle in workers.items():
        held = get(handle.call.remote(fm.state))
        assert held.keys() == full.keys(), worker
        for name, tensor in full.items():
            assert_bit_equal(held[name], tensor, f"{worker}: {name}")


MIXED = {"o0": "owners", "o1": "owners", "i1": "ipc", "d0": "direct"}


def test_two_ranks_send_what_they_own_bit_exact_beside_colocated_workers(two: dict[str, Any]) -> None:
    ranks, workers = two["ranks"], two["workers"]
    rows = get(ranks[0].owned_rows.remote())
    assert any(rows) and not all(rows)  # split matrices and whole (replicated or plain) tensors
    # inplace_bytes: each rank's half of a block's matrices (about 64 KiB) travels in place.
    with WeightSync(
        ranks,
        workers,
        transport=MIXED,
        worker_ranks={"i1": 1},
        buffer_bytes=BUFFER,
        inplace_bytes=16 * 1024,
        timeout_s=30,
    ) as ws:
        assert ws.transports() == MIXED
        for version in (1, 2, 3):
            train(ranks, 1, seed=version)
            report = ws.sync(version, verify=version == 2)
            assert {w.version for w in report.workers} == {version}
            assert report.transports == {"owners": 2, "ipc": 1, "direct": 1}
            assert_synced(ranks, workers)
        assert all(get(w.call.remote(fm.tied)) for w in workers.values())
        ws.verify()


def test_a_rank_writes_all_its_direct_workers_from_one_gather(two: dict[str, Any]) -> None:
    ranks, workers = two["ranks"], {n: two["workers"][n] for n in ("o0", "d0")}
    # A transfer buffer larger than the model, gathers of at most BUFFER bytes.
    settings = {"buffer_bytes": 64 * BUFFER, "gather_bytes": BUFFER}
    with WeightSync(ranks, workers, transport="direct", timeout_s=30, **settings) as ws:  # type: ignore[arg-type]
        assert {ws.transports()[n] for n in workers} == {"direct"}
        assert ws.manifest.total_bytes < 64 * BUFFER  # type: ignore[union-attr]
        train(ranks, 1, seed=5)
        ws.sync(5)
        assert_synced(ranks, workers)
        gathered, buckets, peak = get(ranks[0].walk_stats.remote())
        assert buckets > 3 and gathered == buckets  # one pass for two workers
        assert peak <= BUFFER + 64 * 1024  # a bucket of gather_bytes, not of buffer_bytes
        train(ranks, 1, seed=6)
        ws.sync(6, verify=True)
        assert_synced(ranks, workers)
        gathered, _, _ = get(ranks[0].walk_stats.remote())
        assert gathered == 2 * buckets  # verify: one more, for the checksums every half reuses
    # An ipc worker beside them on the same rank: the direct writes ride the ipc walk.
    mixed = {**workers, "i1": two["workers"]["i1"]}
    transport = {"o0": "direct", "d0": "direct", "i1": "ipc"}
    with WeightSync(ranks, mixed, transport=transport, timeout_s=30, **settings) as ws:  # type: ignore[arg-type]
        for version, verify in ((7, False), (8, True)):
            train(ranks, 1, seed=version)
            ws.sync(version, verify=verify)
            assert_synced(ranks, mixed)
            gathered, buckets, _ = get(ranks[0].walk_stats.remote())
            assert gathered == (1 + verify) * buckets  # one walk for both transports (+1 with verify)


def _move(name: str, model: Any) -> None:
    """Give parameter ``name`` new storage, as a reload would."""
    param = model.get_parameter(name)
    param.data = param.data.clone()


def test_every_rank_writes_its_rows_into_colocated_workers_with_no_gather(two: dict[str, Any]) -> None:
    ranks, workers = two["ranks"], {n: two["workers"][n] for n in ("d0", "o0", "i1")}
    transport = {"d0": "auto", "o0": "auto", "i1": "ipc"}
    with WeightSync(ranks, workers, transport=transport, worker_ranks={"i1": 1}, timeout_s=30) as ws:
        assert ws.transports() == {"d0": "owner-writes", "o0": "owner-writes", "i1": "ipc"}
        for version in (9, 10):
            train(ranks, 1, seed=version)
            report = ws.sync(version, verify=version == 10)
            assert report.transports == {"owner-writes": 2, "ipc": 1}
            assert_synced(ranks, workers)
    mine = {n: workers[n] for n in ("d0", "o0")}
    with WeightSync(ranks, mine, timeout_s=30) as ws:
        train(ranks, 1, seed=11)
        ws.sync(11)
        assert_synced(ranks, mine)
        # Every rank wrote from its own shards: nothing was gathered, nothing held.
        assert [get(r.walk_stats.remote())[::2] for r in ranks] == [(0, 0), (0, 0)]
        # A worker whose tensor got new storage is exported again, and every rank maps it anew.
        get(mine["d0"].call.remote(partial(_move, "blocks.0.0.weight")))
        train(ranks, 1, seed=12)
        report = ws.sync(12)
        assert {w.version for w in report.workers} == {12}
        assert_synced(ranks, mine)


def test_owner_writes_with_verify_name_a_rank_whose_replica_differs(two: dict[str, Any]) -> None:
    ranks, worker = two["ranks"], two["workers"]["d0"]
    with WeightSync(ranks, {"d0": worker}, transport="owner-writes", timeout_s=30) as ws:
        ws.sync(13, verify=True)
        # The plain buffer ``scale`` is written whole by rank index % 2: rank 1 here.
        assert ws.manifest.names.index("scale") % len(ranks) == 1  # type: ignore[union-attr]
        assert get(ranks[1].call.remote(fm.skew_scale)), "scale must be a plain (replicated) tensor"
        try:
            with pytest.raises(SyncError) as failed:
                ws.sync(14, verify=True)
            err = failed.value
            # Rank 1 wrote its own replica faithfully (the worker's check against its writer
            # passed); the commit found it differs from rank 0's and named rank 1.
            assert err.culprits == ["trainer-rank-1"], str(err)
            assert "scale" in err.outcomes["d0"].message and "trainer-rank-0" in err.outcomes["d0"].message
            assert err.held == {"d0": (13, "dirty")}
        finally:
            get(ranks[1].call.remote(fm.unskew_scale))
        ws.sync(14, verify=True)
        assert_synced(ranks, {"d0": worker})


def test_a_rank_frozen_before_writing_is_named_and_writes_nothing_late(two: dict[str, Any]) -> None:
    ranks, worker = two["ranks"], two["workers"]["d0"]
    pid = get(ranks[1].pid.remote())
    ws = WeightSync(ranks, {"d0": worker}, transport="owner-writes", timeout_s=10)
    try:
        ws.sync(35)
        train(ranks, 1, seed=36)
        get(ranks[1].freeze_before_writing.remote("d0"))
        try:
            with pytest.raises(SyncError) as failed:
                ws.sync(36)
            err = failed.value
            held = get(worker.call.remote(fm.state))
        finally:
            os.kill(pid, signal.SIGCONT)
        assert err.culprits == ["trainer-rank-1"], str(err)
        assert err.outcomes["trainer-rank-1"].status is Status.TIMED_OUT
        version, state = get(worker.ws_status.remote())
        assert version == 35 and state in ("committed", "dirty"), (version, state)
        get(ranks[1].pid.remote())  # the thawed rank has answered
        for name, tensor in get(worker.call.remote(fm.state)).items():
            assert_bit_equal(tensor, held[name], f"{name} written after the worker gave up")
    finally:
        ws.close()


def test_a_rank_frozen_mid_copy_writes_nothing_more_once_thawed(two: dict[str, Any]) -> None:
    """Rank 1 stops (SIGSTOP) after copying 3 of its tensors into the worker; the worker
    gives up at its deadline (dirty at its old version). Thawed, rank 1 finds the worker's
    abort words before its next tensor and stops: the worker's bytes stay as they were when
    it gave up (the rank used to go on writing every tensor it had left)."""
    ranks, worker = two["ranks"], two["workers"]["d0"]
    pid = get(ranks[1].pid.remote())
    ws = WeightSync(ranks, {"d0": worker}, transport="owner-writes", timeout_s=10)
    try:
        ws.sync(37)
        train(ranks, 1, seed=38)
        get(ranks[1].freeze_mid_copy.remote("d0", 3))
        try:
            with pytest.raises(SyncError) as failed:
                ws.sync(38)
            held = get(worker.call.remote(fm.state))
        finally:
            os.kill(pid, signal.SIGCONT)
        err = failed.value
        assert err.culprits == ["trainer-rank-1"], str(err)
        assert err.held == {"d0": (37, "dirty")}, err.held  # rank 0's part and 3 of rank 1's landed
        get(ranks[1].pid.remote())  # queued behind its send: the thawed rank has finished it
        for name, tensor in get(worker.call.remote(fm.state)).items():
            assert_bit_equal(tensor, held[name], f"{name} written after the worker gave up")
    finally:
        ws.close()


def test_a_worker_refusing_the_version_stops_every_rank_and_the_next_sync_works(two: dict[str, Any]) -> None:
    ranks, workers = two["ranks"], {n: two["workers"][n] for n in ("o0", "o1")}
    with WeightSync(ranks, {"o0": workers["o0"]}, transport="owners", buffer_bytes=BUFFER, timeout_s=30) as ahead:
        ahead.sync(15)  # o0 now holds a version newer than the next sync's
    with WeightSync(ranks, workers, transport="owners", buffer_bytes=BUFFER, timeout_s=30) as ws:
        held = get(workers["o1"].call.remote(fm.state))
        train(ranks, 1, seed=10)
        with pytest.raises(SyncError) as refused:
            ws.sync(11)
        err = refused.value
        assert err.culprits == ["o0"] and "older" in str(err)
        assert err.held["o0"] == (15, "committed")
        assert err.held["o1"][1] == "committed"
        for name, tensor in get(workers["o1"].call.remote(fm.state)).items():
            assert_bit_equal(tensor, held[name], name)  # nothing moved to o1 either
        ws.sync(16)
        assert_synced(ranks, workers)
        # Owner sends alone gather nothing: every rank sent from its own shards.
        assert [get(r.walk_stats.remote())[0] for r in ranks] == [0, 0]


def test_delta_syncs_each_rank_diffs_only_what_it_sends(pool: ActorPool, two: dict[str, Any]) -> None:
    """Owner sends with deltas: every rank encodes its own rows against its own base, the
    workers (a module sink, a load_weights sink) patch their rows; a colocated ipc worker
    served by rank 1 gets rank 1's deltas of the gathered model; bit-exact throughout."""
    ranks = two["ranks"]
    worker = partial(fm.plain_lm, tied=True, **SHAPE)
    workers = {
        "od": pool.add(WorkerActor.options(num_cpus=0).remote(worker)),
        "ol": pool.add(
            WorkerActor.options(num_cpus=0).remote(partial(fm.loading_lm, tied=True, **SHAPE), sink="load_weights")
        ),
        "id": pool.add(WorkerActor.options(num_cpus=0).remote(worker)),
    }
    transport = {"od": "owners", "ol": "owners", "id": "ipc"}
    with WeightSync(
        ranks, workers, transport=transport, worker_ranks={"id": 1}, buffer_bytes=BUFFER, delta=True, timeout_s=30
    ) as ws:
        first = ws.sync(1)
        assert {w.encoding for w in first.workers} == {"dense"}
        for version in (2, 3, 4):
            get([r.call.remote(fm.nudge_own, version) for r in ranks])
            report = ws.sync(version, verify=version == 3)
            assert {w.name: w.encoding for w in report.workers} == dict.fromkeys(workers, "delta"), report.summary()
            # owners: both ranks' deltas of their own rows, added up; ipc: rank 1's of the model.
            sent = {w.name: w.sent_bytes for w in report.workers}
            assert sent["od"] == sent["ol"] and max(sent.values()) == report.sent_bytes < 0.8 * report.bytes, sent
            assert_synced(ranks, workers)
        # Rank 1 gathers the model once for its ipc worker's encoding (rank 0 joins the gathers).
        assert [get(r.walk_stats.remote())[0] > 0 for r in ranks] == [True, True]
        ws.verify()


def test_a_staging_worker_fed_by_owners_in_a_delta_session_lands_dense_syncs_in_its_stage(
    pool: ActorPool, two: dict[str, Any]
) -> None:
    """Owner sends carry every rank's rows into a staging worker's stage, never into its
    model before the swap; a stage holds no base, so its group's syncs are dense."""
    ranks = two["ranks"]
    workers = {
        "staging": pool.add(
            WorkerActor.options(num_cpus=0).remote(partial(fm.plain_lm, tied=True, **SHAPE), stage="auto")
        ),
        "plain": pool.add(WorkerActor.options(num_cpus=0).remote(partial(fm.plain_lm, tied=True, **SHAPE))),
    }
    with WeightSync(ranks, workers, transport="owners", buffer_bytes=BUFFER, delta=True, timeout_s=30) as ws:
        for version in (1, 2, 3):
            get([r.call.remote(fm.nudge_own, version) for r in ranks])
            report = ws.sync(version, verify=version == 2)
            assert {w.name: w.encoding for w in report.workers} == dict.fromkeys(workers, "dense"), report.summary()
            staged = {w.name: w.stage for w in report.workers}
            assert staged["staging"] is not None and staged["plain"] is None, staged
            assert_synced(ranks, workers)


def test_a_rank_frozen_while_sending_is_named_and_no_worker_takes_a_mixture(two: dict[str, Any]) -> None:
    ranks, workers = two["ranks"], {n: two["workers"][n] for n in ("o0", "o1")}
    pid = get(ranks[1].pid.remote())
    # The workers' calls start a little after the coordinator's: on a loaded machine a short
    # timeout leaves too little grace between their deadline and the coordinator's.
    ws = WeightSync(ranks, workers, transport="owners", buffer_bytes=BUFFER, timeout_s=10)
    try:
        ws.sync(17)
        train(ranks, 1, seed=17)
        get(ranks[1].freeze_at_segment.remote(2))
        try:
            with pytest.raises(SyncError) as failed:
                ws.sync(18)
        finally:
            os.kill(pid, signal.SIGCONT)
        err = failed.value
        assert err.culprits == ["trainer-rank-1"], str(err)
        assert err.outcomes["trainer-rank-1"].status is Status.TIMED_OUT
        # Each worker's commit waits for the frozen rank's answer: no settle is queued behind
        # it (it would wait a deadline for nothing); the error says what each waits for.
        assert err.waiting == {name: ["trainer-rank-1"] for name in workers}, str(err)
        assert not set(err.held) & set(workers), err.held
        for name in workers:
            assert any(name in line and "trainer-rank-1" in line for line in str(err).splitlines()[1:]), str(err)
        # A worker's commit waits on every rank's answer, so once the thawed rank answered
        # (its group was aborted), no worker holds version 18: each keeps 17, dirty if written.
        for handle in workers.values():
            version, state = get(handle.ws_status.remote())
            assert version == 17 and state in ("committed", "dirty"), (version, state)
    finally:
        ws.close()


@pytest.mark.parametrize("transport,name", [("owners", "i1"), ("owner-writes", "d0")])
def test_a_rank_whose_shard_changed_after_setup_is_refused_by_name(
    two: dict[str, Any], transport: str, name: str
) -> None:
    """Rank 1's rows of a matrix replaced by one row under the same global shape: the sync is
    refused before any byte moves, naming rank 1 and the tensor (with verify too, where it
    used to be blamed on the worker), instead of the worker taking 128 copies of that row."""
    ranks, worker = two["ranks"], {name: two["workers"][name]}
    with WeightSync(ranks, worker, transport=transport, buffer_bytes=BUFFER, timeout_s=30) as ws:
        for version, verify in ((50, False), (52, True)):
            ws.sync(version)  # after the failure: set up again, with every shard as it is now
            held = get(worker[name].call.remote(fm.state))
            assert get(ranks[1].call.remote(partial(fm.shrink_shard, name="blocks.0.0.weight"))) == (1, 128)
            try:
                with pytest.raises(SyncError) as refused:
                    ws.sync(version + 1, verify=verify)
            finally:
                get(ranks[1].call.remote(fm.restore_shard))
            err = refused.value
            assert err.culprits == ["trainer-rank-1"], str(err)
            why = err.outcomes["trainer-rank-1"]
            assert why.error == "ModelChangedError" and "blocks.0.0.weight" in why.message, why
            assert "[1, 128]" in why.message and "[128, 128]" in why.message, why.message
            assert err.held[name][0] == version and err.held[name][1] in ("committed", "dirty"), err.held
            for key, tensor in get(worker[name].call.remote(fm.state)).items():
                assert_bit_equal(tensor, held[key], key)
        train(ranks, 1, seed=54)
        ws.sync(54, verify=True)
        assert_synced(ranks, worker)


def test_a_rank_killed_while_sending_fails_the_sync_naming_it(pool: ActorPool, two: dict[str, Any]) -> None:
    ranks, workers = two["ranks"], {n: two["workers"][n] for n in ("o0", "o1")}
    ws = WeightSync(ranks, workers, transport="owners", buffer_bytes=BUFFER, timeout_s=30)
    ws.sync(20)
    train(ranks, 1, seed=20)
    get(ranks[1].die_at_segment.remote(2))
    with pytest.raises(SyncError) as failed:
        ws.sync(21)
    err = failed.value
    assert err.culprits == ["trainer-rank-1"] and "trainer-rank-1" in err.dead
    assert "trainer-rank-1" in str(err)
    # No worker took version 21 from a mixture: each holds version 20, and is dirty when
    # bytes of 21 landed.
    assert {name: version for name, (version, _) in err.held.items()} == {"o0": 20, "o1": 20}
    assert all(state in ("committed", "dirty") for _, state in err.held.values())
    with pytest.raises(SetupError) as again:
        ws.sync(22)
    assert again.value.culprits == ["trainer-rank-1"]
    ws.close()
