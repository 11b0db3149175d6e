"""Starting or joining Ray for the command line and the examples.

An embedded cluster is kept on loopback: its node address is 127.0.0.1, and Ray's GCS and
raylet then listen on 127.0.0.1 only (for any other node address they listen on every
interface). Ray turns a requested 127.0.0.1 into the machine's network address unless
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, and it reads that variable once, when Ray is
imported (``ray._private.ray_constants.ENABLE_RAY_CLUSTER``): by the time :func:`connect`
runs, Ray is imported, so setting the variable alone comes too late. :func:`connect` sets
the variable (for the processes Ray starts) and Ray's constant (for this one), asks for
127.0.0.1, and checks the address Ray reports. All of this only for a cluster this process
starts, never when joining one (``--address``, or ``RAY_ADDRESS`` as set by ``ray job
submit``).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import ray

from weightsync.core.wire.errors import SettingsError
from weightsync.tools.head import WORKER_NICENESS

_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])  # the checkout: weightsync/tools/cluster.py
LOOPBACK = "127.0.0.1"
#: Set by Ray's job supervisor in a job's driver: the job's config, its runtime env included.
JOB_CONFIG_VAR = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def connect(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None) -> dict[str, Any]:
    """Join ``address`` (or ``$RAY_ADDRESS``), else start a local loopback cluster.

    Returns what happened, for the caller to print. Workers get this source tree on their
    ``PYTHONPATH`` so ``python -m weightsync`` works from a checkout without installing. A
    cluster started here runs its actors at the driver's niceness, not Ray's 15
    (:data:`~weightsync.tools.head.WORKER_NICENESS`).
    Actors' output is not copied to this terminal (``log_to_driver=False``): it stays in
    Ray's log files, ``/tmp/ray/session_latest/logs/worker-*.out`` and ``.err`` on each node
    (docs/troubleshooting.md). A job server's ``http://`` address is refused
    (:class:`SettingsError`), naming where it came from.
    """
    from_env = not address
    address = address or os.environ.get("RAY_ADDRESS")
    if address and address.startswith(("http://", "https://")):
        where = "RAY_ADDRESS" if from_env else "--address"
        raise SettingsError(
            f"{where}={address} is a job server's address (what `cluster env` exports for `ray job submit`), "
            "not a Ray cluster's: to run here, `unset RAY_ADDRESS RAY_AUTH_MODE RAY_AUTH_TOKEN_PATH` first; "
            "to run on that head, submit the command as a job (`python -m weightsync cluster submit -- ...`); "
            "to join a cluster, pass its GCS address (host:port)"
        )
    if ray.is_initialized():
        return {"mode": "already connected"}
    path = os.pathsep.join(p for p in (_PROJECT_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    if address:
        ray.init(address=address, runtime_env=_joining_env({"env_vars": {"PYTHONPATH": path}}), log_to_driver=False)
        return {"mode": "joined", "address": address}
    _stay_on_loopback()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    kwargs: dict[str, Any] = {
        "address": "local",
        "include_dashboard": False,
        "log_to_driver": False,
        "_node_ip_address": LOOPBACK,
        "_system_config": {"worker_niceness": WORKER_NICENESS},
    }
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    if num_gpus is not None:
        kwargs["num_gpus"] = num_gpus
    with inherited_by_ray({"PYTHONPATH": path}):
        ray.init(**kwargs)
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(
            f"the local Ray cluster came up on {node_ip}, not {LOOPBACK}, so it would listen on every interface; "
            "it was shut down. Start Ray yourself on loopback (ray start --head --node-ip-address=127.0.0.1 with "
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) and pass --address"
        )
    return {"mode": "started", "address": "local", "node_ip": node_ip}


@contextlib.contextmanager
def inherited_by_ray(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in this process's environment while it starts a local cluster, then
    restore the environment as it was.

    Every process of a cluster that this process starts (the raylet, and the workers it
    starts for actors) inherits the environment it sees now. That hands every actor these
    variables without a job runtime env, whose actors each wait before they start on the
    process Ray runs to set runtime envs up (about 0.25 s more per actor on 2 cores)::

        with inherited_by_ray({"PYTHONPATH": checkout}):
            ray.init(address="local", ...)
    """
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def _joining_env(ours: dict[str, Any]) -> dict[str, Any] | None:
    """The runtime env to join with: ``ours`` (this checkout on the workers' PYTHONPATH),
    except in a job's driver whose own runtime env sets PYTHONPATH. Ray refuses to merge
    the same variable from both, and such a job's working_dir already carries the code."""
    job = os.environ.get(JOB_CONFIG_VAR)
    if job is None:
        return ours
    job_env = json.loads(job).get("runtime_env") or {}
    return None if "PYTHONPATH" in (job_env.get("env_vars") or {}) else ours


def _stay_on_loopback() -> None:
    """Make Ray keep a requested 127.0.0.1 as the node address, here and in the processes it starts."""
    from ray._private import ray_constants

    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def connect_with_gpus(needed: float, what: str, address: str | None = None, num_cpus: int | None = None) -> str | None:
    """:func:`connect` for a command that needs ``needed`` GPUs: the line to print when it
    cannot have them, else ``None`` once connected.

    A machine without a CUDA GPU that would start its own cluster is told so before Ray
    starts; a joined cluster (``address`` or ``$RAY_ADDRESS``) is asked once connected
    (:func:`missing_gpus`). Either way no actor is left waiting for a GPU that never comes.
    """
    if needed > 0 and not (address or os.environ.get("RAY_ADDRESS")):
        from weightsync.tools.preflight import no_local_gpu

        problem = no_local_gpu(what)
        if problem is not None:
            return problem
    connect(address, num_cpus=num_cpus)
    return missing_gpus(needed, what) if needed > 0 else None


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
        "or join a cluster that has one (RAY_ADDRESS, or --address where the command takes it)"
    )
