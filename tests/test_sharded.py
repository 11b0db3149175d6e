"""Sharded trainers (FSDP2 over gloo on CPU) as the sync source: ranks built and sharded in
their actors, trained a few steps, synced to broadcast and colocated workers.

Two trainers, each started once for the module, both with tied embeddings: two ranks
(fp32 wire) and three ranks with only the blocks sharded (a mixed DTensor/plain model) and a
bf16 wire; the second reuses two of the first's workers, cast to bf16. The test that kills
a rank runs last.
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any

import pytest
import ray
import torch

from tests import fsdp_model as fm
from tests.conftest import RAY_TIMEOUT, ActorPool
from tests.helpers import assert_bit_equal
from weightsync import TrainerActor, WeightSync, WorkerActor
from weightsync.core.wire.errors import ConcurrentSyncError, SettingsError, SetupError, SyncError, VerificationError
from weightsync.core.wire.messages import SourceLayout, SyncCall
from weightsync.core.wire.settings import SyncSettings
from weightsync.glue.actors import TrainerHost, trainer_ranks
from weightsync.glue.claims import claimed
from weightsync.glue.ranks import RankSpec, TrainerRanks

# Many small tensors (about 8.5 MB in all, none over 132 KB), so a bucket of 256 KiB is a
# small part of the model and the memory bound below means something.
SHAPE = {"vocab": 64, "dim": 128, "blocks": 32}
BUFFER = 128 * 1024


def get(ref: Any) -> Any:
    return ray.get(ref, timeout=RAY_TIMEOUT)


class _Rank(TrainerHost):
    """A TrainerActor that can be told to die in the middle of a sync."""

    def die_at_bucket(self, bucket: int) -> None:
        def hook(index: int) -> None:
            if index == bucket:
                os._exit(1)

        self._ws().on_bucket = hook  # type: ignore[attr-defined]

    def walk_stats(self) -> tuple[int, int]:
        """The last sync's most bytes of gathered tensors held at once, and buckets gathered."""
        walk = self._ws().last_walk  # type: ignore[attr-defined]
        return walk.peak_bytes, walk.gathered


Rank: Any = ray.remote(_Rank)


@pytest.fixture(scope="module")
def two(pool: ActorPool) -> dict[str, Any]:
    """Two ranks (started by hand from RankSpecs), tied embeddings; four workers."""
    specs = RankSpec.group(2)
    ranks = [pool.add(Rank.options(num_cpus=0).remote(partial(fm.fsdp_lm, tied=True, **SHAPE), rank=s)) for s in specs]
    worker = partial(fm.plain_lm, tied=True, **SHAPE)
    workers = {name: pool.add(WorkerActor.options(num_cpus=0).remote(worker)) for name in ("b0", "b1", "i1", "d0")}
    return {"ranks": ranks, "workers": workers}


@pytest.fixture(scope="module")
def three(pool: ActorPool, two: dict[str, Any]) -> dict[str, Any]:
    """Three ranks (trainer_ranks), only the blocks sharded, bf16 on the wire; two workers."""
    factory = partial(fm.fsdp_lm, mixed=True, tied=True, **SHAPE)
    ranks = trainer_ranks(factory, 3, wire_dtype=torch.bfloat16, actor_options={"num_cpus": 0})
    for r in ranks:
        pool.add(r)
    workers = {"b0": two["workers"]["b0"], "d2": two["workers"]["d0"]}
    get([w.call.remote(fm.cast, torch.bfloat16) for w in workers.values()])
    return {"ranks": ranks, "workers": workers}


def train(ranks: list[Any], steps: int, seed: int) -> None:
    losses = get([r.call.remote(fm.train, steps, seed) for r in ranks])
    assert all(math.isfinite(loss) and loss == losses[0] for loss in losses)  # one model, every rank


def assert_synced(ranks: list[Any], workers: dict[str, Any], wire: torch.dtype | None = None) -> None:
    """Every worker holds every rank's full_tensor() of every tensor, bit for bit."""
    fulls = get([r.call.remote(fm.full_state) for r in ranks])
    for other in fulls[1:]:
        for name in fulls[0]:
            assert_bit_equal(other[name], fulls[0][name], name)
    for worker, handle in workers.items():
        held = get(handle.call.remote(fm.state))
        assert held.keys() == fulls[0].keys(), worker
        for name, full in fulls[0].items():
            want = full.to(wire) if wire is not None and full.is_floating_point() else full
            assert_bit_equal(held[name], want, f"{worker}: {name}")


TWO_TRANSPORTS = {"b0": "broadcast", "b1": "broadcast", "i1": "ipc", "d0": "direct"}


