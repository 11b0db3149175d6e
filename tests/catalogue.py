"""Shared pieces of the defect catalogue (tests/test_catalogue*.py): small models,
actor factories, fault injection (freeze, kill, wait until busy) and checks on SyncError's
outcomes. Names from the new public API are looked up on ``weightsync`` when used, so one
missing name fails only the tests that use it.

Call order of the fault helpers: :func:`frozen` enters once every thread of the process has
stopped (:func:`stop_and_wait`) and always thaws (SIGCONT) in a ``finally``;
:func:`kill_and_wait` SIGKILLs an actor's process and waits (bounded) until it is gone;
:func:`wait_busy` polls (bounded) until an actor is inside a sync call.
"""

import contextlib
import functools
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import ray
import torch
from torch import nn

import weightsync
from tests.conftest import RAY_TIMEOUT
from tests.helpers import MixedModel, assert_bit_equal, state_of
from tests.test_ray_e2e import LoadingMixedModel
from weightsync import TrainerActor, WorkerActor

TRANSPORTS = ["broadcast", "ipc", "direct"]
#: One worker per transport in one WeightSync: a check that is not about one transport
#: covers all three in one sync.
MIXED = {"via-broadcast": "broadcast", "via-ipc": "ipc", "via-direct": "direct"}
BUF = 1024  # several chunks for the ~5 KB model below
BIG = 600  # MixedModel's bf16 (BIG, 4) tensor spans several chunks


def get(ref: Any, timeout: float = RAY_TIMEOUT) -> Any:
    return ray.get(ref, timeout=timeout)


def model(seed: int) -> Callable[[], nn.Module]:
    return functools.partial(MixedModel, seed=seed, big=BIG)


class Loading(LoadingMixedModel):
    """Loads the way engines do (``load_weights``, by name, one copy per tensor), and can be
    armed to fail or die at its ``at``-th call: mid-transfer, some tensors already loaded."""

    fault: tuple[str, int] | None = None
    calls = 0

    def load_weights(self, weights: Any) -> set[str]:
        self.calls += 1
        if self.fault is not None and self.calls >= self.fault[1]:
            kind = self.fault[0]
            self.fault = None  # one-shot
            if kind == "exit":
                os._exit(17)
            raise RuntimeError("flaky-load-weights-failure (injected by the test)")
        return super().load_weights(weights)


def loading(seed: int) -> Callable[[], nn.Module]:
    return functools.partial(Loading, seed=seed, big=BIG)


def arm(m: nn.Module, kind: str, at: int) -> None:
    m.fault = (kind, at)  # type: ignore[assignment]
    m.calls = 0  # type: ignore[assignment]


def trainer_of(actors: Any, factory: Callable[[], nn.Module] | None = None, **options: Any) -> Any:
    return actors.add(TrainerActor.options(num_cpus=0).remote(factory or model(0), **options))


def worker_of(actors: Any, factory: Callable[[], nn.Module] | None = None, **options: Any) -> Any:
    return actors.add(WorkerActor.options(num_cpus=0).remote(factory or model(1), **options))


def mixed_workers(actors: Any, factory: Callable[[int], Callable[[], nn.Module]] = model) -> dict[str, Any]:
    return {name: worker_of(actors, factory(seed)) for seed, name in enumerate(MIXED, start=1)}


def assert_workers_match(trainer: Any, workers: Any) -> None:
    """Every worker holds the trainer's tensors: same names, dtypes, shapes and bytes."""
    expected = get(trainer.call.remote(state_of))
    for worker in workers:
        got = get(worker.call.remote(state_of))
        assert got.keys() == expected.keys()
        for name in expected:
            assert_bit_equal(got[name], expected[name], name)


def assert_holds(worker: Any, expected: dict[str, torch.Tensor]) -> None:
    got = get(worker.call.remote(state_of))
    assert got.keys() == expected.keys()
    for name in expected:
        assert_bit_equal(got[name], expected[name], name)


def text_of(exc: BaseException) -> str:
    """The error's message and every party's outcome message."""
    parts = [str(exc)]
    for outcome in getattr(exc, "outcomes", {}).values():
        parts.append(f"{outcome.party} {outcome.phase} {outcome.error} {outcome.message}")
    return "\n".join(parts)


