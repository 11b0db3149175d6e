"""Shared fixtures: one loopback Ray cluster per session, actor cleanup, GPU markers.

``scripts/run.sh test`` runs the whole suite in two pytest processes (``-n 2 --dist
loadfile``) where there is no GPU: each process is a session of its own, with its own
cluster and shared-memory scope, and each test file runs whole in one of them."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

# Before Ray or gloo start: keep every connection on 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
# Every region this session's processes create carries this label, so the leak checks look
# only at this session's regions, never at another process's on the same host.
os.environ["WEIGHTSYNC_SHM_SCOPE"] = f"pytest{os.getpid()}"

import pytest
import torch

ROOT = str(Path(__file__).resolve().parent.parent)
RAY_TIMEOUT = 120.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "cuda" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multi_gpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 or more GPUs, {gpus} visible"))


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    import ray

    from weightsync.tools.cluster import inherited_by_ray
    from weightsync.tools.head import WORKER_NICENESS

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # The actors' environment is the cluster's own, inherited when it starts (this checkout on
    # PYTHONPATH; loopback gloo and the shared-memory scope are set above), not a job runtime
    # env, which would make every actor's start wait on the process Ray runs to set runtime
    # envs up. This process keeps its own PYTHONPATH: the commands the tests run see what a
    # user's shell gives them.
    with inherited_by_ray({"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}):
        ray.init(
            address="local",
            num_cpus=8,
            num_gpus=num_gpus,
            include_dashboard=False,
            log_to_driver=False,
            _system_config={"worker_niceness": WORKER_NICENESS},
        )
    yield
    ray.shutdown()


class ActorPool:
    """Records the actors a test starts; kills them all at teardown and checks they died."""

    def __init__(self) -> None:
        self.handles: list[object] = []

    def add(self, handle: object) -> object:
        self.handles.append(handle)
        return handle

    def close(self) -> None:
        """Kill every recorded actor and wait (bounded) until each one's process is gone."""
        import ray

        pids = []
        for handle in self.handles:
            try:
                pids.append(ray.get(handle.pid.remote(), timeout=RAY_TIMEOUT))
            except ray.exceptions.RayActorError:
                pass  # already dead: the test killed it on purpose
            ray.kill(handle)
        deadline = time.monotonic() + RAY_TIMEOUT
        alive = set(pids)
        while alive and time.monotonic() < deadline:
            alive = {pid for pid in alive if _exists(pid)}
            time.sleep(0.05)
        assert not alive, f"actor processes still alive after ray.kill: {sorted(alive)}"


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def actors(ray_session: None) -> Iterator[ActorPool]:
    pool = ActorPool()
    yield pool
    pool.close()


@pytest.fixture
def no_shm_leftovers() -> Iterator[None]:
    """Fails a test that leaves regions behind: only this session's (its scope), so
    another process's regions on the same host never fail it."""
    from weightsync.core.wire.shm_names import current_scope
    from weightsync.mechanisms.shm import leftover_segments

    before = set(leftover_segments(scope=current_scope()))
    yield
    left = set(leftover_segments(scope=current_scope())) - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


@pytest.fixture(scope="module")
def pool(ray_session: None) -> Iterator[ActorPool]:
    """The actors one test module starts, killed (and checked gone) after its last test."""
    actors = ActorPool()
    yield actors
    actors.close()
