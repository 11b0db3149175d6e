"""The wire contract: dtype allow-list, Manifest validation and handshake errors."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest
import torch

from weightsync.core.wire import (
    ALLOWED_DTYPES,
    Manifest,
    ManifestError,
    SettingsError,
    TensorSpec,
    UnsupportedDtypeError,
    dtype_from_name,
    dtype_name,
)


def specs() -> list[TensorSpec]:
    return [TensorSpec("a", (3, 5), "float16"), TensorSpec("b", (7,), "float32"), TensorSpec("c", (), "int64")]


def test_allow_list_holds_real_dtypes_of_every_family() -> None:
    for name in ("bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64", "complex64"):
        assert ALLOWED_DTYPES[name] is getattr(torch, name)
    assert any(name.startswith("float8") for name in ALLOWED_DTYPES)
    assert all(isinstance(d, torch.dtype) for d in ALLOWED_DTYPES.values())
    for name, dtype in ALLOWED_DTYPES.items():
        assert dtype_from_name(name) is dtype
        assert dtype_name(dtype) == name


@pytest.mark.parametrize("hostile", ["Tensor", "load", "__class__", "float", "nn", "complex32", "", "float32 "])
def test_dtype_names_outside_the_allow_list_are_refused_by_name(hostile: str) -> None:
    with pytest.raises(UnsupportedDtypeError, match=repr(hostile).replace("\\", "\\\\").replace("(", r"\(")):
        dtype_from_name(hostile)


def test_tensor_spec_refuses_a_hostile_dtype_name() -> None:
    with pytest.raises(UnsupportedDtypeError, match="'save'"):
        TensorSpec("w", (2,), "save")


def test_tensor_spec_refuses_bad_shapes() -> None:
    with pytest.raises(ManifestError, match="w.*non-negative"):
        TensorSpec("w", (2, -1), "float32")


def test_manifest_pickles_and_compares_by_value() -> None:
    m = Manifest.build(specs(), buffer_bytes=1024, num_buffers=2)
    clone = pickle.loads(pickle.dumps(m))
    assert clone == m
    assert clone is not m
    assert Manifest.build(specs(), buffer_bytes=2048) != m
    clone.validate()


def test_manifest_lists_every_mismatch_by_name_in_one_error() -> None:
    m = Manifest.build(specs())
    local = [
        TensorSpec("a", (5, 3), "float16"),  # shape
        TensorSpec("b", (7,), "bfloat16"),  # dtype
        TensorSpec("extra", (1,), "float32"),  # unexpected; "c" is missing
    ]
    with pytest.raises(ManifestError) as info:
        m.check_against(local, "worker-3")
    text = str(info.value)
    assert "worker-3" in text and "4 problem" in text
    assert "a: shape [3, 5] on the trainer, [5, 3] on worker-3" in text
    assert "b: dtype float32 on the trainer, bfloat16 on worker-3" in text
    assert "c: sent by the trainer but missing on worker-3" in text
    assert "extra: present on worker-3 but not sent by the trainer" in text


def test_manifest_refuses_empty_models_and_duplicate_names() -> None:
    with pytest.raises(ManifestError, match="no parameters"):
        Manifest.build([])
    with pytest.raises(ManifestError, match="duplicate tensor names.*a"):
        Manifest.build([TensorSpec("a", (1,), "float32"), TensorSpec("a", (2,), "float32")])


def test_manifest_refuses_bad_buffer_settings() -> None:
    with pytest.raises(SettingsError, match="alignment must be a power of two"):
        Manifest.build(specs(), alignment=100)
    with pytest.raises(SettingsError, match="buffer_bytes must be"):
        Manifest.build(specs(), buffer_bytes=8)
    with pytest.raises(SettingsError, match="num_buffers must be a positive"):
        Manifest.build(specs(), num_buffers=0)


def test_validate_refuses_another_protocol_version_and_a_tampered_plan() -> None:
    m = Manifest.build(specs(), buffer_bytes=1024)
    other = replace(m, protocol_version=99)
    with pytest.raises(ManifestError, match="protocol version mismatch: the trainer speaks 99"):
        other.validate()
    tampered = replace(m, chunks=m.chunks[:0])
    with pytest.raises(ManifestError, match="chunk plan"):
        tampered.validate()


def test_buffer_expectations_name_the_worker_and_the_setting() -> None:
    m = Manifest.build(specs(), buffer_bytes=4096, num_buffers=2)
    m.check_buffer_expectations("worker-1", buffer_bytes=4096)
    with pytest.raises(
        ManifestError, match="worker-1.*buffer_bytes: trainer uses 4096, worker-1 was configured with 8192"
    ):
        m.check_buffer_expectations("worker-1", buffer_bytes=8192)
    with pytest.raises(ManifestError, match="num_buffers: trainer uses 2, w was configured with 3"):
        m.check_buffer_expectations("w", num_buffers=3)
