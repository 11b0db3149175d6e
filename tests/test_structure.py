"""The pure pieces of the restructured core, without Ray: settings, transport choice, blame
from outcomes, deadlines, and the layering rules (the control block: test_control_block.py)."""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import import_graph
from tests.helpers import session_of
from tests.import_graph import LAYERS, layer
from weightsync.core import registry
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
import weightsync, weightsync.glue.actors, weightsync.core.sharded, weightsync.transports.owner_writes.halves
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


#: Below glue/ nothing needs a cluster: no Ray there.
RAY_FREE_BELOW = LAYERS["weightsync.glue"]
#: The transports that build on another one's modules (its halves, setup steps, messages).
BUILDS_ON = {"owners": {"broadcast"}, "owner_writes": {"direct"}, "rank_ipc": {"ipc"}}


def transport_of(module: str) -> str | None:
    """The built-in transport folder ``module`` lies in, if any."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "transports" else None


def test_the_import_graph_resolves_submodules_and_sees_imports_inside_functions() -> None:
    """The graph these rules read is the one Python follows: ``from pkg import module`` is an
    edge to the module, and an import inside a function is an edge too."""
    graph = import_graph.build()
    assert "weightsync.core.registry" in graph.edges["weightsync.glue.round"]  # from weightsync.core import registry
    assert "weightsync.mechanisms.nccl" in graph.edges["weightsync.transports.broadcast.plugin"]  # inside a function
    assert "weightsync.core" not in graph.edges["weightsync.glue.round"]
    looped = import_graph.Graph(edges={"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, external={})
    assert looped.cycle() == ["a", "b", "c", "a"]


def test_no_module_imports_in_a_cycle() -> None:
    cycle = import_graph.build().cycle()
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_no_layer_imports_one_above_it_and_nothing_below_glue_imports_ray() -> None:
    """core/ and the mechanisms (and the transports) import no Ray, the mechanisms no
    transport and no endpoint, and the library never imports its CLI (tools/)."""
    graph = import_graph.build()
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.edges.items()
        for target in targets
        if layer(target) > layer(module)
    )
    assert not upward, f"imports of a higher layer: {upward}"
    ray = sorted(
        m
        for m, names in graph.external.items()
        if {n.split(".")[0] for n in names} & {"ray"} and layer(m) < RAY_FREE_BELOW
    )
    assert not ray, f"{ray} import Ray; everything below glue/ runs without a cluster"


def test_nothing_outside_a_transports_folder_names_it_and_each_folder_is_registered() -> None:
    """Only ``transports/<name>/`` imports its modules (and the transports that declare they
    build on it); the registry knows every folder, by dotted path, and nothing else."""
    graph = import_graph.build()
    strays = sorted(
        f"{module} -> {target}"
        for module, targets in graph.edges.items()
        for target in targets
        if (owner := transport_of(target)) is not None
        and transport_of(module) != owner
        and owner not in BUILDS_ON.get(transport_of(module) or "", set())
    )
    assert not strays, f"a built-in transport named outside its folder: {strays}"
    folders = {p.name for p in (import_graph.PACKAGE / "transports").iterdir() if (p / "plugin.py").is_file()}
    listed = {**registry.BUILTIN_TRANSPORTS, **registry.BUILTIN_MODES}
    assert {path.split(".")[2] for path in listed.values()} == folders
    assert all(
        path.startswith("weightsync.transports.") and path.endswith(":" + path.split(":")[1])
        for path in listed.values()
    )


def test_importing_weightsync_imports_no_transport_until_one_is_used() -> None:
    code = """
import sys
import weightsync
from weightsync.core import registry
def loaded():
    return sorted({m.split(".")[2] for m in sys.modules if m.startswith("weightsync.transports.")})
before = loaded()
names = registry.names()
registry.get("ipc")
print(before, loaded(), "broadcast" in names)
"""
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "['ipc']", "True"], done.stdout


#: Run in one fresh interpreter: the third-party packages the library imports are loaded
#: once, then every module is imported first, each in a process forked before any module
#: of weightsync was loaded (so each sees the state a fresh interpreter gives it).
_IMPORT_EACH = """
import importlib, os, sys, traceback
for name in sys.argv[1].split(","):
    try:
        importlib.import_module(name)
    except Exception:
        pass
assert not [m for m in sys.modules if m == "weightsync" or m.startswith("weightsync.")]
running = {}

def start(module):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(module)
            os._exit(0)
        except BaseException:
            os.write(write, traceback.format_exc().encode()[-2000:])
            os._exit(1)
    os.close(write)
    running[pid] = (module, read)

def finish():
    pid, status = os.wait()
    module, read = running.pop(pid)
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read().decode(errors="replace").strip()
    if status != 0:
        print("FAILED-IMPORT", module, (text.splitlines() or [str(status)])[-1])

for module in sys.argv[2:]:
    if len(running) >= 2:
        finish()
    start(module)
while running:
    finish()
"""


def test_every_module_imports_first_in_a_fresh_interpreter() -> None:
    """No module loads only because another was imported before it (an import cycle that
    happens to work in the order ``weightsync/__init__`` imports things)."""
    graph = import_graph.build()
    third_party = sorted({name for names in graph.external.values() for name in names})
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _IMPORT_EACH,
            ",".join(third_party),
            *sorted(set(graph.edges) - {"weightsync.__main__"}),
        ],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED-IMPORT")]
    assert not failed, "modules that fail to import first:\n" + "\n".join(failed)


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
    from weightsync.core.halves import Sources
    from weightsync.core.wire import Manifest, SyncCall, TensorSpec
    from weightsync.transports.broadcast.halves import BroadcastSender

    manifest = Manifest.build([TensorSpec("w", (4,), "float32")], buffer_bytes=256)
    comm = RefusingComm()
    half = BroadcastSender(comm, session_of(manifest, timeout_s=5.0), ["trainer", "w1"])
    with pytest.raises(PeerAborted) as info:
        half.send(Sources([torch.randn(4)], None), SyncCall(seq=0, version=1), time.monotonic() + 5)
    assert info.value.blames == ("w1",)
    half.abort()  # what the sender does next: nothing more to tell, and the group stays
    assert comm.agreements == [False] and not comm.aborted
