"""The defect catalogue, part one: sync behaviour (items 1-5) and peer faults.

One test per behaviour item and per fault, against the public API; shared pieces live in
``tests/catalogue.py`` and part two (setup, settings, verification, shared memory,
concurrency, life cycle) in ``tests/test_catalogue_setup.py``. Each test is bounded (small
``timeout_s`` where a timeout is what is tested, 60 s where the point is that nobody waits
for it) and checks the named error (worker, tensor or setting in the message or in the
error's attributes) or the exact bytes. "Within about timeout_s" cases record the elapsed
seconds (``record_property("seconds", ...)``) and bound them loosely at 2 x timeout_s + 5;
"before timeout_s" cases use timeout_s = 60 and a bound of 30 s.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import weightsync
from tests.catalogue import (
    BUF,
    MIXED,
    TRANSPORTS,
    arm,
    assert_held_is_true,
    assert_holds,
    assert_named,
    assert_nobody_timed_out,
    assert_workers_match,
    frozen,
    get,
    kill_and_wait,
    loading,
    mixed_workers,
    model,
    status_is,
    text_of,
    timed,
    trainer_of,
    wait_busy,
    worker_of,
)
from tests.conftest import RAY_TIMEOUT
from tests.helpers import perturb, random_tensor, state_of
from weightsync.core.sinks import module_tensors

# --- 1. a worker tensor changed since setup ---------------------------------------------


def raw(m: nn.Module, name: str) -> tuple[str, tuple[int, ...], torch.Tensor]:
    tensor = dict(module_tensors(m))[name]
    return str(tensor.dtype), tuple(tensor.shape), tensor.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def retype(m: nn.Module, name: str, seed: int) -> tuple[str, tuple[int, ...], torch.Tensor]:
    """fp32 -> fp16, as a worker loading a half-precision checkpoint would."""
    tensor = dict(module_tensors(m))[name]
    tensor.data = random_tensor(tuple(tensor.shape), torch.float16, seed)
    return raw(m, name)


def reshape_broadcastable(m: nn.Module, name: str, seed: int) -> tuple[str, tuple[int, ...], torch.Tensor]:
    """(10,) -> (1, 10): same bytes, a shape ``copy_`` would broadcast into."""
    tensor = dict(module_tensors(m))[name]
    tensor.data = random_tensor((1, *tensor.shape), tensor.dtype, seed)
    return raw(m, name)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_item1_worker_tensor_retyped_or_reshaped_since_setup_is_never_written_nor_committed(
    transport: str, actors: Any
) -> None:
    trainer = trainer_of(actors)
    retyped, reshaped = worker_of(actors, model(1)), worker_of(actors, model(2))
    workers = {"retyped-worker": retyped, "reshaped-worker": reshaped}
    ws = weightsync.WeightSync(trainer, workers, transport=transport, buffer_bytes=BUF, timeout_s=20)
    ws.setup()
    get(trainer.call.remote(perturb, 1))
    ws.sync(1)
    mine = {
        "retyped-worker": get(retyped.call.remote(retype, "linear.weight", 11)),
        "reshaped-worker": get(reshaped.call.remote(reshape_broadcastable, "linear.bias", 12)),
    }
    get(trainer.call.remote(perturb, 2))
    with pytest.raises(weightsync.WeightSyncError) as info:
        ws.sync(2)
    assert_named(info.value, "retyped-worker", "linear.weight")
    assert_named(info.value, "reshaped-worker", "linear.bias")
    # Never written (no cast, no broadcast into the changed tensor) and never committed.
    for (name, worker), tensor in zip(workers.items(), ("linear.weight", "linear.bias")):
        dtype, shape, data = get(worker.call.remote(raw, tensor))
        assert (dtype, shape) == mine[name][:2]
        assert torch.equal(data, mine[name][2]), f"{name}: {tensor} was written"
    status = ws.status()
    assert {name: version for name, (version, _) in status.items()} == {"retyped-worker": 1, "reshaped-worker": 1}
    ws.close()


def new_storage(m: nn.Module, names: list[str]) -> list[torch.Tensor]:
    """``p.data = p.data.clone()``: same dtype, shape and values, new storage. The old
    storage is kept alive on the model, so a stale write would land somewhere visible."""
    held = dict(module_tensors(m))
    m._old = [held[n].data for n in names]  # type: ignore[assignment]
    for name in names:
        held[name].data = held[name].data.clone()
    return [t.clone() for t in m._old]  # type: ignore[attr-defined]


def old_storage(m: nn.Module) -> list[torch.Tensor]:
    return [t.clone() for t in m._old]  # type: ignore[attr-defined]


def test_item1_worker_tensor_with_new_storage_gets_the_exact_bytes_in_its_current_tensor(actors: Any) -> None:
    trainer = trainer_of(actors)
    workers = mixed_workers(actors)
    with weightsync.WeightSync(trainer, workers, transport=MIXED, buffer_bytes=BUF, timeout_s=20) as ws:
        get(trainer.call.remote(perturb, 1))
        ws.sync(1)
        old = {n: get(w.call.remote(new_storage, ["linear.weight", "big"])) for n, w in workers.items()}
        get(trainer.call.remote(perturb, 2))
        report = ws.sync(2)
        assert {w.name: (w.version, w.state) for w in report.workers} == {n: (2, "committed") for n in MIXED}
        assert_workers_match(trainer, workers.values())
        for name, worker in workers.items():
            for before, after in zip(old[name], get(worker.call.remote(old_storage))):
                assert torch.equal(before, after), f"{name}: the replaced storage was written"


# --- 2. a trainer model changed since setup ------------------------------------------------


def add_param(m: nn.Module, seed: int) -> None:
    m.extra_param = nn.Parameter(random_tensor((5,), torch.float32, seed))


def remove_param(m: nn.Module, seed: int) -> None:
    del m.after_odd


def reshape_param(m: nn.Module, seed: int) -> None:
    m.linear.weight.data = random_tensor((6, 10), torch.float32, seed)  # (10, 6) -> (6, 10)


def retype_param(m: nn.Module, seed: int) -> None:
    m.linear.weight = nn.Parameter(random_tensor((10, 6), torch.float16, seed))


TRAINER_CHANGES: dict[str, tuple[Callable[[nn.Module, int], None], str]] = {
    "added": (add_param, "extra_param"),
    "removed": (remove_param, "after_odd"),
    "reshaped": (reshape_param, "linear.weight"),
    "retyped": (retype_param, "linear.weight"),
}


@pytest.mark.parametrize("change", list(TRAINER_CHANGES))
def test_item2_trainer_model_changed_since_setup_is_refused_by_name_until_setup(change: str, actors: Any) -> None:
    apply, tensor = TRAINER_CHANGES[change]
    trainer = trainer_of(actors)
    workers = mixed_workers(actors)
    ws = weightsync.WeightSync(trainer, workers, transport=MIXED, buffer_bytes=BUF, timeout_s=20)
    ws.setup()
    get(trainer.call.remote(perturb, 1))
    ws.sync(1)
    get(trainer.call.remote(apply, 50))
    with pytest.raises(weightsync.WeightSyncError) as info:
        ws.sync(2)
    assert_named(info.value, tensor)
    assert {version for version, _ in ws.status().values()} == {1}
    # The workers follow the change; setup() picks it up and version 2 goes through.
    for seed, worker in enumerate(workers.values(), start=60):
        get(worker.call.remote(apply, seed))
    ws.setup()
    get(trainer.call.remote(perturb, 3))
    report = ws.sync(2)
    assert {w.name: w.version for w in report.workers} == dict.fromkeys(MIXED, 2)
    assert_workers_match(trainer, workers.values())
    ws.close()
    # A new WeightSync on the same actors works too.
    with weightsync.WeightSync(trainer, workers, transport=MIXED, buffer_bytes=BUF, timeout_s=20) as again:
        get(trainer.call.remote(perturb, 4))
        again.sync(3)
        assert_workers_match(trainer, workers.values())


# --- 3. a failure before any byte moves reaches every peer at once ------------------------

PATIENT = 60.0  # nobody may wait for this; the failures below must come back in < PATIENT / 2


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_item3_a_version_refused_by_a_worker_stops_every_peer_at_once(
    transport: str, actors: Any, record_property: Any
) -> None:
    trainer = trainer_of(actors)
    ahead, peer = worker_of(actors, model(1)), worker_of(actors, model(2))
    ws = weightsync.WeightSync(
        trainer, {"ahead": ahead, "peer": peer}, transport=transport, buffer_bytes=BUF, timeout_s=PATIENT
    )
    ws.sync(1)
    # Another WeightSync takes "ahead" to version 10.
    with weightsync.WeightSync(trainer, {"ahead": ahead}, transport=transport, buffer_bytes=BUF) as other:
        get(trainer.call.remote(perturb, 10))
        other.sync(10, force=True)
    v1 = get(peer.call.remote(state_of))
    v10 = get(ahead.call.remote(state_of))
    ws.setup()
    get(trainer.call.remote(perturb, 2))
    v2 = get(trainer.call.remote(state_of))
    exc, seconds = timed(record_property, lambda: ws.sync(2))
    assert seconds < PATIENT / 2, f"took {seconds:.1f} s: a peer waited for its deadline"
    assert exc.culprits == ["ahead"], text_of(exc)
    assert status_is(exc, "ahead", "failed")
    assert_nobody_timed_out(exc)
    assert exc.held["ahead"] == (10, "committed")
    assert_holds(ahead, v10)
    assert_held_is_true(exc, "peer", peer, {1: v1, 2: v2})
    # force overrides the worker's refusal.
    report = ws.sync(2, force=True)
    assert {w.name: (w.version, w.state) for w in report.workers} == {
        "ahead": (2, "committed"),
        "peer": (2, "committed"),
    }
    assert_workers_match(trainer, [ahead, peer])
    ws.close()


def test_item3_a_trainer_manifest_error_at_sync_start_stops_every_worker_at_once(
    actors: Any, record_property: Any
) -> None:
    trainer = trainer_of(actors)
    workers = mixed_workers(actors)
    ws = weightsync.WeightSync(trainer, workers, transport=MIXED, buffer_bytes=BUF, timeout_s=PATIENT)
    get(trainer.call.remote(perturb, 1))
    ws.sync(1)
    v1 = get(trainer.call.remote(state_of))
    get(trainer.call.remote(reshape_param, 5))
    exc, seconds = timed(record_property, lambda: ws.sync(2))
    assert seconds < PATIENT / 2, f"took {seconds:.1f} s: a worker waited for its deadline"
    assert_named(exc, "linear.weight")
    assert exc.culprits == ["trainer"], text_of(exc)
    assert_nobody_timed_out(exc)
    assert {name: version for name, (version, _) in exc.held.items()} == dict.fromkeys(MIXED, 1)
    for worker in workers.values():
        assert_holds(worker, v1)
    ws.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_item3_fault_worker_killed_before_a_sync_is_named_dead_at_once(
    transport: str, actors: Any, record_property: Any
) -> None:
    trainer = trainer_of(actors)
    doomed, peer = worker_of(actors, model(1)), worker_of(actors, model(2))
    ws = weightsync.WeightSync(
        trainer, {"doomed": doomed, "peer": peer}, transport=transport, buffer_bytes=BUF, timeout_s=PATIENT
    )
    get(trainer.call.remote(perturb, 1))
    ws.sync(1)
    v1 = get(trainer.call.remote(state_of))
    kill_and_wait(get(doomed.pid.remote()))
    get(trainer.call.remote(perturb, 2))
    v2 = get(trainer.call.remote(state_of))
    exc, seconds = timed(record_property, lambda: ws.sync(2))
    assert seconds < PATIENT / 2, f"took {seconds:.1f} s: a peer waited for its deadline"
    assert exc.dead == ["doomed"] and exc.culprits == ["doomed"], text_of(exc)
    assert status_is(exc, "doomed", "dead")
    assert_nobody_timed_out(exc)
    assert "doomed" not in exc.held
    assert_held_is_true(exc, "peer", peer, {1: v1, 2: v2})
    ws.close()
    # The trainer and the live worker go on (without the dead one, by the caller's choice).
    with weightsync.WeightSync(trainer, {"peer": peer}, transport=transport, buffer_bytes=BUF, timeout_s=20) as alone:
        get(trainer.call.remote(perturb, 3))
        alone.sync(3)
        assert_workers_match(trainer, [peer])


# --- 4. frozen or killed peers are named within about timeout_s ---------------------------

QUICK = 3.0  # timeout_s where a timeout is the thing tested


def within_about(seconds: float, timeout_s: float) -> None:
    assert seconds < timeout_s * 2 + 5, f"named after {seconds:.1f} s with timeout_s={timeout_s}"


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_item4_fault_frozen_worker_times_out_by_name_and_the_sync_goes_on_after_it_thaws(
    transport: str, actors: Any, record_property: Any
) -> None:
    trainer = trainer_of(actors)
    stopped, peer = worker_of(actors, model(1)), worker_of(actors, model(2))
    workers = {"frozen-worker": stopped, "peer": peer}
    ws = weightsync.WeightSync(trainer, workers, transport=transport, buffer_bytes=BUF, timeout_s=QUICK)
    ws.sync(1)
    get(trainer.call.remote(perturb, 2))
    with frozen(get(stopped.pid.remote())):
        exc, seconds = timed(record_property, lambda: ws.sync(2))
    within_about(seconds, QUICK)
    assert "frozen-worker" in str(exc), f"the message does not say which peer: {exc}"
    assert "frozen-worker" in exc.culprits and "peer" not in exc.culprits, text_of(exc)
    assert status_is(exc, "frozen-worker", "timed_out")
    assert "frozen-worker" not in exc.dead
    # Thawed, it finishes its stale call and the next sync reaches both.
    get(trainer.call.remote(perturb, 3))
    report = ws.sync(3)
    assert {w.name: (w.version, w.state) for w in report.workers} == {
        "frozen-worker": (3, "committed"),
        "peer": (3, "committed"),
    }
    assert_workers_match(trainer, workers.values())
    ws.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_item4_fault_worker_killed_during_a_sync_is_named_dead(
    transport: str, actors: Any, record_property: Any
) -> None:
    trainer = trainer_of(actors)
    peer = worker_of(actors, model(2))
    if transport == "direct":  # a module sink: frozen inside the sync, then killed
        victim = worker_of(actors, model(1))
    else:  # dies in its own load_weights, chunks already loaded
        victim = worker_of(actors, loading(1), sink="load_weights")
    workers = {"victim": victim, "peer": peer}
    ws = weightsync.WeightSync(trainer, workers, transport=transport, buffer_bytes=BUF, timeout_s=5.0)
    get(trainer.call.remote(perturb, 1))
    ws.sync(1)
    v1 = get(trainer.call.remote(state_of))
    get(trainer.call.remote(perturb, 2))
    v2 = get(trainer.call.remote(state_of))
    if transport == "direct":
        pid = get(victim.pid.remote())
        # The pool outside the freeze: leaving the block thaws first, then joins the thread.
        with concurrent.futures.ThreadPoolExecutor(1) as pool, frozen(pid):
            future = pool.submit(ws.sync, 2)
            wait_busy(trainer)
            kill_and_wait(pid)
            exc, seconds = timed(record_property, lambda: future.result(timeout=RAY_TIMEOUT))
    else:
        get(victim.call.remote(arm, "exit", 2))
        exc, seconds = timed(record_property, lambda: ws.sync(2))
    within_about(seconds, 5.0)
    assert exc.dead == ["victim"] and exc.culprits == ["victim"], text_of(exc)
    assert status_is(exc, "victim", "dead")
    assert "victim" not in exc.held
    assert_held_is_true(exc, "peer", peer, {1: v1, 2: v2})
    ws.close()
    with weightsync.WeightSync(trainer, {"peer": peer}, transport=transport, buffer_bytes=BUF, timeout_s=20) as alone:
        get(trainer.call.remote(perturb, 3))
        alone.sync(3)
        assert_workers_match(trainer, [peer])


def test_fault_trainer_killed_during_a_sync_leaves_every_worker_at_its_committed_version(
    actors: Any, record_property: Any
) -> None:
    trainer = trainer_of(actors)
    workers = mixed_workers(actors)
    ws = weightsync.WeightSync(trainer, workers, transport=MIXED, buffer_bytes=BUF, timeout_s=5.0)
    get(trainer.call.remote(perturb, 1))
    ws.sync(1)
    v1 = get(trainer.call.remote(state_of))
    get(trainer.call.remote(perturb, 2))
    pid = get(trainer.pid.remote())
    with concurrent.futures.ThreadPoolExecutor(1) as pool, frozen(pid):
        future = pool.submit(ws.sync, 2)
        wait_busy(workers["via-broadcast"])  # a worker waits inside its receive
        kill_and_wait(pid)
        exc, seconds = timed(record_property, lambda: future.result(timeout=RAY_TIMEOUT))
    within_about(seconds, 5.0)
    assert exc.dead == ["trainer"] and exc.culprits == ["trainer"], text_of(exc)
    assert status_is(exc, "trainer", "dead")
    # The trainer was frozen before it wrote a byte: every worker still holds version 1.
    assert set(exc.held) == set(MIXED)
    for name, worker in workers.items():
        version, state = exc.held[name]
        assert version == 1 and state in ("committed", "dirty"), (name, version, state)
        assert_holds(worker, v1)


# --- 5. retrying a version after a partial failure ------------------------------------------


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_item5_retrying_the_same_version_after_a_partial_failure_reaches_everyone(transport: str, actors: Any) -> None:
    trainer = trainer_of(actors)
    steady = worker_of(actors, model(1))
    flaky = worker_of(actors, loading(2), sink="load_weights")
    workers = {"steady": steady, "flaky": flaky}
    ws = weightsync.WeightSync(
        trainer, workers, transport={"steady": "direct", "flaky": transport}, buffer_bytes=BUF, timeout_s=20
    )
    get(trainer.call.remote(perturb, 1))
    ws.sync(1)
    v1 = get(trainer.call.remote(state_of))
    get(flaky.call.remote(arm, "raise", 2))
    get(trainer.call.remote(perturb, 2))
    v2 = get(trainer.call.remote(state_of))
    with pytest.raises(weightsync.SyncError) as info:
        ws.sync(2)
    exc = info.value
    assert "flaky-load-weights-failure" in text_of(exc)
    assert exc.culprits == ["flaky"], text_of(exc)
    assert status_is(exc, "flaky", "failed")
    assert exc.held["flaky"] == (1, "dirty")  # some tensors were loaded: a mix
    assert_held_is_true(exc, "steady", steady, {1: v1, 2: v2})
    assert ws.status() == exc.held
    report = ws.sync(2)  # the same version again: accepted by those already at it
    assert {w.name: (w.version, w.state) for w in report.workers} == {
        "steady": (2, "committed"),
        "flaky": (2, "committed"),
    }
    assert ws.status() == {"steady": (2, "committed"), "flaky": (2, "committed")}
    assert_workers_match(trainer, workers.values())
    with pytest.raises(weightsync.WeightSyncError, match="version"):
        ws.sync(1)
    ws.close()
