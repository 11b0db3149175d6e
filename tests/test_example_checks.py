"""Examples and scripts that need a GPU or vLLM say so in one line at once, instead of waiting for one
or failing deep inside torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import ray
import torch

from tests.conftest import ROOT
from weightsync.core.wire.errors import SettingsError
from weightsync.tools.colocated import colocated_pair

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what happens without a GPU")


@pytest.mark.parametrize(
    ("example", "needs"),
    [
        (["examples/colocated_gpu.py"], ("GPU",)),
        (["examples/hf_transformers.py", "--device", "cuda"], ("GPU",)),
    ],
)
def test_an_example_without_what_it_needs_exits_2_naming_it(
    example: list[str], needs: tuple[str, ...], ray_session: None
) -> None:
    # Joins this session's cluster (no GPU), the way `ray job submit` would run it.
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, *example], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    assert example[0] in lines[0] and any(need in lines[0] for need in needs), lines[0]


@pytest.mark.parametrize(
    "example", [["examples/colocated_gpu.py"], ["examples/hf_transformers.py", "--device", "cuda"]]
)
def test_an_example_that_would_start_its_own_ray_says_no_gpu_before_starting_it(example: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, *example], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and example[0] in lines[0] and "GPU" in lines[0], proc.stdout
    # Ray never started: it logs where its local instance runs when it does.
    assert "Ray instance" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("script", ["scripts/tune_batched_copy.py", "scripts/profile_colocated.py"])
def test_a_gpu_script_on_a_cpu_machine_exits_2_in_one_line(script: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, script, "--size", "1mb"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and script in lines[0] and "GPU" in lines[0], proc.stdout


#: Timings that need a GPU: the bench and the scripts built on a colocated pair.
CUDA_TIMINGS = [
    ("bench", ["-m", "weightsync", "bench", "--device", "cuda", "--sizes", "1mb", "--quick"]),
    ("scripts/ipc_slots.py", ["scripts/ipc_slots.py", "--size", "1mb"]),
    ("scripts/profile_push.py", ["scripts/profile_push.py", "--size", "1mb", "--device", "cuda"]),
]


@pytest.mark.parametrize(("name", "command"), CUDA_TIMINGS)
def test_a_cuda_timing_on_a_cpu_machine_exits_2_in_one_line_before_starting_ray(name: str, command: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = ROOT
    proc = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and name in lines[0] and "GPU" in lines[0], proc.stdout
    assert "Ray instance" not in proc.stderr, proc.stderr[-2000:]


def test_the_cuda_bench_on_a_joined_cluster_without_a_gpu_exits_2_naming_it(ray_session: None) -> None:
    # Before, every case's actors waited for a GPU the cluster does not have, for ever.
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, *CUDA_TIMINGS[0][1]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and "bench" in lines[0] and "GPU" in lines[0], proc.stdout


def test_a_colocated_pair_on_cuda_in_a_cluster_without_a_gpu_is_refused_naming_the_gpu(ray_session: None) -> None:
    with pytest.raises(SettingsError, match="GPU"):
        colocated_pair("1mb", "cuda")
