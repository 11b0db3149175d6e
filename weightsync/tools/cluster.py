"""Starting or joining Ray for the command line and the examples.

An embedded cluster is kept on loopback: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` must be
set before Ray starts, or Ray binds the machine's network address. It is set only for a
cluster this process starts, never when joining one (``--address``, or ``RAY_ADDRESS`` as
set by ``ray job submit``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray

_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])  # the checkout: weightsync/tools/cluster.py


def connect(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None) -> dict[str, Any]:
    """Join ``address`` (or ``$RAY_ADDRESS``), else start a local loopback cluster.

    Returns what happened, for the caller to print. Workers get this source tree on their
    ``PYTHONPATH`` so ``python -m weightsync`` works from a checkout without installing.
    """
    if ray.is_initialized():
        return {"mode": "already connected"}
    address = address or os.environ.get("RAY_ADDRESS")
    path = os.pathsep.join(p for p in (_PROJECT_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": path}}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=False)
        return {"mode": "joined", "address": address}
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    kwargs: dict[str, Any] = {
        "address": "local",
        "include_dashboard": False,
        "runtime_env": runtime_env,
        "log_to_driver": False,
    }
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    if num_gpus is not None:
        kwargs["num_gpus"] = num_gpus
    ray.init(**kwargs)
    return {"mode": "started", "address": "local"}


def missing_gpus(needed: float, what: str) -> str | None:
    """``None`` when the connected cluster offers ``needed`` GPUs, else the line to print.

    Examples call this right after :func:`connect` so that a machine without a GPU gets one
    sentence at once instead of an actor that waits for a GPU until a timeout.
    """
    have = float(ray.cluster_resources().get("GPU", 0))
    if have >= needed:
        return None
    return (
        f"{what} needs {needed:g} GPU(s) but the Ray cluster has {have:g}: run it on a machine with an NVIDIA GPU, "
        "or join a cluster that has one (--address or RAY_ADDRESS)"
    )