def test_two_ranks_sync_to_broadcast_ipc_and_direct_workers_bit_exact(two: dict[str, Any]) -> None:
    ranks, workers = two["ranks"], two["workers"]
    assert set(get(ranks[0].call.remote(fm.kinds)).values()) == {"dtensor"}
    with WeightSync(
        ranks, workers, transport=TWO_TRANSPORTS, worker_ranks={"i1": 1}, buffer_bytes=BUFFER, timeout_s=30
    ) as ws:
        assert ws.transports() == TWO_TRANSPORTS
        assert [ws._members.members[n].rank for n in TWO_TRANSPORTS] == [0, 0, 1, 0]  # d0: the default, rank 0
        before = get(workers["b0"].call.remote(fm.state))
        for version in (1, 2):
            train(ranks, 2, seed=version)
            report = ws.sync(version, verify=version == 2)
            assert {w.version for w in report.workers} == {version}
            assert report.bytes == ws.manifest.total_bytes  # type: ignore[union-attr]
            assert_synced(ranks, workers)
        after = get(workers["b0"].call.remote(fm.state))
        assert not torch.equal(before["embed.weight"], after["embed.weight"])
        assert all(get(w.call.remote(fm.tied)) for w in workers.values())
        assert "head.weight" not in ws.manifest.names  # type: ignore[union-attr]  # tied: sent once
        ws.verify()


def test_peak_extra_memory_per_rank_is_bounded_by_the_buffers(two: dict[str, Any]) -> None:
    """Measured: each rank's peak resident size during a sync, over its size before."""
    ranks, workers = two["ranks"], two["workers"]
    with WeightSync(
        ranks,
        workers,
        transport=TWO_TRANSPORTS,
        worker_ranks={"i1": 1},
        buffer_bytes=BUFFER,
        num_buffers=2,
        timeout_s=30,
    ) as ws:
        model_bytes = ws.manifest.total_bytes  # type: ignore[union-attr]
        ws.sync(10)  # touches the mapped slots and regions once: resident from here on
        train(ranks, 1, seed=10)
        base = get([r.call.remote(lambda _: fm.rss_reset()) for r in ranks])
        ws.sync(11)
        peak = get([r.call.remote(lambda _: fm.rss_peak()) for r in ranks])
        walks = get([r.walk_stats.remote() for r in ranks])
        assert_synced(ranks, workers)
    # Held at once: one bucket of gathered tensors (its all-gather outputs, a little padded),
    # the bucket's padded local pieces, the broadcast buffers. The rank's own count of the
    # gathered bytes it holds is exact, and bounds what a whole-model gather would break.
    # The resident size also carries what gloo's threads and their malloc arenas touch (on
    # rank 0, which serves three transports: 4.1-4.6 MB with a 6.4 MB model, 5.0 MB with a
    # 12.7 MB one, up to 7.5 MB on a loaded 2-core machine; rank 1: 1.7-2.7 MB), so its
    # bound is looser: it catches a gathered copy of the model (8.1 MiB, plus the arenas) held
    # on top, not a bucket too many.
    bound = 2 * BUFFER + 2 * BUFFER + 8 * 1024 * 1024
    for rank, (b, p, (peak_held, gathered)) in enumerate(zip(base, peak, walks)):
        assert gathered > 3, "every walk gathers several buckets"
        assert peak_held <= BUFFER + 64 * 1024 < model_bytes, f"rank {rank} held {peak_held} bytes of gathered tensors"
        print(f"rank {rank}: peak extra {p - b} bytes, gathered held {peak_held}, bound {bound}, model {model_bytes}")
        assert p - b <= bound, f"rank {rank}: {p - b} bytes over its resident size, bound {bound}"


def test_bad_rank_layouts_are_refused_naming_the_rank_or_worker(two: dict[str, Any]) -> None:
    ranks, workers = two["ranks"], two["workers"]
    with pytest.raises(SettingsError, match="b0"):
        WeightSync(ranks, workers, worker_ranks={"b0": 2})
    with pytest.raises(SettingsError, match="nobody"):
        WeightSync(ranks, workers, worker_ranks={"nobody": 0})
    remote = WeightSync(ranks, {"b0": workers["b0"]}, transport="broadcast", worker_ranks={"b0": 1}, timeout_s=30)
    with pytest.raises(SetupError) as refused:
        remote.setup()
    assert refused.value.culprits == ["b0"] and "trainer-rank-0" in str(refused.value)
    swapped = WeightSync(ranks[::-1], {"b0": workers["b0"]}, timeout_s=30)
    with pytest.raises(SetupError) as order:
        swapped.setup()
    assert set(order.value.culprits) == {"trainer-rank-0", "trainer-rank-1"} and "rank order" in str(order.value)
    get(ranks[1].call.remote(fm.add_buffer))
    try:
        differs = WeightSync(ranks, {"b0": workers["b0"]}, timeout_s=30)
        with pytest.raises(SetupError) as disagree:
            differs.setup()
        # Two ranks that differ: which one changed cannot be told, both are named.
        assert disagree.value.culprits == ["trainer-rank-0", "trainer-rank-1"] and "extra" in str(disagree.value)
    finally:
        get(ranks[1].call.remote(fm.drop_buffer))


