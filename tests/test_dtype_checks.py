"""Dtypes refused where they are first seen, naming the tensor or setting: a model tensor
of a dtype weightsync cannot send, a trainer's ``wire_dtype`` that is not a floating dtype,
and a vLLM checkpoint's stored dtypes (read from its safetensors headers, no vLLM needed)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

from weightsync import WeightSender, WeightSyncError
from weightsync.compat.packed_ipc import packed_ipc_producer
from weightsync.core.wire import SettingsError, TensorSpec, UnsupportedDtypeError
from weightsync.glue.trainer_mixin import TrainerMixin
from weightsync.vllm.checkpoint import checkpoint_specs


def model_with_a_complex32_buffer() -> nn.Module:
    model = nn.Linear(4, 4)
    model.register_buffer("scale_q", torch.zeros(3, dtype=torch.complex32))
    return model


def test_a_model_tensor_of_a_dtype_that_cannot_travel_is_named() -> None:
    sender = WeightSender(model=model_with_a_complex32_buffer())
    with pytest.raises(UnsupportedDtypeError, match="'scale_q'.*complex32"):
        sender.specs()
    with pytest.raises(UnsupportedDtypeError, match="'w'.*'save'"):
        TensorSpec("w", (2,), "save")


def test_the_packed_producer_names_a_tensor_it_cannot_send() -> None:
    pairs = [("ok", torch.randn(4)), ("scale_q", torch.zeros(3, dtype=torch.complex32))]
    with pytest.raises(UnsupportedDtypeError, match="'scale_q'"):
        list(packed_ipc_producer(iter(pairs), "cpu", lambda item: item[1], 1 << 10))


@pytest.mark.parametrize(
    ("wire_dtype", "named"),
    [("bfloat16", "pass torch.bfloat16"), (torch.int8, "got torch.int8"), (torch.bool, "got torch.bool"), (2, "got 2")],
)
def test_a_wire_dtype_that_is_not_a_floating_dtype_is_refused_naming_the_setting(
    wire_dtype: object, named: str
) -> None:
    with pytest.raises(SettingsError, match="wire_dtype") as err:
        WeightSender(model=nn.Linear(4, 4), wire_dtype=wire_dtype)  # type: ignore[arg-type]
    assert named in str(err.value), err.value


def test_a_trainer_mixin_with_a_string_wire_dtype_fails_its_first_call_naming_the_setting() -> None:
    class Trainer(TrainerMixin):
        def __init__(self) -> None:
            self.model = nn.Linear(4, 4)
            self.wire_dtype = "bfloat16"

    outcome = Trainer().ws_describe()  # the coordinator's first call to a trainer
    assert (outcome.status.value, outcome.error) == ("failed", "SettingsError"), outcome
    assert "wire_dtype" in outcome.message and "torch.bfloat16" in outcome.message, outcome.message


def test_a_floating_wire_dtype_is_taken() -> None:
    sender = WeightSender(model=nn.Linear(4, 4), wire_dtype=torch.bfloat16)
    assert {s.dtype for s in sender.specs()} == {"bfloat16"}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    """A safetensors file's header for ``{name: (stored dtype, shape, bytes per element)}``,
    with zeroed data: checkpoint_specs reads headers only."""
    header, offset = {}, 0
    for name, (dtype, shape, itemsize) in tensors.items():
        size = itemsize * int(torch.tensor(shape).prod().item()) if shape else itemsize
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def test_an_fp8_checkpoint_is_read_with_its_fp8_weights_and_floating_scales(tmp_path: Path) -> None:
    write_safetensors(
        tmp_path / "model.safetensors",
        {
            "q.weight": ("F8_E4M3", [8, 4], 1),
            "q.weight_scale": ("F32", [], 4),
            "k.weight": ("F8_E5M2", [8, 4], 1),
            "norm.weight": ("BF16", [4], 2),
            "ids": ("U16", [3], 2),
        },
    )
    specs = {s.name: (s.dtype, s.shape) for s in checkpoint_specs(tmp_path, torch.bfloat16)}
    assert specs == {
        "q.weight": ("float8_e4m3fn", (8, 4)),
        "q.weight_scale": ("bfloat16", ()),
        "k.weight": ("float8_e5m2", (8, 4)),
        "norm.weight": ("bfloat16", (4,)),
        "ids": ("uint16", (3,)),
    }


def test_a_checkpoint_dtype_that_cannot_travel_is_named_with_its_file_and_tensor(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model-00002.safetensors", {"ok": ("F32", [2], 4), "packed": ("F4", [8], 1)})
    with pytest.raises(WeightSyncError, match="model-00002.safetensors.*'packed'.*F4.*expected_specs="):
        checkpoint_specs(tmp_path, torch.bfloat16)


def test_a_hub_model_id_is_read_from_the_local_cache_at_its_revision(tmp_path: Path) -> None:
    """vLLM keeps a hub id as the engine's ``model``; its files are in the Hugging Face cache."""
    repo = tmp_path / "hub" / "models--acme--tiny"
    for commit, rows in (
        ("1111111111111111111111111111111111111111", 4),
        ("2222222222222222222222222222222222222222", 8),
    ):
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True)
        write_safetensors(snapshot / "model.safetensors", {"embed.weight": ("BF16", [rows, 2], 2)})
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("2222222222222222222222222222222222222222")
    cache = str(tmp_path / "hub")

    def rows(revision: str | None) -> int:
        (spec,) = checkpoint_specs("acme/tiny", torch.bfloat16, revision, cache)
        return spec.shape[0]

    assert rows(None) == 8  # main
    assert rows("1111111111111111111111111111111111111111") == 4
    with pytest.raises(WeightSyncError, match="acme/other.*local cache.*expected_specs="):
        checkpoint_specs("acme/other", torch.bfloat16, None, cache)
    with pytest.raises(WeightSyncError, match="no-such-folder.*neither a folder"):
        checkpoint_specs(str(tmp_path / "no-such-folder"), torch.bfloat16, None, cache)
