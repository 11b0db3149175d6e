"""Delta encoding and applying on a GPU (no Ray): the one-pass kernels (CuPy) and torch's
ops, every allowed dtype bit for bit over many versions, NaN payloads and signed zeros, a
payload that does not fit its tensor refused by name. Marked ``cuda``: skipped without a GPU."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import weightsync.core.delta.device_diff as device_module
from tests.helpers import assert_bit_equal
from tests.test_delta import mutate, random_bits, step
from weightsync.core.delta import cuda_kernels
from weightsync.core.delta.apply import apply_delta
from weightsync.core.delta.diff import Differ
from weightsync.core.delta.encoding import Kind, bits_of, layout
from weightsync.core.delta.gpu_scatter import batched_scatters, check_scatters
from weightsync.core.wire.dtypes import ALLOWED_DTYPES
from weightsync.core.wire.errors import ManifestError
from weightsync.core.wire.manifest import TensorSpec

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("no CUDA GPU", allow_module_level=True)

GPU = torch.device("cuda", 0)


@pytest.fixture(params=["kernels", "torch"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Both ways on the GPU: the CuPy kernels (where CuPy compiles them) and torch's ops."""
    if request.param == "torch":
        monkeypatch.setattr(device_module.cuda_kernels, "kernels", lambda device: None)
    elif cuda_kernels.kernels(GPU) is None:
        pytest.skip("CuPy is not installed or its compiler failed")
    yield request.param


def gpu_step(differ: Differ, spec: TensorSpec, new: torch.Tensor, base: torch.Tensor, worker: torch.Tensor) -> Kind:
    kind = step(differ, spec, new, base, worker)
    check_scatters()
    return kind


@pytest.mark.parametrize("name", sorted(ALLOWED_DTYPES))
def test_every_allowed_dtype_stays_bit_exact_on_the_gpu(name: str, engine: str) -> None:
    dtype = ALLOWED_DTYPES[name]
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    differ = Differ()
    seen = set()
    for n in (1, 13, 20_004, 300_001):
        spec = TensorSpec("t", (n,), name)
        new = random_bits(dtype, n, gen) if dtype != torch.bool else mutate(torch.zeros(n, dtype=dtype), 0.5, gen)
        base, worker = new.clone().to(GPU), new.clone().to(GPU)
        for fraction in (0.0, 0.002, 0.03, 0.2, 1.0, 0.01):
            new = mutate(new, fraction, gen)
            seen.add(gpu_step(differ, spec, new.to(GPU), base, worker))
            assert_bit_equal(base.cpu(), new, f"{name} base, {fraction}")
            assert_bit_equal(worker.cpu(), new, f"{name} worker, {fraction}")
    assert {Kind.UNCHANGED, Kind.DENSE} <= seen and seen & {Kind.INDICES, Kind.BITMASK}, seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nan_payloads_and_signed_zeros_on_the_gpu(dtype: torch.dtype, engine: str) -> None:
    n = 40_000
    spec = TensorSpec("w", (n,), str(dtype).removeprefix("torch."))
    base = torch.zeros(n, dtype=dtype, device=GPU)
    worker = base.clone()
    new = base.clone()
    bits = bits_of(new)
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    exponent = ((1 << (8 * dtype.itemsize - 1)) - 1) ^ ((1 << mantissa) - 1)
    bits[::97] = exponent | 1
    bits[1::97] = -1
    new[3::97] = -0.0
    differ = Differ()
    assert gpu_step(differ, spec, new, base, worker) is not Kind.DENSE
    assert_bit_equal(worker.cpu(), new.cpu(), "nan payloads, -0.0")
    again = new.clone()
    bits_of(again)[::97] = exponent | 3
    bits_of(again)[3::97] = 0
    gpu_step(differ, spec, again, base, worker)
    assert_bit_equal(worker.cpu(), again.cpu(), "nan -> nan, -0.0 -> +0.0")


def indices_payload(spec: TensorSpec, indices: list[int]) -> torch.Tensor:
    lay = layout(spec, Kind.INDICES, len(indices))
    payload = torch.zeros(lay.nbytes, dtype=torch.uint8, device=GPU)
    payload[: 4 * len(indices)].view(torch.int32).copy_(torch.tensor(indices, device=GPU))
    payload[lay.values_offset :].view(torch.int16).fill_(7)
    return payload