def test_a_plain_rank_among_sharded_ones_is_refused_at_setup_naming_it(pool: ActorPool, two: dict[str, Any]) -> None:
    """Rank 0 holds FSDP2 DTensors, "rank 1" the same model unsharded: the manifests match
    (both describe the full model), so only the layouts tell; without the check the first
    sync would wait in rank 0's gather until its deadline."""
    plain = pool.add(TrainerActor.options(num_cpus=0).remote(partial(fm.plain_lm, tied=True, **SHAPE)))
    ranks = [two["ranks"][0], plain]
    names = ["trainer-rank-0", "trainer-rank-1"]
    made = get([r.ws_manifest.remote(SyncSettings(buffer_bytes=BUFFER), n, names) for n, r in zip(names, ranks)])
    assert made[0].value == made[1].value  # what the layout check is for
    ws = WeightSync(ranks, {"b0": two["workers"]["b0"]}, transport="broadcast", timeout_s=30)
    with pytest.raises(SetupError) as refused:
        ws.setup()
    err = refused.value
    assert err.culprits == ["trainer-rank-1"]
    assert err.outcomes["trainer-rank-1"].phase == "layout"
    assert "trainer-rank-1" in str(err) and "DTensors" in str(err)


def test_mixed_layouts_blame_the_odd_ranks() -> None:
    names = ["trainer-rank-0", "trainer-rank-1", "trainer-rank-2"]
    ranks = TrainerRanks([object(), object(), object()])
    sharded = [SourceLayout(sharded=True, mesh_size=2, mesh_rank=r) for r in range(2)]
    plain = SourceLayout(sharded=False)
    assert ranks.mixed_layouts(dict(zip(names, [*sharded, sharded[0]]))) == {}
    assert ranks.mixed_layouts(dict(zip(names, [plain] * 3))) == {}
    assert sorted(ranks.mixed_layouts(dict(zip(names, [*sharded, plain])))) == ["trainer-rank-2"]
    assert sorted(ranks.mixed_layouts(dict(zip(names, [plain, plain, sharded[0]])))) == ["trainer-rank-2"]
    # A majority of plain ranks blames the sharded one, even when it is rank 0.
    assert sorted(ranks.mixed_layouts(dict(zip(names, [sharded[0], plain, plain])))) == ["trainer-rank-0"]
    two = TrainerRanks([object(), object()])
    assert sorted(two.mixed_layouts(dict(zip(names, [plain, sharded[1]])))) == ["trainer-rank-1"]
    with pytest.raises(Exception, match="mesh"):
        SourceLayout(sharded=False, mesh_size=2)


def test_verify_names_a_replicated_tensor_that_differs_between_ranks(two: dict[str, Any]) -> None:
    """Rank 1's replica of the plain ``scale`` buffer differs from rank 0's: the workers rank
    1 serves would commit other bytes than rank 0's under one version. A verified sync
    compares every worker with rank 0's checksums and names the tensor, the rank and the
    workers; ``ws.verify()`` names the rank."""
    ranks, workers = two["ranks"], two["workers"]
    served = {"b0": workers["b0"], "i1": workers["i1"]}
    with WeightSync(
        ranks, served, transport={"b0": "broadcast", "i1": "ipc"}, worker_ranks={"i1": 1}, timeout_s=30
    ) as ws:
        ws.sync(12, verify=True)
        assert get(ranks[1].call.remote(fm.skew_scale)), "scale must be a plain (replicated) tensor"
        try:
            with pytest.raises(SyncError) as failure:
                ws.sync(13, verify=True)
            err = failure.value
            assert err.culprits == ["trainer-rank-1"], str(err)
            assert not err.outcomes["i1"].ok and "scale" in err.outcomes["i1"].message
            assert "trainer-rank-0" in err.outcomes["i1"].message
            assert err.held == {"b0": (13, "committed"), "i1": (12, "dirty")}
            with pytest.raises(VerificationError) as checked:
                ws.verify()
            assert checked.value.mismatches["trainer-rank-1"] == "scale"
            assert checked.value.mismatches["i1"] == "scale"
        finally:
            get(ranks[1].call.remote(fm.unskew_scale))
        ws.sync(14, verify=True)
        assert_synced(ranks, served)
        ws.verify()


