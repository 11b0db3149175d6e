"""The host side of a delta sync on a GPU, driven on the CPU by a stand-in for the CUDA
kernels that does what their source says: the trainer's :class:`DeviceArena` (each
tensor's span of the kernels' outputs, its kind, and the table the payload assembly reads)
and the worker's batch of scatters (the table one launch reads, and the counters that
name a payload outside its tensor). The kernels themselves run in
``tests/test_delta_cuda.py`` on a GPU; this module checks, where CI runs, the arithmetic
between them: spans of tensors the kernels found nothing in, 2-byte values after 4-byte
ones, the give-up, a payload no smaller than the tensor, an arena that fills.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import weightsync.core.delta.device_diff as device_module
from tests.test_delta import mutate, random_bits
from weightsync.core.delta import gpu_scatter
from weightsync.core.delta.apply import apply_delta
from weightsync.core.delta.cuda_source import ROWS_PER_BLOCK
from weightsync.core.delta.device_diff import DeviceArena, KernelDiff
from weightsync.core.delta.encoding import Kind, bits_of, layout
from weightsync.core.delta.gpu_scatter import batched_scatters, check_scatters, forget_scatters, scatter_on_device
from weightsync.core.wire.errors import ManifestError
from weightsync.core.wire.manifest import TensorSpec

GIVE_UP = 0.25


class CpuKernels:
    """The encoder and the payload assembly on CPU tensors, as the kernels define them: a
    tensor's changes appended at the counter in a shuffled order (the kernels' order is not
    the indices'), only those that fit the outputs written, the counter grown by all of them,
    ``after[slot]`` set to the counter's new value when anything changed; the assembly copies
    each table row's indices and values into its payload."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.assembled_rows = self.scattered_rows = 0

    def encode(
        self,
        new: torch.Tensor,
        base: torch.Tensor,
        idx: torch.Tensor,
        val: torch.Tensor,
        counter: torch.Tensor,
        after: torch.Tensor,
        slot: int,
    ) -> None:
        new_bits, base_bits = bits_of(new), bits_of(base)
        changed = (new_bits != base_bits).nonzero().view(-1)
        changed = changed[torch.randperm(changed.numel(), generator=self.gen)]
        start = int(counter[0])
        fit = max(0, min(changed.numel(), idx.numel() - start))
        idx[start : start + fit] = changed[:fit].to(torch.int32)
        val.view(new_bits.dtype)[start : start + fit] = new_bits[changed[:fit]]
        counter[0] = start + changed.numel()
        if changed.numel():
            after[slot] = counter[0]
        base_bits.copy_(new_bits)

    def assemble(self, table: torch.Tensor, blocks: int) -> None:
        rows = table.view(-1, 8).tolist()
        first = 0
        for src_idx, src_val, count, payload, offset, size, row_first, _ in rows:
            assert row_first == first, "each row's first block follows the blocks of the rows before it"
            first += -(-count // ROWS_PER_BLOCK)
            ctypes.memmove(payload, src_idx, 4 * count)
            ctypes.memmove(payload + offset, src_val, size * count)
        assert blocks == first, "the launch has one block per ROWS_PER_BLOCK elements of each row"
        self.assembled_rows += len(rows)

    def scatter_rows(self, table: torch.Tensor, blocks: int) -> None:
        first = 0
        for idx, val, count, dest, numel, size, row_first, bad in table.view(-1, 8).tolist():
            assert row_first == first, "each row's first block follows the blocks of the rows before it"
            first += -(-count // ROWS_PER_BLOCK)
            word = ctypes.c_uint16 if size == 2 else ctypes.c_uint32
            index = np.ctypeslib.as_array((ctypes.c_int32 * count).from_address(idx))
            values = np.ctypeslib.as_array((word * count).from_address(val))
            target = np.ctypeslib.as_array((word * numel).from_address(dest))
            inside = (index >= 0) & (index < numel)
            target[index[inside]] = values[inside]
            ctypes.c_uint64.from_address(bad).value += int((~inside).sum())
        assert blocks == first, "the launch has one block per ROWS_PER_BLOCK elements of each row"
        self.scattered_rows += len(table) // 8


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[CpuKernels]:
    kernels = CpuKernels(seed=3)
    monkeypatch.setattr(device_module.cuda_kernels, "kernels", lambda device: kernels)
    yield kernels
    forget_scatters()


def expected_kind(spec: TensorSpec, count: int, end: int, cap: int) -> Kind:
    if count == 0:
        return Kind.UNCHANGED
    if end > cap or count > spec.numel * GIVE_UP or layout(spec, Kind.INDICES, count).nbytes >= spec.nbytes:
        return Kind.DENSE
    return Kind.INDICES


def encode_and_apply(
    specs: list[TensorSpec], news: list[torch.Tensor], bases: list[torch.Tensor], workers: list[torch.Tensor]
) -> list[Kind]:
    """One sync through the arena: every tensor launched, then finished in a shuffled order
    (the differ finishes its kernel tensors together, whatever came between them), each
    outcome checked and applied to the worker's copy with the library's own apply."""
    arena = DeviceArena(specs, torch.device("cpu"))
    truth = [int((bits_of(n) != bits_of(b)).sum()) for n, b in zip(news, bases)]
    diffs = [KernelDiff(spec, new, base, arena, slot) for slot, (spec, new, base) in enumerate(zip(specs, news, bases))]
    order = torch.randperm(len(diffs), generator=torch.Generator().manual_seed(len(diffs))).tolist()
    outcomes = dict(zip(order, arena.finish([diffs[i] for i in order], GIVE_UP)))
    kinds, end = [], 0
    for slot, spec in enumerate(specs):
        kind, count, payload = outcomes[slot]
        end += truth[slot]
        assert kind is expected_kind(spec, truth[slot], end, arena.cap), spec.name
        if kind is Kind.DENSE:
            assert count == spec.numel and payload is None
            workers[slot].copy_(bases[slot])
        elif kind is Kind.INDICES:
            assert count == truth[slot] and payload is not None
            assert payload.numel() == layout(spec, kind, count).nbytes, spec.name
            apply_delta(workers[slot], spec, kind, count, payload)
        else:
            assert count == 0 and payload is None
        kinds.append(kind)
    for spec, new, base, worker in zip(specs, news, bases, workers):
        assert torch.equal(bits_of(base), bits_of(new)), f"{spec.name}: the base did not take the new bytes"
        assert torch.equal(bits_of(worker), bits_of(new)), f"{spec.name}: the worker's copy differs"
    return kinds


def test_mixed_dtypes_over_versions_rebuild_every_tensor_from_one_assembly(stand_in: CpuKernels) -> None:
    gen = torch.Generator().manual_seed(11)
    shapes = [
        ("a.fp32", 3000, "float32", 0.02),
        ("b.bf16", 4096, "bfloat16", 0.01),  # 2-byte values after 4-byte ones
        ("c.fp16", 512, "float16", 0.0),  # unchanged: its slot of the counter's ends stays 0
        ("d.int32", 2048, "int32", 0.03),
        ("e.bf16", 8, "bfloat16", 0.2),  # a change or two: no smaller than the tensor itself
        ("f.bf16", 1024, "bfloat16", 0.6),  # past the give-up
        ("g.fp32", 700, "float32", 0.05),
    ]
    specs = [TensorSpec(name, (n,), dtype) for name, n, dtype, _ in shapes]
    news = [random_bits(s.torch_dtype, s.numel, gen) for s in specs]
    bases = [t.clone() for t in news]
    workers = [t.clone() for t in news]
    seen: set[Kind] = set()
    for version in range(4):
        news = [
            mutate(t, fraction * (version + 1) / 2, gen) if fraction else t for t, (*_, fraction) in zip(news, shapes)
        ]
        seen.update(encode_and_apply(specs, news, bases, workers))
    assert seen == {Kind.INDICES, Kind.DENSE, Kind.UNCHANGED}
    assert stand_in.assembled_rows > 0


def test_tensors_past_a_full_arena_go_dense_and_the_ones_before_stay_deltas(stand_in: CpuKernels) -> None:
    specs = [TensorSpec(f"t{i}", (4096,), "bfloat16") for i in range(4)]
    gen = torch.Generator().manual_seed(5)
    bases = [random_bits(torch.bfloat16, 4096, gen) for _ in specs]
    workers = [t.clone() for t in bases]
    arena_cap = DeviceArena(specs, torch.device("cpu")).cap  # 1024: a sixteenth of the elements
    news = []
    for i, base in enumerate(bases):  # 600, then 600 more (past the cap), then 10 and 0
        new = base.clone()
        bits_of(new)[: (600, 600, 10, 0)[i]] ^= 1
        news.append(new)
    kinds = encode_and_apply(specs, news, bases, workers)
    assert 600 < arena_cap < 1200
    assert kinds == [Kind.INDICES, Kind.DENSE, Kind.DENSE, Kind.UNCHANGED]


def test_a_batch_of_scatters_lands_every_payload_in_one_launch_and_names_the_one_outside(
    stand_in: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(8)
    specs = [TensorSpec("w.bf16", (5000,), "bfloat16"), TensorSpec("w.fp32", (3000,), "float32")]
    specs.append(TensorSpec("w.empty", (64,), "bfloat16"))
    for round_ in range(2):
        dests = [random_bits(s.torch_dtype, s.numel, gen) for s in specs]
        wanted = [d.clone() for d in dests]
        with batched_scatters():
            for spec, dest, want in zip(specs, dests, wanted):
                count = 0 if spec.name == "w.empty" else spec.numel // 7
                idx = torch.randperm(spec.numel, generator=gen)[:count].to(torch.int32)
                values = bits_of(random_bits(spec.torch_dtype, count, gen))
                bits_of(want)[idx.long()] = values
                assert scatter_on_device(dest, spec, idx.view(torch.uint8), values)
            assert stand_in.scattered_rows == 3 * round_, "nothing launched before the batch ends"
        check_scatters()
        assert all(torch.equal(bits_of(d), bits_of(w)) for d, w in zip(dests, wanted))
    # Past FLUSH_ELEMENTS queued, a batch launches what it holds before it ends.
    monkeypatch.setattr(gpu_scatter, "FLUSH_ELEMENTS", 1000)
    before = stand_in.scattered_rows
    dest = torch.zeros(3000, dtype=torch.float32)
    with batched_scatters():
        for first in (0, 600, 1200):
            idx = torch.arange(first, first + 600, dtype=torch.int32)
            scatter_on_device(dest, specs[1], idx.view(torch.uint8), bits_of(idx.float()))
        assert stand_in.scattered_rows == before + 2, "the first two payloads launched once past 1000 elements"
    assert stand_in.scattered_rows == before + 3
    check_scatters()
    assert torch.equal(dest[:1800], torch.arange(1800, dtype=torch.float32)) and not dest[1800:].any()
    bad = TensorSpec("layers.3.w", (100,), "float32")
    with pytest.raises(ManifestError, match=r"layers\.3\.w") as refused:
        with batched_scatters():
            for spec, indices in ((specs[1], [0, 2999]), (bad, [5, 100, -1])):
                # Dropped here before the batch launches: the batch keeps it alive until then.
                dest = torch.zeros(spec.numel, dtype=spec.torch_dtype)
                values = torch.ones(len(indices), dtype=torch.int32)
                scatter_on_device(dest, spec, torch.tensor(indices, dtype=torch.int32).view(torch.uint8), values)
        check_scatters()
    assert "2 outside" in str(refused.value) and "w.fp32" not in str(refused.value)
