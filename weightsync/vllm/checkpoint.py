"""What a vLLM engine expects from the trainer: its checkpoint's tensors, by name.

vLLM's model fuses and shards as it loads (q/k/v into ``qkv_proj``, gate/up into
``gate_up_proj``), so its own parameters cannot be compared with a trainer's Hugging Face
names. The checkpoint it was started from can: its safetensors headers list every tensor
(name, shape) without reading the data. The handshake then refuses a trainer whose model
differs, naming each tensor, before any byte moves.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch

from weightsync import TensorSpec, WeightSyncError
from weightsync.core.wire.dtypes import ALLOWED_DTYPES


def checkpoint_specs(
    model: str | Path, dtype: torch.dtype, revision: str | None = None, cache_dir: str | None = None
) -> list[TensorSpec]:
    """One spec per tensor in the ``*.safetensors`` files of ``model`` (the engine's
    ``model``: a folder, or a Hugging Face hub id, read from the local cache at
    ``revision`` where the engine's start put it); floating tensors take ``dtype`` (the
    engine's, which is what the trainer must send)."""
    model_dir = checkpoint_folder(model, revision, cache_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightSyncError(
            f"{model_dir}: no *.safetensors files to read the expected tensors from; pass expected_specs= "
            "or check_model=False to VLLMWorker"
        )
    specs = []
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            stored = entry["dtype"]
            if stored in _CAST_TO_ENGINE:
                wire = dtype
            elif stored in _KEPT:
                wire = _KEPT[stored]
            else:
                raise WeightSyncError(
                    f"{path}: tensor {name!r} is stored as {stored}, a dtype weightsync cannot send "
                    f"(it sends {', '.join(sorted([*_CAST_TO_ENGINE, *_KEPT]))}); pass expected_specs= "
                    "or check_model=False to VLLMWorker"
                )
            specs.append(TensorSpec.of(name, torch.empty(entry["shape"], dtype=wire, device="meta")))
    return specs


def engine_specs(name: str, vllm_config: Any) -> list[TensorSpec]:
    """What the engine ``name`` expects, read from the checkpoint it started from
    (``vllm_config``: a running engine's, where vLLM has resolved the model's dtype)."""
    dtype = vllm_config.model_config.dtype
    if not isinstance(dtype, torch.dtype):
        raise WeightSyncError(f"{name}: vLLM reports model dtype {dtype!r}, not a torch dtype")
    model = vllm_config.model_config
    return checkpoint_specs(str(model.model), dtype, model.revision, vllm_config.load_config.download_dir)


def checkpoint_folder(model: str | Path, revision: str | None = None, cache_dir: str | None = None) -> Path:
    """``model`` when it is a folder; else the folder of the hub id ``model`` in the local
    Hugging Face cache (nothing is downloaded: the engine fetched it as it started)."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(model), revision=revision, cache_dir=cache_dir, local_files_only=True))
    except (HFValidationError, LocalEntryNotFoundError) as exc:
        raise WeightSyncError(
            f"{model}: neither a folder nor a Hugging Face model in the local cache ({type(exc).__name__}), so "
            "there are no *.safetensors files to read the expected tensors from; pass expected_specs= or "
            "check_model=False to VLLMWorker"
        ) from exc


#: Floating checkpoint dtypes, which the engine loads as its own dtype.
_CAST_TO_ENGINE = ("F64", "F32", "F16", "BF16")

#: Checkpoint dtypes the engine keeps as they are stored: integers, and the float8 and
#: complex tensors of quantized checkpoints (their scales are ordinary floating tensors).
_KEPT = {
    name: ALLOWED_DTYPES[wire]
    for name, wire in (
        ("I64", "int64"),
        ("I32", "int32"),
        ("I16", "int16"),
        ("I8", "int8"),
        ("U64", "uint64"),
        ("U32", "uint32"),
        ("U16", "uint16"),
        ("U8", "uint8"),
        ("BOOL", "bool"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
        ("F8_E8M0", "float8_e8m0fnu"),
        ("C64", "complex64"),
    )
    if wire in ALLOWED_DTYPES  # this torch's, on weightsync's allow-list
}
