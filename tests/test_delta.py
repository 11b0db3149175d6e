"""Delta encoding without Ray: every allowed dtype bit for bit over many versions (numba's
loops and torch's ops alike), NaN payloads, -0.0/+0.0, the header and payload checks, the
sinks' patches, a worker that holds other bytes refusing a delta."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import weightsync.core.delta.apply as apply_module
import weightsync.core.delta.cpu_diff as cpu_diff_module
import weightsync.core.delta.diff as diff_module
from tests.helpers import MixedModel, assert_bit_equal
from weightsync.core.delta.apply import apply_delta
from weightsync.core.delta.diff import Differ
from weightsync.core.delta.encoder import DeltaEncoder
from weightsync.core.delta.encoding import Kind, bits_of, encode_code, layout
from weightsync.core.delta.header import Mode, SyncHeader, plan_payload
from weightsync.core.delta.landing import DeltaReceiving
from weightsync.core.sinks import LoadWeightsSink, ModuleSink, module_tensors
from weightsync.core.wire.dtypes import ALLOWED_DTYPES
from weightsync.core.wire.errors import ManifestError, WeightSyncError
from weightsync.core.wire.manifest import Manifest, TensorSpec


@pytest.fixture(params=["numba", "torch"])
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Both ways of encoding and applying: numba's loops (where it imports) and torch ops."""
    if request.param == "torch":
        monkeypatch.setattr(diff_module, "kernels", lambda: None)
        monkeypatch.setattr(cpu_diff_module, "kernels", lambda: None)
        monkeypatch.setattr(apply_module, "kernels", lambda: None)
    elif diff_module.kernels() is None:
        pytest.skip("numba is not installed")
    yield request.param


