"""The pure pieces of the restructured core, without Ray: settings, transport choice, blame
from outcomes, deadlines, and the layering rules (the control block: test_control_block.py)."""

from __future__ import annotations

import ast
import math
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import session_of
from weightsync.core.choice import choose_transport
from weightsync.core.packing import tensor_checksums
from weightsync.core.wire import (
    EndpointInfo,
    Outcome,
    PeerAborted,
    SettingsError,
    Status,
    StreamTimeout,
    SyncSettings,
    TransferTimeout,
    assign_blame,
)
from weightsync.core.wire.outcome import failed
from weightsync.core.wire.session import Deadlines

PACKAGE = Path(__file__).resolve().parent.parent / "weightsync"


# --- settings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("buffer_bytes", 1000),  # not a multiple of 256
        ("buffer_bytes", 0),
        ("buffer_bytes", 2.5),
        ("alignment", 24),
        ("alignment", 8),
        ("num_buffers", 0),
        ("timeout_s", math.nan),
        ("timeout_s", math.inf),
        ("timeout_s", 0),
        ("timeout_s", -1.0),
        ("timeout_s", True),
        ("verify", 1),
    ],
)
def test_settings_refuse_each_bad_value_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(SettingsError, match=field):
        SyncSettings(**{field: value})  # type: ignore[arg-type]


def test_settings_overrides_keep_what_is_none_and_refuse_unknown_names() -> None:
    base = SyncSettings(buffer_bytes=4096)
    assert base.with_overrides(timeout_s=None, num_buffers=3) == SyncSettings(buffer_bytes=4096, num_buffers=3)
    with pytest.raises(SettingsError, match="bufer_bytes"):
        base.with_overrides(bufer_bytes=1)
    with pytest.raises(TypeError):
        SyncSettings(4096)  # type: ignore[misc]  # keyword-only


# --- transport choice ------------------------------------------------------------------


def info(node: str = "n1", device: str = "cpu", gpu: str | None = None, direct: bool = True) -> EndpointInfo:
    return EndpointInfo(
        node_id=node, node_ip="127.0.0.1", hostname="h", pid=1, device=device, gpu_uuid=gpu, sink_allows_direct=direct
    )


def test_auto_picks_direct_then_ipc_on_one_device_and_broadcast_elsewhere() -> None:
    trainer = info()
    assert choose_transport(trainer, info(), "auto", "w") == "direct"
    assert choose_transport(trainer, info(direct=False), "auto", "w") == "ipc"
    assert choose_transport(trainer, info(node="n2"), "auto", "w") == "broadcast"
    gpu = info(device="cuda", gpu="GPU-a")
    assert choose_transport(gpu, info(device="cuda", gpu="GPU-a"), "auto", "w") == "direct"
    assert choose_transport(gpu, info(device="cuda", gpu="GPU-b"), "auto", "w") == "broadcast"


def test_requests_the_layout_cannot_serve_are_refused_naming_the_worker() -> None:
    gpu = info(device="cuda", gpu="GPU-a")
    with pytest.raises(SettingsError, match="far.*broadcast"):
        choose_transport(info(), info(node="n2"), "ipc", "far")
    with pytest.raises(SettingsError, match="loader.*ipc"):
        choose_transport(info(), info(direct=False), "direct", "loader")
    with pytest.raises(SettingsError, match="same-gpu.*NCCL"):
        choose_transport(gpu, info(device="cuda", gpu="GPU-a"), "broadcast", "same-gpu")
    with pytest.raises(SettingsError, match="w.*'carrier-pigeon'"):
        choose_transport(info(), info(), "carrier-pigeon", "w")


# --- outcomes and blame ----------------------------------------------------------------


def out(party: str, status: Status = Status.OK, exc: BaseException | None = None) -> Outcome:
    if exc is not None:
        return failed(party, "sync", exc)
    return Outcome(party=party, phase="sync", status=status)


def test_a_frozen_worker_is_blamed_not_the_trainer_that_timed_out_waiting_for_it() -> None:
    outcomes = {
        "trainer": out("trainer", exc=TransferTimeout("late", blames=["w1"])),
        "w0": out("w0", exc=PeerAborted("trainer aborted", blames=["trainer"])),
        "w1": out("w1", Status.TIMED_OUT),
    }
    assert assign_blame(outcomes) == ["w1"]


def test_a_failure_of_its_own_is_blamed_and_its_consequences_are_not() -> None:
    outcomes = {
        "trainer": out("trainer", exc=PeerAborted("w1 refused", blames=["w1"])),
        "w0": out("w0", exc=PeerAborted("w1 refused", blames=["w1"])),
        "w1": out("w1", exc=ValueError("version 1 is older than 3")),
    }
    assert assign_blame(outcomes) == ["w1"]
    assert assign_blame({"trainer": out("trainer", Status.DEAD), "w0": out("w0", exc=PeerAborted("gone"))}) == [
        "trainer"
    ]


def test_when_only_consequences_remain_every_failing_party_is_blamed() -> None:
    outcomes = {
        "trainer": out("trainer", exc=TransferTimeout("slow")),
        "w0": out("w0", exc=TransferTimeout("slow")),
        "w1": out("w1"),
    }
    assert assign_blame(outcomes) == ["trainer", "w0"]
    assert assign_blame({"w0": out("w0")}) == []


