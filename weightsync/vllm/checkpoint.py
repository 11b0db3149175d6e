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

import torch

from weightsync import TensorSpec, WeightSyncError


def checkpoint_specs(model_dir: str | Path, dtype: torch.dtype) -> list[TensorSpec]:
    """One spec per tensor in ``model_dir``'s ``*.safetensors`` files; floating tensors take
    ``dtype`` (the engine's, which is what the trainer must send)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
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
            floating = entry["dtype"] in ("F64", "F32", "F16", "BF16")
            wire = dtype if floating else _INT_DTYPES[entry["dtype"]]
            specs.append(TensorSpec.of(name, torch.empty(entry["shape"], dtype=wire, device="meta")))
    return specs


_INT_DTYPES = {
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
