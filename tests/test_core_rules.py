"""The pure pieces of the core, without Ray: settings, transport choice, blame from outcomes,
deadlines, checksums, and a broadcast sync refused in its agreement (the control block:
test_control_block.py; the layering rules: test_structure.py)."""

from __future__ import annotations

import math
import pickle
import time

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
