"""The defect catalogue, part two: setup (item 6), settings (7), verification
(8), shared memory (9), concurrent syncs and sync after close.

Part one (sync behaviour and peer faults) is ``tests/test_catalogue.py``; shared pieces live
in ``tests/catalogue.py``. Settings tests need no Ray.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch
from torch import nn

import weightsync
from tests.catalogue import (
    BUF,
    MIXED,
    assert_workers_match,
    frozen,
    get,
    kill_and_wait,
    loading,
    mixed_workers,
    model,
    status_is,
    text_of,
    trainer_of,
    wait_busy,
    worker_of,
)
from tests.conftest import RAY_TIMEOUT, ROOT
from tests.helpers import perturb
from weightsync.core.sinks import module_tensors

# --- 6. a worker dead or broken at setup fails setup by name --------------------------------


def exploding_factory() -> nn.Module:
    raise RuntimeError("factory-exploded-on-purpose")


def test_item6_fault_workers_dead_or_broken_at_setup_fail_setup_by_name(actors: Any) -> None:
    trainer = trainer_of(actors)
    good = worker_of(actors, model(1))
    gone = worker_of(actors, model(2))
    broken = worker_of(actors, exploding_factory)
    # A misspelt option is refused where the actor is made, naming it (the options are declared).
    with pytest.raises(TypeError, match="expect_bufer_bytes"):
        worker_of(actors, model(3), expect_bufer_bytes=1 << 20)
    kill_and_wait(get(gone.pid.remote()))
    named = {"good": good, "gone-worker": gone, "broken-factory": broken}
    ws = weightsync.WeightSync(trainer, named, buffer_bytes=BUF, timeout_s=20)
    with pytest.raises(weightsync.SetupError) as info:
        ws.setup()
    exc = info.value
    assert sorted(exc.culprits) == ["broken-factory", "gone-worker"], text_of(exc)
    assert status_is(exc, "gone-worker", "dead")
    assert "factory-exploded-on-purpose" in exc.outcomes["broken-factory"].message
    ws.close()
    # Dropping is the caller's explicit choice: the good worker alone syncs.
    with weightsync.WeightSync(trainer, {"good": good}, buffer_bytes=BUF, timeout_s=20) as alone:
        get(trainer.call.remote(perturb, 1))
        assert [(w.name, w.version) for w in alone.sync(1).workers] == [("good", 1)]
        assert_workers_match(trainer, [good])


# --- 7. bad settings are refused at construction --------------------------------------------

BAD_SETTINGS = [
    ("buffer_bytes", 1000),  # not a multiple of the alignment (256)
    ("buffer_bytes", 0),
    ("buffer_bytes", -256),
    ("alignment", 48),  # not a power of two
    ("alignment", 8),  # below 16
    ("num_buffers", 0),
    ("timeout_s", math.nan),
    ("timeout_s", math.inf),
    ("timeout_s", 0.0),
    ("timeout_s", -1.0),
    ("verify", 1),
    ("verify", "yes"),
]


@pytest.mark.parametrize(("field", "value"), BAD_SETTINGS, ids=[f"{f}={v!r}" for f, v in BAD_SETTINGS])
def test_item7_settings_refuse_a_bad_value_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(weightsync.SettingsError) as info:
        weightsync.SyncSettings(**{field: value})
    assert field in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, weightsync.WeightSyncError)


def test_item7_settings_defaults_are_kw_only_frozen_and_small_valid_values_pass() -> None:
    settings = weightsync.SyncSettings()
    assert (settings.buffer_bytes, settings.num_buffers, settings.alignment) == ("auto", 2, 256)
    assert settings.inplace_bytes == 4 << 20
    assert (settings.timeout_s, settings.verify) == (120.0, False)
    with pytest.raises(AttributeError):
        settings.timeout_s = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        weightsync.SyncSettings(1 << 20)  # type: ignore[misc]
    small = weightsync.SyncSettings(buffer_bytes=48, alignment=16, num_buffers=1, timeout_s=0.5, verify=True)
    assert (small.buffer_bytes, small.alignment, small.num_buffers) == (48, 16, 1)


UNUSABLE_NAMES: list[Any] = ["", "trainer", "a/b", "has space", "tab\tname", "new\nline", "nul\x00"]


def test_item7_weightsync_refuses_bad_settings_duplicates_unusable_names_and_non_int_versions(actors: Any) -> None:
    trainer = trainer_of(actors)
    worker = worker_of(actors)
    for field, value in [("buffer_bytes", 1000), ("alignment", 24), ("num_buffers", 0), ("timeout_s", math.nan)]:
        with pytest.raises(weightsync.SettingsError) as info:
            weightsync.WeightSync(trainer, [worker], **{field: value})
        assert field in str(info.value)
    # A keyword overrides (and is checked against) the settings object.
    with pytest.raises(weightsync.SettingsError, match="buffer_bytes"):
        weightsync.WeightSync(trainer, [worker], settings=weightsync.SyncSettings(buffer_bytes=4096), buffer_bytes=1000)
    with pytest.raises(ValueError) as dup:
        weightsync.WeightSync(trainer, {"first-name": worker, "second-name": worker})
    assert "first-name" in str(dup.value) and "second-name" in str(dup.value)
    with pytest.raises(ValueError, match="worker-1"):
        weightsync.WeightSync(trainer, [worker, worker])
    for bad in UNUSABLE_NAMES:
        with pytest.raises(ValueError) as info:
            weightsync.WeightSync(trainer, {bad: worker})
        assert repr(bad) in str(info.value) or (bad and bad in str(info.value)), (bad, str(info.value))
    with pytest.raises((ValueError, TypeError), match="7"):
        weightsync.WeightSync(trainer, {7: worker})
    # Versions are ints: refused by name, and the WeightSync stays usable.
    ws = weightsync.WeightSync(trainer, {"w": worker}, transport="broadcast", buffer_bytes=BUF, timeout_s=20)
    ws.sync(1)
    for bad_version in (2.0, "2", True):
        with pytest.raises(TypeError, match="version"):
            ws.sync(bad_version)  # type: ignore[arg-type]
    get(trainer.call.remote(perturb, 2))
    ws.sync(2)
    assert ws.status() == {"w": (2, "committed")}
    assert_workers_match(trainer, [worker])
    ws.close()


class OnlyEmpty(nn.Module):
    """Every tensor has zero elements."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(0, 3))
        self.register_buffer("ids", torch.empty(4, 0, dtype=torch.int64))


