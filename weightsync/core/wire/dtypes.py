"""The dtype allow-list: which dtypes may travel, by wire name.

Built from this torch's real dtypes only, so a name received over the wire can never
resolve to an arbitrary ``torch`` attribute (``getattr(torch, name)`` would).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from weightsync.core.wire.errors import SettingsError, UnsupportedDtypeError

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


def _of(tensor: str | None) -> str:
    return "" if tensor is None else f"tensor {tensor!r}: "


def dtype_from_name(name: str, tensor: str | None = None) -> torch.dtype:
    """Resolve a wire dtype name through the allow-list, refusing anything else (naming
    ``tensor``, the tensor it belongs to, where given)."""
    if not isinstance(name, str) or name not in ALLOWED_DTYPES:
        raise UnsupportedDtypeError(
            f"{_of(tensor)}dtype {name!r} is not one weightsync can transfer; "
            f"allowed: {', '.join(sorted(ALLOWED_DTYPES))}"
        )
    return ALLOWED_DTYPES[name]


def dtype_name(dtype: torch.dtype, tensor: str | None = None) -> str:
    """The wire name of ``dtype``; refuses dtypes outside the allow-list (naming ``tensor``,
    the tensor of that dtype, where given)."""
    try:
        return _NAME_OF_DTYPE[dtype]
    except KeyError:
        raise UnsupportedDtypeError(
            f"{_of(tensor)}dtype {dtype} cannot be transferred; allowed: {', '.join(sorted(ALLOWED_DTYPES))}"
        ) from None


def check_wire_dtype(wire_dtype: object) -> None:
    """A trainer's ``wire_dtype`` (the dtype its floating tensors travel in) is None or a
    floating ``torch.dtype`` on the allow-list; anything else (a name such as
    ``"bfloat16"``, an integer dtype that would truncate every weight) is refused here,
    naming the setting, rather than surfacing later as a dtype mismatch."""
    if wire_dtype is None:
        return
    if isinstance(wire_dtype, str):
        raise SettingsError(f"wire_dtype must be a torch.dtype, got the string {wire_dtype!r}: pass torch.{wire_dtype}")
    if not (isinstance(wire_dtype, torch.dtype) and wire_dtype.is_floating_point and wire_dtype in _NAME_OF_DTYPE):
        floats = ", ".join(f"torch.{name}" for name, d in ALLOWED_DTYPES.items() if d.is_floating_point)
        raise SettingsError(f"wire_dtype must be None or a floating torch.dtype ({floats}), got {wire_dtype!r}")