def test_errors_keep_their_blame_across_pickling_and_outcomes_refuse_an_ok_with_an_error() -> None:
    again = pickle.loads(pickle.dumps(PeerAborted("w1 failed", blames=["w1"])))
    assert isinstance(again, PeerAborted) and again.blames == ("w1",) and again.consequence
    with pytest.raises(Exception, match="ok outcome"):
        Outcome(party="w0", phase="sync", status=Status.OK, error="ValueError")


# --- deadlines and checksums -----------------------------------------------------------


def test_deadlines_let_the_leader_fail_first_and_the_coordinator_last() -> None:
    d = Deadlines(10.0)
    assert d.leader(0) < d.follower(0) < d.coordinator_s <= 10.0 + 10.0
    assert Deadlines(1000.0).grace_s == 10.0


def test_tensor_checksums_see_one_flipped_bit_in_any_dtype() -> None:
    tensors = [torch.randn(7, 3), torch.randn(5).to(torch.bfloat16), torch.randint(0, 9, (3,), dtype=torch.uint8)]
    before = tensor_checksums(tensors)
    tensors[1].view(torch.uint8)[3] ^= 4
    after = tensor_checksums(tensors)
    assert before[0] == after[0] and before[2] == after[2] and before[1] != after[1]


# --- layering --------------------------------------------------------------------------


def test_importing_weightsync_loads_no_dtensor_yet_a_dtensor_is_told_once_one_exists() -> None:
    """Every actor imports weightsync at its start; DTensor's package costs more than the rest
    of it together, so it is loaded only by whoever makes DTensors."""
    code = """
import sys
import torch
import torch.distributed as dist
import weightsync, weightsync.glue.actors, weightsync.core.sharded, weightsync.core.transport.owner_writes
from weightsync.core.dtensors import is_dtensor
loaded = [m for m in sys.modules if m.startswith("torch.distributed.tensor")]
plain = torch.randn(4, 2)
before = is_dtensor(plain)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
sharded = distribute_tensor(plain, init_device_mesh("cpu", (1,)), [Shard(0)])
print(loaded, before, is_dtensor(sharded), is_dtensor(plain), is_dtensor(sharded.to_local()))
dist.destroy_process_group()
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "False", "True", "False", "False"], done.stdout


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_core_imports_no_ray_and_no_module_imports_in_a_cycle() -> None:
    """The rule follows the folder: every module under weightsync/core (a new one too) is
    Ray-free, transports import no endpoint, and the library never imports its tools."""
    graph = {}
    endpoints = {f"weightsync.core.{m}" for m in ("sender", "receiver", "sharded", "listener", "pusher")}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        imports = _imports(path)
        graph[module] = {m for m in imports if m.startswith("weightsync")}
        if module.startswith("weightsync.core"):
            assert not {m for m in imports if m == "ray" or m.startswith("ray.")}, f"{module} imports Ray"
        if module.startswith("weightsync.core.transport"):
            assert not graph[module] & endpoints, f"{module} imports an endpoint"
        if not module.startswith("weightsync.tools") and module != "weightsync.__main__":
            tools = {m for m in graph[module] if m.startswith("weightsync.tools")}
            assert not tools, f"{module} imports the tools ({sorted(tools)}); the library never imports its CLI"

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    cycles = [m for m in graph if m in reach(m) and m != "weightsync"]
    assert not cycles, f"import cycles through {cycles}"


def test_a_party_whose_own_device_work_timed_out_is_blamed_not_its_peer() -> None:
    outcomes = {
        "trainer": out("trainer", exc=StreamTimeout("trainer: writing into w0 timed out")),
        "w0": out("w0", exc=PeerAborted("trainer failed", blames=["trainer"])),
    }
    assert assign_blame(outcomes) == ["trainer"]


class RefusingComm:
    """Stands in for a group in which rank 1 refuses this sync's agreement."""

    rank, world_size, device = 0, 2, torch.device("cpu")

    def __init__(self) -> None:
        self.agreements: list[bool] = []
        self.aborted = False

    def agree(self, refuse: bool, deadline: float) -> list[int]:
        self.agreements.append(refuse)
        return [1]

    def broadcast(self, tensor: torch.Tensor, src: int, stream_pointer: int = 0) -> object:
        raise AssertionError("no byte may move after a refused agreement")

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        pass


def test_a_refused_agreement_names_the_refuser_moves_nothing_and_keeps_the_group() -> None:
    from weightsync.core.transport.base import Sources
    from weightsync.core.transport.broadcast import BroadcastSender
    from weightsync.core.wire import Manifest, SyncCall, TensorSpec

    manifest = Manifest.build([TensorSpec("w", (4,), "float32")], buffer_bytes=256)
    comm = RefusingComm()
    half = BroadcastSender(comm, session_of(manifest, timeout_s=5.0), ["trainer", "w1"])
    with pytest.raises(PeerAborted) as info:
        half.send(Sources([torch.randn(4)], None), SyncCall(seq=0, version=1), time.monotonic() + 5)
    assert info.value.blames == ("w1",)
    half.abort()  # what the sender does next: nothing more to tell, and the group stays
    assert comm.agreements == [False] and not comm.aborted
