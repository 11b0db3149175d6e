"""Whether a tensor is a DTensor, without importing DTensor.

Importing ``torch.distributed.tensor`` costs about 0.4 s (sympy and the sharding rule
tables), more than the rest of weightsync together, and every process that imports
weightsync would pay it: each trainer and worker actor at its start, and the CLI. A tensor
can only be a DTensor once that package was imported (by FSDP2, or by whoever built the
DTensor), so :func:`is_dtensor` looks for it in ``sys.modules`` and answers False while it
is absent. Code that works on a DTensor imports what else it needs (``Shard``,
``Replicate``) where it runs: by then the package is loaded and the import is free.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_PACKAGE = "torch.distributed.tensor"


def is_dtensor(tensor: object) -> TypeGuard[DTensor]:
    """True when ``tensor`` is a DTensor (False, at no import cost, while none can exist)."""
    package = sys.modules.get(_PACKAGE)
    cls = getattr(package, "DTensor", None) if package is not None else None
    return cls is not None and isinstance(tensor, cls)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``tensor``: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
