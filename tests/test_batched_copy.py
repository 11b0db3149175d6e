"""The one-launch copy kernel behind direct writes on a GPU: bit-exact on every pair it
takes, and the pairs it cannot take (casts, odd lengths, unaligned or strided sources)
still copied. Marked ``cuda``; run on the H200 test machine."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import random_tensor
from weightsync.transport.batched_copy import BatchedCopier, plan_key

pytestmark = pytest.mark.cuda


def _copier() -> BatchedCopier:
    pytest.importorskip("cupy")
    copier = BatchedCopier.create(torch.device("cuda", 0))
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
