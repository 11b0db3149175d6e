"""The one-launch copy kernel behind direct writes on a GPU: bit-exact on every pair it
takes, and the pairs it cannot take (casts, odd lengths, unaligned or strided sources)
still copied. The kernel tests are marked ``cuda`` (run on the H200 test machine); what a
plan is keyed on, and the copier's settings, are checked on a CPU too."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import random_tensor
from weightsync.mechanisms.batched_copy import BatchedCopier, plan_key


def _copier(threads: int = 256, unit_vectors: int = 1024) -> BatchedCopier:
    pytest.importorskip("cupy")
    copier = BatchedCopier.create(torch.device("cuda", 0), threads, unit_vectors)
    assert copier is not None, "CuPy is installed but the batched copy kernel did not compile"
    return copier


def _pairs() -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    cuda = torch.device("cuda", 0)
    big = random_tensor((3, 700_004), torch.float32, 1).to(cuda)  # many blocks, last one partial
    sources = [
        big,
        random_tensor((4096,), torch.bfloat16, 2).to(cuda),  # exactly one 8 KiB row
        random_tensor((7,), torch.float16, 3).to(cuda),  # 14 bytes: not a multiple of 16
        random_tensor((1 << 17,), torch.float32, 4).to(cuda)[1:],  # 4-byte aligned only
        random_tensor((64, 48), torch.float32, 5).to(cuda).t(),  # strided
        random_tensor((1000, 33), torch.float32, 6).to(cuda),  # cast to bf16 on the way
        random_tensor((128,), torch.uint8, 7).to(cuda),
        random_tensor((16, 16), torch.int64, 8).to(cuda),
    ]
    destinations: list[torch.Tensor | None] = []
    for index, source in enumerate(sources):
        dtype = torch.bfloat16 if index == 5 else source.dtype
        destinations.append(torch.full(source.shape, 3, dtype=dtype, device=cuda))
    destinations.insert(2, None)  # a spec with nothing to copy
    sources.insert(2, torch.empty(0, device=cuda))
    return destinations, sources


@pytest.mark.cuda
def test_every_pair_arrives_bit_exact_and_only_the_kernels_pairs_go_through_it() -> None:
    copier = _copier()
    destinations, sources = _pairs()
    plan = copier.plan(destinations, sources)
    assert plan.rows == 4  # big, the 8 KiB row, uint8, int64
    assert sorted(plan.leftovers) == [3, 4, 5, 6]  # odd length, unaligned, strided, cast
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    copier.run(plan, destinations, sources, stream)
    stream.synchronize()
    for index, (destination, source) in enumerate(zip(destinations, sources)):
        if destination is None:
            continue
        assert torch.equal(destination, source.to(destination.dtype)), f"pair {index} differs"


@pytest.mark.cuda
def test_a_plan_is_rebuilt_when_a_source_moves_and_the_new_bytes_arrive() -> None:
    copier = _copier()
    destinations, sources = _pairs()
    plan = copier.plan(destinations, sources)
    stream = torch.cuda.current_stream()
    copier.run(plan, destinations, sources, stream)
    sources[0] = random_tensor(tuple(sources[0].shape), torch.float32, 99).cuda()
    assert plan_key(sources) != plan.key
    plan = copier.plan(destinations, sources)
    copier.run(plan, destinations, sources, stream)
    torch.cuda.synchronize()
    assert torch.equal(destinations[0], sources[0])


@pytest.mark.cuda
@pytest.mark.parametrize(("threads", "unit_vectors"), [(32, 1), (1024, 1024), (256, 3)])
def test_other_block_shapes_copy_the_same_bytes(threads: int, unit_vectors: int) -> None:
    copier = _copier(threads, unit_vectors)
    destinations, sources = _pairs()
    plan = copier.plan(destinations, sources)
    copier.run(plan, destinations, sources, torch.cuda.current_stream())
    torch.cuda.synchronize()
    for index, (destination, source) in enumerate(zip(destinations, sources)):
        if destination is not None:
            assert torch.equal(destination, source.to(destination.dtype)), f"pair {index} differs"


def test_plan_key_changes_when_a_source_gets_new_storage_shape_or_dtype() -> None:
    weight = random_tensor((8, 6), torch.float32, 1)
    bias = random_tensor((6,), torch.float32, 2)
    key = plan_key([weight, bias])
    assert plan_key([weight, bias]) == key
    changed = [
        [random_tensor((8, 6), torch.float32, 3), bias],  # new storage, same shape
        [weight.view(6, 8), bias],  # same storage, new shape
        [weight.view(torch.int32), bias],  # same storage, new dtype
        [weight.t(), bias],  # same storage, new strides
    ]
    for index, sources in enumerate(changed):
        assert plan_key(sources) != key, f"change {index} kept the key"


@pytest.mark.parametrize(
    ("threads", "unit_vectors", "message"),
    [(100, 1024, "multiple of 32 from 32 to 1024, got 100"), (2048, 1024, "got 2048"), (256, 0, "at least 1, got 0")],
)
def test_copier_settings_out_of_range_are_refused_by_name(threads: int, unit_vectors: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchedCopier.create(torch.device("cpu"), threads, unit_vectors)


def test_no_copier_off_cuda() -> None:
    assert BatchedCopier.create(torch.device("cpu")) is None
