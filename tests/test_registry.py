"""Transports as plug-ins: a transport defined in tests/, registered without touching the
package, syncs bit-exact next to a built-in one in the same sync, and its failures are
blamed like any other's; the registry, the plug-in contract and the one failure policy."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import ray

from tests import toy_transport as toy
from tests.conftest import RAY_TIMEOUT
from tests.helpers import MixedModel, assert_bit_equal, perturb, state_of
from weightsync import SettingsError, Status, SyncError, TrainerActor, WeightSync, WeightSyncError, WorkerActor
from weightsync.core import registry
from weightsync.core.choice import choose_transport, requests
from weightsync.core.plugin import Transport
from weightsync.core.policy import judge
from weightsync.core.wire import EndpointInfo, Outcome, PeerAborted, TransferTimeout
from weightsync.core.wire.outcome import failed


def get(ref: Any) -> Any:
    return ray.get(ref, timeout=RAY_TIMEOUT)


@pytest.fixture
def pickled() -> Iterator[Transport]:
    registry.register(toy.PICKLED)
    try:
        yield toy.PICKLED
    finally:
        registry.unregister(toy.PICKLED.name)
        toy.shut_queues(toy.QUEUES)
        toy.QUEUES.clear()


def info(node: str = "n1", direct: bool = True) -> EndpointInfo:
    return EndpointInfo(
        node_id=node, node_ip="127.0.0.1", hostname="h", pid=1, device="cpu", gpu_uuid=None, sink_allows_direct=direct
    )


# --- the registry (no Ray) ------------------------------------------------------------------


def test_a_registered_transport_can_be_requested_but_auto_never_picks_it(pickled: Transport) -> None:
    assert "pickled" in registry.names() and "pickled" in requests()
    assert choose_transport(info(), info(node="n2"), "pickled", "w") == "pickled"
    assert choose_transport(info(), info(node="n2"), "auto", "w") == "broadcast"  # no auto_rank: only on request
    with pytest.raises(SettingsError, match="already registered"):
        registry.register(toy.PICKLED)


def test_colocated_transports_need_the_two_in_one_pid_namespace() -> None:
    """ipc and direct watch their peer by pid: across pid namespaces auto takes broadcast,
    and asking for them is refused naming the worker and both namespaces."""
    here, apart = replace(info(), pidns=11), replace(info(), pidns=22)
    assert choose_transport(here, replace(info(), pidns=11), "auto", "w") == "direct"
    assert choose_transport(here, apart, "auto", "w") == "broadcast"
    for kind in ("ipc", "direct"):
        with pytest.raises(SettingsError, match="pid namespace") as err:
            choose_transport(here, apart, kind, "w")
        assert "pid namespace 11" in str(err.value) and "w (pid namespace 22)" in str(err.value), err.value
    assert choose_transport(info(), apart, "auto", "w") == "direct"  # a namespace not reported (0) is not judged
    with pytest.raises(WeightSyncError, match="pidns"):
        replace(info(), pidns=-1)


def test_unknown_names_and_bad_plugins_are_refused_naming_them() -> None:
    with pytest.raises(SettingsError, match="pickled"):
        registry.get("pickled")  # not registered outside the fixture
    with pytest.raises(SettingsError, match="Bad Name"):
        Transport(**{**_fields(toy.PICKLED), "name": "Bad Name"})
    with pytest.raises(SettingsError, match="send_half"):
        Transport(**{**_fields(toy.PICKLED), "send_half": object})
    with pytest.raises(SettingsError, match="no worker action 'export'"):
        toy.PICKLED.action("worker", "export")
    with pytest.raises(SettingsError, match="auto"):
        registry.register(Transport(**{**_fields(toy.PICKLED), "name": "auto"}))


def _fields(t: Transport) -> dict[str, Any]:
    return {f: getattr(t, f) for f in t.__dataclass_fields__}


def test_the_builtins_declare_their_commit_rule_and_order() -> None:
    by_name = {t.name: t for t in registry.transports()}
    assert [n for n in by_name if n in ("broadcast", "ipc", "direct")] == ["broadcast", "ipc", "direct"]
    assert not by_name["broadcast"].commits_alone and by_name["ipc"].commits_alone and by_name["direct"].commits_alone
    assert not by_name["owners"].commits_alone and by_name["owner-writes"].commits_alone
    assert by_name["rank-ipc"].commits_alone and by_name["rank-ipc"].feeds_parts
    assert not any(t.feeds_parts for n, t in by_name.items() if n != "rank-ipc")
    auto = [t.name for t in registry.auto_candidates()][:6]
    assert auto == ["owner-writes", "direct", "rank-ipc", "ipc", "owners", "broadcast"]


def test_one_policy_judges_every_failure_the_same_way() -> None:
    outcomes = {
        "trainer": failed("trainer", "send", TransferTimeout("late", blames=["w1"])),
        "w0": failed("w0", "receive", PeerAborted("trainer failed", blames=["trainer"])),
        "w1": Outcome(party="w1", phase="receive", status=Status.TIMED_OUT),
        "w2": Outcome(party="w2", phase="receive", status=Status.DEAD),
        "w3": Outcome(party="w3", phase="receive", status=Status.OK),
    }
    verdict = judge(outcomes, "sync failed")
    assert verdict is not None
    assert verdict.culprits == ("w1", "w2") and verdict.dead == ("w2",) and verdict.silent == ("w1",)
    assert verdict.settle(["w0", "w1", "w2", "w3"]) == ["w0", "w3"]
    error = verdict.sync_error({"w0": (3, "dirty")}, dropped=["w2"])
    assert error.culprits == ["w1", "w2"] and error.dead == ["w2"] and error.held == {"w0": (3, "dirty")}
    assert "dropped dead worker(s) w2" in str(error) and "w0 v3 dirty" in str(error)
    assert judge({"w3": outcomes["w3"]}, "fine") is None


# --- through Ray ----------------------------------------------------------------------------


def test_a_plugin_from_tests_syncs_bit_exact_beside_a_builtin_and_blames_a_dead_worker(
    actors: Any, pickled: Transport
) -> None:
    trainer = actors.add(TrainerActor.options(num_cpus=0).remote(functools.partial(MixedModel, seed=0)))
    toy_worker = actors.add(WorkerActor.options(num_cpus=0).remote(functools.partial(MixedModel, seed=1)))
    builtin = actors.add(WorkerActor.options(num_cpus=0).remote(functools.partial(MixedModel, seed=2)))
    ws = WeightSync(
        trainer, {"toy": toy_worker, "bc": builtin}, transport={"toy": "pickled", "bc": "broadcast"}, timeout_s=30
    )
    with ws:
        assert ws.transports() == {"toy": "pickled", "bc": "broadcast"}
        for version in (1, 2):
            get(trainer.call.remote(perturb, version))
            report = ws.sync(version)
            assert report.transports == {"pickled": 1, "broadcast": 1}
            assert {w.name: (w.version, w.state) for w in report.workers} == {
                "toy": (version, "committed"),
                "bc": (version, "committed"),
            }
            expected = get(trainer.call.remote(state_of))
            for worker in (toy_worker, builtin):
                got = get(worker.call.remote(state_of))
                for name in expected:
                    assert_bit_equal(got[name], expected[name], name)
        ws.verify()
        ray.kill(toy_worker)
        get(trainer.call.remote(perturb, 3))
        with pytest.raises(SyncError) as failure:
            ws.sync(3)
        err = failure.value
        assert err.culprits == ["toy"] and err.dead == ["toy"]
        assert "dropped dead worker(s) toy" in str(err)
        assert ws.transports() == {"bc": "broadcast"}
        report = ws.sync(3)  # the next sync sets up without the dead worker
        assert [(w.name, w.version) for w in report.workers] == [("bc", 3)]
        got, expected = get(builtin.call.remote(state_of)), get(trainer.call.remote(state_of))
        assert got.keys() == expected.keys()
        for name in expected:
            assert_bit_equal(got[name], expected[name], name)