def test_item7_a_model_whose_only_tensors_have_zero_elements_syncs(actors: Any) -> None:
    trainer = trainer_of(actors, OnlyEmpty)
    workers = mixed_workers(actors, lambda seed: OnlyEmpty)
    with weightsync.WeightSync(trainer, workers, transport=MIXED, buffer_bytes=BUF, timeout_s=20) as ws:
        report = ws.sync(1)
        assert {w.name: (w.version, w.state) for w in report.workers} == {n: (1, "committed") for n in MIXED}
        assert ws.status() == {n: (1, "committed") for n in MIXED}
        assert_workers_match(trainer, workers.values())
        assert ws.verify()


# --- 8. verification --------------------------------------------------------------------------


def test_item8_direct_sync_verify_runs_a_check_and_only_then_reports_verified(actors: Any) -> None:
    trainer = trainer_of(actors)
    worker = worker_of(actors)
    with weightsync.WeightSync(trainer, {"d": worker}, transport="direct", timeout_s=20) as ws:
        assert ws.sync(1).verified is False
        get(trainer.call.remote(perturb, 2))
        report = ws.sync(2, verify=True)
        assert report.verified is True
        assert [(w.transport, w.version, w.state) for w in report.workers] == [("direct", 2, "committed")]
        assert_workers_match(trainer, [worker])
    with weightsync.WeightSync(trainer, {"d": worker}, transport="direct", verify=True, timeout_s=20) as checked:
        get(trainer.call.remote(perturb, 3))
        assert checked.sync(3).verified is True
        assert checked.sync(4, verify=False).verified is False
        assert_workers_match(trainer, [worker])


def flip_bit(m: nn.Module, names: list[str]) -> None:
    """Corrupt one bit of each named tensor in place (the storage stays the same)."""
    held = dict(module_tensors(m))
    with torch.no_grad():
        for name in names:
            held[name].data.reshape(-1).view(torch.uint8)[0] ^= 1


def change_one(m: nn.Module, name: str) -> None:
    flip_bit(m, [name])


def test_item8_verify_works_for_load_weights_workers_and_names_the_tensor(actors: Any) -> None:
    trainer = trainer_of(actors)
    loaders = {
        "loader-ipc": worker_of(actors, loading(1), sink="load_weights"),
        "loader-bcast": worker_of(actors, loading(2), sink="load_weights"),
    }
    transport = {"loader-ipc": "ipc", "loader-bcast": "broadcast"}
    with weightsync.WeightSync(trainer, loaders, transport=transport, buffer_bytes=BUF, timeout_s=20) as ws:
        get(trainer.call.remote(perturb, 1))
        ws.sync(1)
        digest = ws.verify()
        assert isinstance(digest, str) and digest
        # The trainer moves on without a sync: the bytes the workers received now differ.
        get(trainer.call.remote(change_one, "linear.bias"))
        with pytest.raises(weightsync.VerificationError) as info:
            ws.verify()
        assert info.value.mismatches == dict.fromkeys(loaders, "linear.bias")
        assert ws.sync(2, verify=True).verified is True
        assert ws.verify() != digest
        assert_workers_match(trainer, loaders.values())