def random_bits(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` elements of random bit patterns (NaNs with any payload, infinities, -0.0)."""
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return raw.view(torch.bool) if n else torch.empty(0, dtype=torch.bool)
    return raw.view(dtype)


def mutate(tensor: torch.Tensor, fraction: float, gen: torch.Generator) -> torch.Tensor:
    """A copy with about ``fraction`` of its elements given new random bit patterns."""
    out = tensor.clone()
    picked = torch.rand(tensor.numel(), generator=gen) < fraction
    fresh = random_bits(tensor.dtype, tensor.numel(), gen)
    if tensor.dtype == torch.bool:
        fresh = fresh.view(torch.uint8).bitwise_and(1).view(torch.bool)
    bits_of(out)[picked] = bits_of(fresh)[picked]
    return out


def step(differ: Differ, spec: TensorSpec, new: torch.Tensor, base: torch.Tensor, worker: torch.Tensor) -> Kind:
    got = differ.diff(spec, new, base)
    if got.kind is Kind.DENSE:
        worker.copy_(base)
    elif got.kind is not Kind.UNCHANGED:
        assert got.payload is not None and got.payload.numel() == layout(spec, got.kind, got.count).nbytes
        apply_delta(worker, spec, got.kind, got.count, got.payload)
    return got.kind


@pytest.mark.parametrize("name", sorted(ALLOWED_DTYPES))
def test_every_allowed_dtype_stays_bit_exact_over_many_versions(name: str, engine: str) -> None:
    dtype = ALLOWED_DTYPES[name]
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    differ = Differ(block=4096)  # several blocks, and a last one that fills no whole word
    seen = set()
    for n in (1, 13, 20_003):
        spec = TensorSpec("t", (n,), name)
        new = random_bits(dtype, n, gen) if dtype != torch.bool else mutate(torch.zeros(n, dtype=dtype), 0.5, gen)
        base, worker = new.clone(), new.clone()
        for fraction in (0.0, 0.002, 0.03, 0.2, 1.0, 0.01):
            new = mutate(new, fraction, gen)
            seen.add(step(differ, spec, new, base, worker))
            assert_bit_equal(base, new, f"{name} base, {fraction}")
            assert_bit_equal(worker, new, f"{name} worker, {fraction}")
    assert {Kind.UNCHANGED, Kind.DENSE} <= seen and seen & {Kind.INDICES, Kind.BITMASK}, seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_nan_payloads_and_signed_zeros_travel_as_their_bit_patterns(dtype: torch.dtype, engine: str) -> None:
    n = 5000
    spec = TensorSpec("w", (n,), str(dtype).removeprefix("torch."))
    base = torch.zeros(n, dtype=dtype)
    worker = base.clone()
    new = base.clone()
    bits = bits_of(new)
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}[dtype]
    exponent = ((1 << (8 * dtype.itemsize - 1)) - 1) ^ ((1 << mantissa) - 1)  # all ones, sign clear
    bits[::97] = exponent | 1  # a NaN with payload 1
    bits[1::97] = exponent | 5  # another payload
    bits[2::97] = -1  # all ones: a negative NaN
    new[3::97] = -0.0  # sign flips only
    differ = Differ(block=1024)
    assert step(differ, spec, new, base, worker) is not Kind.DENSE
    assert_bit_equal(worker, new, "nan payloads")
    nan2 = new.clone()
    bits_of(nan2)[::97] = exponent | 3  # NaN -> another NaN: a changed bit pattern
    bits_of(nan2)[3::97] = 0  # -0.0 -> +0.0
    step(differ, spec, nan2, base, worker)
    assert_bit_equal(worker, nan2, "nan -> nan, -0.0 -> +0.0")


def test_fp32_master_to_bf16_wire_matches_torchs_cast_with_nans(engine: str) -> None:
    gen = torch.Generator().manual_seed(3)
    master = torch.randn(50_000, generator=gen) * 0.02
    spec = TensorSpec("w", (50_000,), "bfloat16")
    base = master.to(torch.bfloat16)
    worker = base.clone()
    differ = Differ(block=8192)
    for k in range(4):
        master += torch.randn(50_000, generator=gen) * 1e-5
        if k == 2:
            master[::777] = float("nan")
        step(differ, spec, master, base, worker)
        assert_bit_equal(worker, base, f"step {k}")
    assert_bit_equal(base[1:777], master[1:777].to(torch.bfloat16), "the rounding is torch's")


def test_a_dense_ish_tensor_is_sent_dense_and_the_base_still_takes_it() -> None:
    spec = TensorSpec("w", (40_000,), "bfloat16")
    base = torch.randn(40_000).to(torch.bfloat16)
    new = (base.float() + 1).to(torch.bfloat16)
    got = Differ(block=4096).diff(spec, new, base)
    assert got.kind is Kind.DENSE and got.payload is None
    assert_bit_equal(base, new)


def test_a_payload_that_does_not_fit_its_tensor_is_refused_naming_it(engine: str) -> None:
    spec = TensorSpec("layers.0.w", (100,), "float32")
    lay = layout(spec, Kind.INDICES, 2)
    payload = torch.zeros(lay.nbytes, dtype=torch.uint8)
    payload[:8].view(torch.int32).copy_(torch.tensor([3, 100]))
    with pytest.raises(ManifestError, match=r"layers\.0\.w"):
        apply_delta(torch.zeros(100), spec, Kind.INDICES, 2, payload)
    mask = layout(spec, Kind.BITMASK, 3)
    payload = torch.zeros(mask.nbytes, dtype=torch.uint8)
    payload[0] = 0b11  # two bits for three values
    with pytest.raises(ManifestError, match=r"layers\.0\.w"):
        apply_delta(torch.zeros(100), spec, Kind.BITMASK, 3, payload)
    with pytest.raises(ManifestError, match=r"layers\.0\.w"):
        plan_payload(Manifest.build([spec]), (encode_code(Kind.INDICES, 101),))


def test_a_header_of_another_shape_or_kind_is_refused() -> None:
    manifest = Manifest.build([TensorSpec("w", (10,), "float32")])
    good = SyncHeader(Mode.DELTA, 5, 6, (encode_code(Kind.INDICES, 2),)).to_tensor(manifest, torch.device("cpu"))
    assert SyncHeader.from_tensor(good, manifest, "w0").codes == (encode_code(Kind.INDICES, 2),)
    bad = good.clone()
    bad[:8] = 0
    with pytest.raises(ManifestError, match="w0.*not a delta header"):
        SyncHeader.from_tensor(bad, manifest, "w0")


def test_a_worker_that_holds_other_bytes_or_none_refuses_a_delta_naming_itself() -> None:
    manifest = Manifest.build([TensorSpec("w", (10,), "float32")], delta=True)
    raw = SyncHeader(Mode.DELTA, 7, 8, (encode_code(Kind.INDICES, 1),)).to_tensor(manifest, torch.device("cpu"))
    sink = ModuleSink(nn.Linear(1, 1))
    for held in (None, 9):
        with pytest.raises(WeightSyncError, match="dirty-worker"):
            DeltaReceiving(sink, manifest, held, "dirty-worker").open(raw)
    dense = SyncHeader(Mode.DENSE, 0, 8).to_tensor(manifest, torch.device("cpu"))
    landing = DeltaReceiving(sink, manifest, None, "dirty-worker")
    assert landing.open(dense) == (manifest, sink) and not landing.took_delta


def _sync(encoder: DeltaEncoder, manifest: Manifest, trainer: nn.Module, sink: Any, held: int | None) -> bool:
    """One sync through the encoder and a worker's DeltaReceiving, with the payloads handed
    over as a transport's unpack would; whether it was a delta."""
    tensors = [t for _, t in module_tensors(trainer)]
    holds = (("w", held),) if held else ()
    prepared = encoder.prepare(manifest, tensors, False, torch.device("cpu"), holds)
    header, _, sources = prepared.for_peers(["w"])
    receiving = DeltaReceiving(sink, manifest, held, "w")
    target_manifest, landing = receiving.open(header.to_tensor(manifest, torch.device("cpu")))
    if target_manifest is not None:
        destinations = landing.destinations(target_manifest)
        handed = []
        for spec, dest, tensor in zip(target_manifest.specs, destinations, sources):
            wire = tensor.to(spec.torch_dtype)
            if dest is not None:
                dest.copy_(wire)
            else:
                handed.append((spec.name, wire.clone()))
        landing.consume(handed)
    receiving.finish()
    prepared.complete()
    return receiving.took_delta


@pytest.mark.parametrize("kind", ["module", "load_weights"])
def test_sinks_apply_deltas_bit_exact_and_a_load_weights_sink_rebuilds_from_its_own_copy(kind: str) -> None:
    trainer, worker = MixedModel(seed=0, big=700), MixedModel(seed=1, big=700)
    loaded: list[str] = []

    def load_weights(items: Any) -> None:
        held = dict(module_tensors(worker))
        for name, tensor in items:
            loaded.append(name)
            held[name].data.copy_(tensor)

    sink: Any = ModuleSink(worker) if kind == "module" else LoadWeightsSink(load_weights)
    manifest = Manifest.build([TensorSpec.of(n, t) for n, t in module_tensors(trainer)], delta=True)
    if kind == "load_weights":
        sink.keep_base(True)
    encoder = DeltaEncoder()
    token = None
    gen = torch.Generator().manual_seed(0)
    deltas = []
    for version in range(6):
        with torch.no_grad():
            for _, t in module_tensors(trainer):
                t.copy_(mutate(t.detach(), 0.02 if version else 1.0, gen))
        loaded.clear()
        deltas.append(_sync(encoder, manifest, trainer, sink, token))
        token = encoder.base.token
        for (name, a), (_, b) in zip(module_tensors(worker), module_tensors(trainer)):
            assert_bit_equal(a.detach(), b.detach(), f"{name} at version {version}")
    assert deltas[0] is False and all(deltas[1:])
    if kind == "load_weights":  # only the changed tensors are loaded in a delta sync
        assert "empty" not in loaded and "big" in loaded
