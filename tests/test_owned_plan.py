"""The plan of owner sends and the choice of the transports a sharded trainer's ranks serve
together (owner sends, owner writes): pure functions, no Ray."""

from __future__ import annotations

import random

import pytest

from weightsync.core.choice import choose_transport
from weightsync.core.owned_plan import OwnedLayout, plan, row_span
from weightsync.core.wire import EndpointInfo
from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.manifest import Manifest, TensorSpec

# --- the plan (no Ray) ----------------------------------------------------------------------


def _manifest(shapes: list[tuple[int, ...]], buffer_bytes: int = 4096, inplace_bytes: int = 0) -> Manifest:
    specs = [TensorSpec(f"t{i}", shape, "float32") for i, shape in enumerate(shapes)]
    return Manifest.build(specs, buffer_bytes=buffer_bytes, num_buffers=2, inplace_bytes=inplace_bytes)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("inplace_bytes", [0, 64])
def test_the_plan_sends_every_byte_once_from_its_owner_at_aligned_offsets(ranks: int, inplace_bytes: int) -> None:
    rng = random.Random(ranks)
    shapes = [tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 3))) for _ in range(40)] + [(1000, 3)]
    manifest = _manifest(shapes, inplace_bytes=inplace_bytes)
    rows = tuple(bool(s) and rng.random() < 0.7 for s in shapes)
    buckets = plan(manifest, OwnedLayout(ranks=ranks, rows=rows))
    assert [i for b in buckets for i in b.indices] == list(range(len(shapes)))
    seen: dict[int, list[tuple[int, int, int]]] = {}
    for bucket in buckets:
        assert len(bucket.segments) == ranks
        for r, segment in enumerate(bucket.segments):
            end = 0
            for piece in segment.pieces:
                assert piece.index in bucket.indices
                assert piece.offset % manifest.agreed.alignment == 0 and piece.offset >= end
                end = piece.offset + piece.nbytes
                seen.setdefault(piece.index, []).append((r, piece.start, piece.stop))
            assert segment.nbytes == end
            for piece in bucket.inplace[r]:
                assert piece.index in bucket.indices and piece.offset == 0 and piece.nbytes >= inplace_bytes > 0
                seen.setdefault(piece.index, []).append((r, piece.start, piece.stop))
    if inplace_bytes:
        assert any(b.inplace[r] for b in buckets for r in range(ranks))  # the (1000, 3) tensor at least
    for i, spec in enumerate(manifest.specs):
        n = spec.shape[0] if spec.shape else 1
        pieces = sorted(seen.get(i, []), key=lambda p: p[1])
        if spec.nbytes == 0:
            assert len(pieces) == 1, spec  # handed over even though it holds no bytes
            continue
        assert [(a, b) for _, a, b in pieces if b > a] == [(a, b) for a, b in _cover(n, ranks if rows[i] else 1)], spec
        for r, a, b in pieces:
            if rows[i]:
                assert (a, b) == row_span(n, ranks, r)
            else:
                assert r == i % ranks


def _cover(n: int, parts: int) -> list[tuple[int, int]]:
    spans = [row_span(n, parts, r) for r in range(parts)]
    return [s for s in spans if s[1] > s[0]]


def test_the_plan_refuses_a_layout_of_another_model() -> None:
    with pytest.raises(SettingsError, match="2 tensor"):
        plan(_manifest([(4,), (5,), (6,)]), OwnedLayout(ranks=2, rows=(True, False)))
    with pytest.raises(SettingsError, match="ranks"):
        OwnedLayout(ranks=0, rows=())


def _info(node: str, shards: str = "none") -> EndpointInfo:
    return EndpointInfo(
        node_id=node,
        node_ip="127.0.0.1",
        hostname=node,
        pid=1,
        device="cpu",
        gpu_uuid=None,
        sink_allows_direct=True,
        shards=shards,
    )


def test_auto_picks_owner_sends_only_for_a_trainer_whose_ranks_can_send_what_they_hold() -> None:
    worker = _info("n2")
    assert choose_transport(_info("n1", "owned"), worker, "auto", "w") == "owners"
    assert choose_transport(_info("n1", "other"), worker, "auto", "w") == "broadcast"
    assert choose_transport(_info("n1"), worker, "auto", "w") == "broadcast"
    assert choose_transport(_info("n2", "owned"), worker, "auto", "w") == "owner-writes"  # colocated first
    with pytest.raises(SettingsError, match="not sharded"):
        choose_transport(_info("n1"), worker, "owners", "w")
    with pytest.raises(SettingsError, match="Shard"):
        choose_transport(_info("n1", "other"), worker, "owners", "w")


def test_auto_picks_owner_writes_only_when_every_rank_shares_the_workers_device() -> None:
    worker = _info("n1")
    ranks = [_info("n1", "owned"), _info("n1", "owned")]
    assert choose_transport(ranks[0], worker, "auto", "w", ranks) == "owner-writes"
    # One rank elsewhere: the rank beside the worker gathers and writes it (direct).
    apart = [_info("n1", "owned"), _info("n2", "owned")]
    assert choose_transport(apart[0], worker, "auto", "w", apart) == "direct"
    with pytest.raises(SettingsError, match="trainer rank 1") as refused:
        choose_transport(apart[0], worker, "owner-writes", "w", apart)
    assert "n2" in str(refused.value) and "'direct'" in str(refused.value)
    # Layouts the ranks cannot write from, and a trainer of one process.
    other = [_info("n1", "other"), _info("n1", "other")]
    assert choose_transport(other[0], worker, "auto", "w", other) == "direct"
    with pytest.raises(SettingsError, match="Shard"):
        choose_transport(other[0], worker, "owner-writes", "w", other)
    with pytest.raises(SettingsError, match="not sharded"):
        choose_transport(_info("n1"), worker, "owner-writes", "w")
    # A sink that transforms tensors takes ipc, as from an unsharded trainer.
    loads = EndpointInfo(**{**_info("n1").__dict__, "sink_allows_direct": False})
    assert choose_transport(ranks[0], loads, "auto", "w", ranks) == "ipc"