def assert_named(exc: BaseException, *names: str) -> None:
    text = text_of(exc)
    culprits = list(getattr(exc, "culprits", []))
    for name in names:
        assert name in text or name in culprits, f"{name!r} is not named by {type(exc).__name__}: {text}"


def status_is(exc: Any, party: str, value: str) -> bool:
    return bool(exc.outcomes[party].status == weightsync.Status(value))


def assert_nobody_timed_out(exc: Any) -> None:
    late = [p for p, o in exc.outcomes.items() if o.status == weightsync.Status("timed_out")]
    assert not late, f"parties waited out their deadline: {late}; {text_of(exc)}"


def assert_held_is_true(exc: Any, name: str, worker: Any, by_version: dict[int, dict[str, torch.Tensor]]) -> None:
    """The (version, state) the error reports for ``name`` is what the worker really holds."""
    version, state = exc.held[name]
    assert state in ("committed", "dirty"), f"{name}: left {state!r} after the sync ended"
    assert version in by_version, f"{name}: reported at version {version}, which was never sent"
    if state == "committed":
        assert_holds(worker, by_version[version])


def stop_and_wait(pid: int) -> None:
    """SIGSTOP ``pid`` and wait (bounded) until every thread of it has stopped.

    The kernel wakes one thread of the process to begin the stop and stops the others
    only once that one runs: until then they go on, and on a busy machine that can be
    long enough for a listener thread to serve a whole sync.
    """
    os.kill(pid, signal.SIGSTOP)
    _until(lambda: _all_stopped(pid), f"pid {pid} did not stop on SIGSTOP", every=0.001)


def _all_stopped(pid: int) -> bool:
    """Whether no thread of ``pid`` can run: each is stopped, or the process is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    states = (_state(f"/proc/{pid}/task/{task}/stat") for task in tasks)
    return all(state in (None, "T", "t", "Z", "X") for state in states)  # None: the thread ended


def _state(stat: str) -> str | None:
    """The state letter in the ``stat`` file of a process or thread; None once it is gone."""
    try:
        with open(stat) as fh:
            return fh.read().rsplit(") ", 1)[-1][:1]
    except FileNotFoundError:
        return None


def _until(done: Callable[[], bool], failure: str, every: float) -> None:
    deadline = time.monotonic() + RAY_TIMEOUT
    while not done():
        assert time.monotonic() < deadline, failure
        time.sleep(every)


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """SIGSTOP ``pid`` for the block, from the moment every thread of it stopped; always
    SIGCONT after (a no-op once it is dead)."""
    stop_and_wait(pid)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A killed child of the raylet may linger as a zombie until it is reaped.
    return _state(f"/proc/{pid}/stat") in (None, "Z")


def kill_and_wait(pid: int) -> None:
    """SIGKILL an actor's process (as the OOM killer would) and wait until it is gone."""
    os.kill(pid, signal.SIGKILL)
    _until(lambda: _gone(pid), f"pid {pid} survived SIGKILL", every=0.01)


def wait_busy(handle: Any, bound: float = 15.0) -> bool:
    """Poll (bounded) until ``handle`` stops answering at once: it is inside a sync call.

    Ray runs one call at a time on these actors, so a ``pid`` call that does not return
    promptly is queued behind the sync. False when the bound passed first; the caller then
    goes on, and the fault lands at the start of the sync instead of in its middle.
    """
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        ready, _ = ray.wait([handle.pid.remote()], timeout=0.5)
        if not ready:
            return True
    return False


def timed(record_property: Any, fn: Callable[[], Any]) -> tuple[BaseException, float]:
    """Run ``fn``, which must raise a SyncError; returns it and the seconds it took."""
    start = time.monotonic()
    with pytest.raises(weightsync.SyncError) as info:
        fn()
    seconds = time.monotonic() - start
    record_property("seconds", round(seconds, 2))
    print(f"failed after {seconds:.2f} s: {info.value}")
    return info.value, seconds
