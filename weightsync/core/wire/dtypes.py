"""The dtype allow-list: which dtypes may travel, by wire name.

Built from this torch's real dtypes only, so a name received over the wire can never
resolve to an arbitrary ``torch`` attribute (``getattr(torch, name)`` would).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightsync.core.wire.errors import UnsupportedDtypeError

_CANDIDATES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "complex64",
    "complex128",
)

ALLOWED_DTYPES: Mapping[str, torch.dtype] = {
    name: getattr(torch, name) for name in _CANDIDATES if isinstance(getattr(torch, name, None), torch.dtype)
}
_NAME_OF_DTYPE = {dtype: name for name, dtype in ALLOWED_DTYPES.items()}


def dtype_from_name(name: str) -> torch.dtype:
    """Resolve a wire dtype name through the allow-list, refusing anything else."""
    if not isinstance(name, str) or name not in ALLOWED_DTYPES:
        raise UnsupportedDtypeError(
            f"dtype {name!r} is not one weightsync can transfer; allowed: {', '.join(sorted(ALLOWED_DTYPES))}"
        )
    return ALLOWED_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; refuses dtypes outside the allow-list."""
    try:
        return _NAME_OF_DTYPE[dtype]
    except KeyError:
        raise UnsupportedDtypeError(
            f"dtype {dtype} cannot be transferred; allowed: {', '.join(sorted(ALLOWED_DTYPES))}"
        ) from None