def test_item8_fault_corrupted_worker_weights_verify_names_the_first_differing_tensor_and_a_sync_repairs(
    actors: Any,
) -> None:
    trainer = trainer_of(actors)
    workers = mixed_workers(actors)
    with weightsync.WeightSync(trainer, workers, transport=MIXED, buffer_bytes=BUF, timeout_s=20) as ws:
        get(trainer.call.remote(perturb, 1))
        ws.sync(1)
        assert ws.verify()
        # Manifest order: odd, after_odd, big, linear.weight, linear.bias, step, mask, empty.
        corrupt = {"via-broadcast": ["linear.bias"], "via-ipc": ["big"], "via-direct": ["linear.weight", "mask"]}
        for name, tensors in corrupt.items():
            get(workers[name].call.remote(flip_bit, tensors))
        with pytest.raises(weightsync.VerificationError) as info:
            ws.verify()
        assert info.value.mismatches == {name: tensors[0] for name, tensors in corrupt.items()}
        get(trainer.call.remote(perturb, 2))
        ws.sync(2)
        assert ws.verify()
        assert_workers_match(trainer, workers.values())


# --- 9. a shared-memory region orphaned by a killed process ------------------------------

_SHM = "import os, signal, sys; from weightsync.mechanisms.shm import ShmRegion; "
CREATE_AND_DIE = _SHM + "r = ShmRegion(1 << 20); print(r.path, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
CREATE_AND_WAIT = _SHM + "r = ShmRegion(4096); print(r.path, flush=True); sys.stdin.readline(); r.close()"
CREATE_AND_CLOSE = _SHM + "r = ShmRegion(4096); r.close()"


def test_item9_a_region_left_by_a_killed_process_is_removed_by_the_next_creation(no_shm_leftovers: None) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    run = functools.partial(subprocess.run, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    alive = subprocess.Popen(
        [sys.executable, "-c", CREATE_AND_WAIT],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    dead_path = ""
    try:
        assert alive.stdout is not None and alive.stdin is not None
        alive_path = alive.stdout.readline().strip()
        assert os.path.exists(alive_path)
        died = run([sys.executable, "-c", CREATE_AND_DIE])
        assert died.returncode == -signal.SIGKILL, died.stderr
        dead_path = died.stdout.strip()
        print(f"left by the killed process: {dead_path} (exists: {os.path.exists(dead_path)})")
        fresh = run([sys.executable, "-c", CREATE_AND_CLOSE])
        assert fresh.returncode == 0, fresh.stderr
        assert not os.path.exists(dead_path), f"{dead_path}: left behind by a dead process, not cleaned"
        assert os.path.exists(alive_path), f"{alive_path}: removed although its owner is alive"
    finally:
        if dead_path and os.path.exists(dead_path):
            os.unlink(dead_path)  # created by this test's own child
        if alive.stdin is not None:
            alive.stdin.write("\n")
            alive.stdin.flush()
        alive.wait(timeout=120)
    assert alive.returncode == 0
    assert not os.path.exists(alive_path)


# --- faults: concurrency and life cycle ------------------------------------------------------


def test_fault_concurrent_syncs_on_one_weightsync_are_serialized_and_both_succeed_in_order(actors: Any) -> None:
    trainer = trainer_of(actors)
    workers = mixed_workers(actors)
    with weightsync.WeightSync(trainer, workers, transport=MIXED, buffer_bytes=BUF, timeout_s=60.0) as ws:
        get(trainer.call.remote(perturb, 1))
        done: list[int] = []
        lock = threading.Lock()

        def run(version: int) -> Any:
            report = ws.sync(version)
            with lock:
                done.append(report.version)
            return report

        # The broadcast worker is held still, so sync 1 is in flight when sync 2 is asked for.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            with frozen(get(workers["via-broadcast"].pid.remote())):
                first = pool.submit(run, 1)
                wait_busy(trainer)
                second = pool.submit(run, 2)
            reports = [first.result(timeout=RAY_TIMEOUT), second.result(timeout=RAY_TIMEOUT)]
        assert done == [1, 2]
        for version, report in zip((1, 2), reports):
            assert {w.name: (w.version, w.state) for w in report.workers} == {n: (version, "committed") for n in MIXED}
        assert ws.status() == {n: (2, "committed") for n in MIXED}
        assert_workers_match(trainer, workers.values())


def test_fault_sync_after_close_is_refused_by_name_until_setup_opens_it_again(actors: Any) -> None:
    trainer = trainer_of(actors)
    workers = mixed_workers(actors)
    with weightsync.WeightSync(trainer, workers, transport=MIXED, buffer_bytes=BUF, timeout_s=20) as ws:
        get(trainer.call.remote(perturb, 1))
        ws.sync(1)
    get(trainer.call.remote(perturb, 2))
    with pytest.raises(weightsync.ClosedError, match=rf"{ws.label}: sync\(version=2\) after close\(\)"):
        ws.sync(2)  # would set up again and leave the new session open
    ws.setup()
    report = ws.sync(2)
    assert {w.name: (w.version, w.state) for w in report.workers} == {n: (2, "committed") for n in MIXED}
    assert_workers_match(trainer, workers.values())
    ws.close()
    ws.close()  # closing twice is harmless
