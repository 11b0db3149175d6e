"""Chunk planning, packing and unpacking in one process, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import all_dtypes, assert_bit_equal, random_tensor
from weightsync.core.packing import ChunkUnpacker, byte_checksum, pack_chunk
from weightsync.core.wire import Manifest, TensorSpec, dtype_name, plan_chunks
from weightsync.packed_tensor import pack_tensors, unpack_tensor


def roundtrip(
    tensors: dict[str, torch.Tensor], buffer_bytes: int, use_destinations: bool, keeps_references: bool = False
) -> dict[str, torch.Tensor]:
    """Pack every chunk into one reused buffer and unpack it before packing the next."""
    specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
    m = Manifest.build(specs, buffer_bytes=buffer_bytes, num_buffers=1)
    sources = list(tensors.values())
    out = {s.name: torch.full(s.shape, 0, dtype=s.torch_dtype) for s in specs}
    dests = [out[s.name] if use_destinations else None for s in specs]
    unpacker = ChunkUnpacker(m.specs, dests.__getitem__, keeps_references)
    buffer = torch.empty(buffer_bytes, dtype=torch.uint8)
    for chunk in m.chunks:
        assert chunk.nbytes <= buffer_bytes
        buffer.fill_(0xAB)
        pack_chunk(chunk, m.specs, sources, buffer)
        for name, tensor in unpacker.unpack(chunk, buffer):
            out[name].copy_(tensor)
    unpacker.finish()
    return out


@pytest.mark.parametrize("dtype", all_dtypes(), ids=dtype_name)
@pytest.mark.parametrize("use_destinations", [True, False], ids=["into-destinations", "handed-to-sink"])
def test_every_allowed_dtype_round_trips_bit_exact(dtype: torch.dtype, use_destinations: bool) -> None:
    tensors = {
        "matrix": random_tensor((17, 33), dtype, 1),
        "vector": random_tensor((5,), dtype, 2),
        "scalar": random_tensor((), dtype, 3),
        "empty": random_tensor((0, 3), dtype, 4),
    }
    out = roundtrip(tensors, buffer_bytes=1024, use_destinations=use_destinations)
    for name, tensor in tensors.items():
        assert_bit_equal(out[name], tensor, name)


def test_odd_sized_fp16_followed_by_fp32_unpacks_at_aligned_offsets() -> None:
    # vLLM PR #57665: unaligned packing failed here with "storage_offset must be divisible by 4".
    tensors = {"half": random_tensor((3, 5), torch.float16, 1), "single": random_tensor((7,), torch.float32, 2)}
    m = Manifest.build([TensorSpec.of(n, t) for n, t in tensors.items()], buffer_bytes=4096)
    offsets = [p.buffer_offset for p in m.chunks[0].pieces]
    assert offsets == [0, 256]
    out = roundtrip(tensors, 4096, use_destinations=False)
    for name, tensor in tensors.items():
        assert_bit_equal(out[name], tensor, name)


@pytest.mark.parametrize(
    "make",
    [
        lambda t: t.t(),
        lambda t: t[::2, 1::3],
        lambda t: t.unsqueeze(0).permute(2, 0, 1),
        lambda t: t[0].expand(5, -1),
    ],
    ids=["transposed", "strided-slice", "permuted", "expanded"],
)
def test_non_contiguous_sources_pack_bit_exact(make) -> None:  # type: ignore[no-untyped-def]
    base = random_tensor((40, 30), torch.float32, 7)
    source = make(base)
    assert not source.is_contiguous()
    out = roundtrip({"w": source, "b": random_tensor((3,), torch.bfloat16, 8)}, 1024, use_destinations=True)
    assert_bit_equal(out["w"], source.contiguous())
    # Split across chunks too (the tensor is 4.8 kB against a 1 kB buffer).
    out = roundtrip({"w": source}, 1024, use_destinations=False)
    assert_bit_equal(out["w"], source.contiguous())


@pytest.mark.parametrize("use_destinations", [True, False])
def test_tensor_several_times_larger_than_the_buffer_is_split_and_reassembled(use_destinations: bool) -> None:
    tensors = {
        "before": random_tensor((10,), torch.float32, 1),
        "embedding": random_tensor((1000, 7), torch.bfloat16, 2),  # 14000 bytes, buffer 4096
        "after": random_tensor((3, 3), torch.float16, 3),
    }
    m = Manifest.build([TensorSpec.of(n, t) for n, t in tensors.items()], buffer_bytes=4096)
    holding = [c.index for c in m.chunks if any(p.spec_index == 1 for p in c.pieces)]
    assert len(holding) >= 4
    out = roundtrip(tensors, 4096, use_destinations)
    for name, tensor in tensors.items():
        assert_bit_equal(out[name], tensor, name)


@pytest.mark.parametrize("buffer_bytes", [1024, 4096, 65536, 1 << 20, 64 << 20])
def test_buffer_sizes_from_1_kib_to_64_mib(buffer_bytes: int) -> None:
    tensors = {f"t{i}": random_tensor((i * 37 + 1, 13), torch.float32, i) for i in range(12)}
    m = Manifest.build([TensorSpec.of(n, t) for n, t in tensors.items()], buffer_bytes=buffer_bytes)
    assert all(c.nbytes <= buffer_bytes for c in m.chunks)
    assert (len(m.chunks) == 1) == (buffer_bytes >= 1 << 20)
    out = roundtrip(tensors, buffer_bytes, use_destinations=True)
    for name, tensor in tensors.items():
        assert_bit_equal(out[name], tensor, name)


def test_plan_is_deterministic_aligned_and_covers_every_byte_once() -> None:
    specs = [TensorSpec(f"t{i}", (i * 11 + 3,), "float16" if i % 2 else "float32") for i in range(40)]
    a = plan_chunks(specs, 2048, 256)
    assert a == plan_chunks(list(specs), 2048, 256)
    covered = {i: 0 for i in range(len(specs))}
    for chunk in a:
        for piece in chunk.pieces:
            assert piece.buffer_offset % 256 == 0
            assert piece.buffer_offset + piece.nbytes <= 2048
            assert piece.tensor_offset == covered[piece.spec_index]
            covered[piece.spec_index] += piece.nbytes
    assert covered == {i: s.nbytes for i, s in enumerate(specs)}


def test_handed_views_alias_the_buffer_unless_the_sink_keeps_references() -> None:
    # A consumer that keeps views into a reused buffer sees the next chunk's bytes; sinks
    # that keep references must get clones (the multi-chunk corruption fixed in vLLM).
    tensors = {"a": random_tensor((64,), torch.float32, 1), "b": random_tensor((64,), torch.float32, 2)}
    m = Manifest.build([TensorSpec.of(n, t) for n, t in tensors.items()], buffer_bytes=256)
    assert len(m.chunks) == 2
    for keeps, expect_intact in ((True, True), (False, False)):
        buffer = torch.empty(256, dtype=torch.uint8)
        unpacker = ChunkUnpacker(m.specs, lambda i: None, keeps_references=keeps)
        kept = []
        for chunk in m.chunks:
            pack_chunk(chunk, m.specs, list(tensors.values()), buffer)
            kept += unpacker.unpack(chunk, buffer)
        assert torch.equal(kept[0][1], tensors["a"]) is expect_intact


def test_checksum_catches_a_single_flipped_bit_anywhere() -> None:
    buffer = random_tensor((1003,), torch.uint8, 5)
    reference = byte_checksum(buffer, 1003)
    for position in (0, 7, 8, 500, 1002):
        for bit in (0, 7):
            flipped = buffer.clone()
            flipped[position] ^= 1 << bit
            assert byte_checksum(flipped, 1003) != reference


def test_pack_tensors_and_unpack_tensor_keep_vllms_call_and_meaning() -> None:
    items = [
        ("h", random_tensor((3, 5), torch.float16, 1)),
        ("f", random_tensor((7,), torch.float32, 2)),
        ("g", random_tensor((100,), torch.float32, 3)),
    ]
    it = iter(items)
    first = pack_tensors(it, lambda item: item[1], buffer_size_bytes=40)
    assert first is not None and first.names == ["h", "f"]  # stops after passing 40 bytes
    assert first.packed_tensor.dtype == torch.uint8 and first.packed_tensor.numel() == 30 + 28
    out = unpack_tensor(first.packed_tensor, first.names, first.shapes, first.dtypes, first.tensor_sizes)
    # "f" starts at byte 30, not a multiple of 4: vLLM's version raised here.
    for (name, tensor), (_, original) in zip(out, items):
        assert_bit_equal(tensor, original, name)
    with pytest.warns(UserWarning, match="'g' has size 200 bytes"):  # oversize: one chunk, as vLLM sends it
        second = pack_tensors(it, lambda item: item[1].to(torch.bfloat16), buffer_size_bytes=40)
    assert second is not None and second.names == ["g"] and second.dtypes == [torch.bfloat16]
    assert pack_tensors(it, lambda item: item[1], 40) is None
    with pytest.raises(ValueError, match="tensor 'x': shape \\[2\\] of torch.float32 needs 8 bytes"):
        unpack_tensor(torch.empty(8, dtype=torch.uint8), ["x"], [[2]], [torch.float32], [7])
    with pytest.raises(ValueError, match="not one weightsync can transfer"):
        unpack_tensor(torch.empty(8, dtype=torch.uint8), ["x"], [[2]], ["Tensor"], [8])  # type: ignore[list-item]


_dtypes = st.sampled_from(all_dtypes())
_shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.lists(st.tuples(_dtypes, _shapes), min_size=1, max_size=12),
    buffer_bytes=st.sampled_from([256, 512, 1024, 4096]),
    use_destinations=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_layouts_round_trip_bit_exact(layout, buffer_bytes, use_destinations, seed) -> None:  # type: ignore[no-untyped-def]
    tensors = {f"t{i}": random_tensor(shape, dtype, seed + i) for i, (dtype, shape) in enumerate(layout)}
    out = roundtrip(tensors, buffer_bytes, use_destinations)
    for name, tensor in tensors.items():
        assert_bit_equal(out[name], tensor, name)