def applying(batched: bool) -> contextlib.AbstractContextManager[None]:
    """As a module sink lands a chunk (scatters launched together) or one by one."""
    return batched_scatters() if batched else contextlib.nullcontext()


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-by-one"])
def test_a_payload_outside_its_tensor_is_refused_naming_it_on_the_gpu(engine: str, batched: bool) -> None:
    good, bad = TensorSpec("layers.6.w", (4096,), "bfloat16"), TensorSpec("layers.7.w", (4096,), "bfloat16")
    dest = torch.zeros(4096, dtype=torch.bfloat16, device=GPU)
    with pytest.raises(ManifestError, match=r"layers\.7\.w") as refused:
        with applying(batched):
            apply_delta(dest, good, Kind.INDICES, 2, indices_payload(good, [1, 4095]))
            apply_delta(dest, bad, Kind.INDICES, 2, indices_payload(bad, [3, 4096]))
        check_scatters()
    assert "layers.6.w" not in str(refused.value)
    # The next sync's check counts only its own scatters.
    with applying(batched):
        apply_delta(dest, good, Kind.INDICES, 2, indices_payload(good, [0, 2]))
    check_scatters()
    assert bits_of(dest)[[0, 1, 2, 4, 4095]].tolist() == [7, 7, 7, 0, 7]


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "one-by-one"])
def test_one_sync_of_mixed_tensors_rebuilds_every_one_on_the_gpu(engine: str, batched: bool) -> None:
    """A sync as the trainer encodes it: bf16, fp16, fp32 and int32 tensors of many sizes
    (2-byte values after 4-byte ones among them) beside one the kernels do not take (odd
    length), one left unchanged and one changed throughout; every INDICES payload of the
    kernels comes out of one assembly launch, and the worker scatters them in one launch
    (``batched``) or one by one. A worker's tensor that is not contiguous is patched
    through a contiguous copy, at once, inside a batch too."""
    gen = torch.Generator().manual_seed(7)
    shapes = [
        ("emb", (3001, 64), torch.bfloat16),
        ("norm", (64,), torch.bfloat16),
        ("qkv", (192, 64), torch.float16),
        ("head", (517, 33), torch.float32),
        ("steps", (4096,), torch.int32),
        ("out", (256, 64), torch.bfloat16),  # 2-byte values after 4-byte ones
        ("odd", (1001,), torch.bfloat16),
        ("frozen", (2048,), torch.bfloat16),
        ("reset", (2048,), torch.float32),
    ]
    specs = [TensorSpec(name, shape, str(dtype).removeprefix("torch.")) for name, shape, dtype in shapes]
    names = [s.name for s in specs]
    model = [random_bits(dtype, s.numel, gen).view(s.shape) for s, (_, _, dtype) in zip(specs, shapes)]
    base = [t.to(GPU) for t in model]
    worker = [t.clone() for t in base]
    # A second worker holding the matrices column-major: each patch goes through a copy.
    strided = [t.t().contiguous().t() if t.dim() == 2 else t.clone() for t in base]
    assert not all(t.is_contiguous() for t in strided)
    differ = Differ()
    kinds: set[Kind] = set()
    for version in range(4):
        for index, spec in enumerate(specs):
            if spec.name == "reset":
                model[index] = random_bits(model[index].dtype, spec.numel, gen).view(spec.shape)
            elif spec.name != "frozen":
                model[index] = mutate(model[index], 0.02 + 0.01 * version, gen)
        diffs = differ.diff_all(specs, [t.to(GPU) for t in model], base)
        with applying(batched):
            for index, (spec, got) in enumerate(zip(specs, diffs)):
                kinds.add(got.kind)
                if got.kind is Kind.DENSE:
                    worker[index].copy_(base[index])
                    strided[index].copy_(base[index])
                elif got.payload is not None:
                    assert got.payload.numel() == layout(spec, got.kind, got.count).nbytes, spec.name
                    apply_delta(worker[index], spec, got.kind, got.count, got.payload)
                    apply_delta(strided[index], spec, got.kind, got.count, got.payload)
        check_scatters()
        for spec, held, want, mine, other in zip(specs, worker, model, base, strided):
            assert_bit_equal(held.cpu(), want, spec.name)
            assert_bit_equal(mine.cpu(), want, spec.name)
            assert_bit_equal(other.contiguous().cpu(), want, f"{spec.name}, held column-major")
        assert diffs[names.index("frozen")].kind is Kind.UNCHANGED
        assert diffs[names.index("reset")].kind is Kind.DENSE
    assert Kind.INDICES in kinds