def test_two_weightsyncs_on_one_sharded_trainer_take_turns_and_overlapping_syncs_are_refused(
    two: dict[str, Any],
) -> None:
    ranks, workers = two["ranks"], two["workers"]
    rollout = {n: workers[n] for n in ("b0", "b1")}
    evaluation = {n: workers[n] for n in ("i1", "d0")}
    a = WeightSync(ranks, rollout, transport="owners", buffer_bytes=BUFFER, timeout_s=30)
    b = WeightSync(ranks, evaluation, transport={"i1": "ipc", "d0": "auto"}, worker_ranks={"i1": 1}, timeout_s=30)
    try:
        a.setup()
        b.setup()
        assert a.transports() == {"b0": "owners", "b1": "owners"}
        assert b.transports() == {"i1": "ipc", "d0": "owner-writes"}
        for version, first, then in ((15, a, b), (16, b, a)):
            train(ranks, 1, seed=version)
            first.sync(version)
            then.sync(version, verify=True)
            assert_synced(ranks, workers)
        # In this process, a sync while another WeightSync's holds the ranks is refused at once.
        with claimed(a.ranks, a.label, "a sync"):
            with pytest.raises(ConcurrentSyncError, match=a.label):
                b.sync(17)
        assert b.status() == {"i1": (16, "committed"), "d0": (16, "committed")}
        # Two syncs reaching the ranks in different orders (as from two processes): each rank
        # runs one WeightSync's while the other runs the other's. Every rank refuses in its
        # agreement, naming both, instead of pairing their collectives on the trainer's group.
        calls = {ws.label: SyncCall(seq=0, version=99, targets={}, owner=ws.label) for ws in (a, b)}
        crossed = [(0, a), (1, b), (0, b), (1, a)]
        outs = get([ranks[r].ws_send.remote(calls[ws.label]) for r, ws in crossed])
        for o in outs:
            assert not o.ok and o.error == "ConcurrentSyncError", o
            assert a.label in o.message and b.label in o.message, o.message
        # The trainer's group is intact: the ranks train on, both WeightSyncs sync.
        train(ranks, 1, seed=17)
        a.sync(17)
        b.sync(17)
        assert_synced(ranks, workers)
    finally:
        a.close()
        b.close()


def test_three_ranks_mixed_dtensor_and_plain_model_with_a_bf16_wire(three: dict[str, Any]) -> None:
    ranks, workers = three["ranks"], three["workers"]
    assert set(get(ranks[0].call.remote(fm.kinds)).values()) == {"dtensor", "plain"}
    with WeightSync(
        ranks,
        workers,
        transport={"b0": "broadcast", "d2": "direct"},
        worker_ranks={"d2": 2},
        buffer_bytes=512,
        timeout_s=30,
    ) as ws:
        assert ws.manifest.specs[0].dtype == "bfloat16"  # type: ignore[union-attr]
        for version in (30, 31):  # the workers hold version 14 from the tests above
            train(ranks, 2, seed=version)
            ws.sync(version)
            assert_synced(ranks, workers, wire=torch.bfloat16)
        ws.verify()


def test_a_rank_killed_mid_sync_fails_the_sync_naming_it(pool: ActorPool, two: dict[str, Any]) -> None:
    """Rank 1 exits between two gathers; rank 0 (inside the next gather) learns at once, and
    the workers rank 1 serves (ipc and direct) blame it by its rank name."""
    ranks = two["ranks"]
    workers = {n: two["workers"][n] for n in ("b1", "i1")}  # b0 and d0 hold bf16 now
    workers["d1"] = pool.add(WorkerActor.options(num_cpus=0).remote(partial(fm.plain_lm, tied=True, **SHAPE)))
    ws = WeightSync(
        ranks,
        workers,
        transport={"b1": "broadcast", "i1": "ipc", "d1": "direct"},
        worker_ranks={"i1": 1, "d1": 1},
        buffer_bytes=BUFFER,
        timeout_s=30,
    )
    ws.sync(20)
    train(ranks, 1, seed=20)
    get(ranks[1].die_at_bucket.remote(3))
    with pytest.raises(SyncError) as failed:
        ws.sync(21)
    err = failed.value
    assert err.culprits == ["trainer-rank-1"] and "trainer-rank-1" in err.dead
    assert "trainer-rank-1" in str(err)
    assert err.outcomes["trainer-rank-0"].consequence  # rank 0 failed because rank 1 did
    # The direct worker it was writing names the rank that serves it, not a party "trainer".
    assert err.outcomes["d1"].blames == ("trainer-rank-1",), err.outcomes["d1"]
    assert err.held["b1"][0] == 20
    assert all(state != "receiving" for _, state in err.held.values())
    # The surviving rank still answers, its shards intact; the next setup names the dead rank.
    assert get(ranks[0].call.remote(fm.kinds))
    with pytest.raises(SetupError) as again:
        ws.sync(22)
    assert again.value.culprits == ["trainer-rank-1"]
