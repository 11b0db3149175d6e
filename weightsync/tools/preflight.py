"""The check a command that needs a GPU makes before it starts Ray, so a missing GPU is said at once.

Starting an embedded Ray cluster takes seconds; a machine without a GPU can be told so
before that. When the command joins a cluster (``RAY_ADDRESS`` set, as ``ray job submit``
does), the GPU may be on another node, so only the cluster can answer:
:func:`weightsync.tools.cluster.connect_with_gpus` makes both checks, each where it applies.
"""

from __future__ import annotations

import os

import torch


def no_local_gpu(what: str) -> str | None:
    """The line to print when ``what`` would start its own Ray cluster on a machine without
    a CUDA GPU; ``None`` when it has one or will join a cluster (``RAY_ADDRESS``)."""
    if os.environ.get("RAY_ADDRESS") or torch.cuda.is_available():
        return None
    return (
        f"{what} needs an NVIDIA GPU and this machine has none (torch.cuda.is_available() is False): "
        "run it on a machine with one, or join a cluster that has one (RAY_ADDRESS)"
    )
