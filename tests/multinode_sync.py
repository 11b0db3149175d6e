"""A three-party sync across two Ray nodes on one machine; run by tests/test_multinode.py.

Runs in its own process because it starts its own cluster (``ray.cluster_utils.Cluster``)
and the test session already has one (tests/conftest.py: one cluster per process).

Node A is the head (127.0.0.1); node B (127.0.0.2, still loopback) holds the trainer, a
module worker and a load_weights worker; a third worker sits on node A. ``auto`` must pick
direct and ipc on B and broadcast to A, in one sync, bit-exact. The trainer's node reports
127.0.0.2: the broadcast rendezvous (the trainer's store) must listen on that address, the
one Ray reports for the trainer's node, not on the host name's address, 127.0.0.1 or every
interface; the check reads the trainer process's own listening sockets. Prints one JSON
line with what it saw; any failed check raises (exit status 1).

    python tests/multinode_sync.py        # from the repository root
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parent.parent)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
# Cluster() records its address in $RAY_TMPDIR/ray/ray_current_cluster: keep it private so no
# other process on the machine that calls a bare ray.init() finds (and joins) this cluster.
os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="wsmn-", dir="/tmp")
sys.path.insert(0, ROOT)

import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from tests.helpers import MixedModel, perturb, state_of  # noqa: E402
from tests.listeners import listening as listening_on  # noqa: E402
from weightsync import TrainerActor, WeightSync, WorkerActor  # noqa: E402

TIMEOUT = 120.0
NODE_B_IP = "127.0.0.2"


class LoadingModel(MixedModel):
    """Loads through load_weights, by name, as inference engines do (so auto picks ipc)."""

    def load_weights(self, weights: Any) -> set[str]:
        own = dict(self.named_parameters()) | dict(self.named_buffers())
        for name, tensor in weights:
            own[name].data.copy_(tensor)
        return set(own)


def get(ref: Any) -> Any:
    return ray.get(ref, timeout=TIMEOUT)


def node_of(model: Any) -> str:
    return str(ray.get_runtime_context().get_node_id())


def listening(model: Any) -> list[str]:
    """``ip:port`` of every TCP socket (IPv4 and IPv6) this process listens on (from /proc)."""
    return [f"{address}:{port}" for address, port in listening_on({os.getpid()})]


def main() -> dict[str, Any]:
    node_args = {"num_cpus": 1, "include_dashboard": False, "object_store_memory": 100 * 2**20}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "node_ip_address": "127.0.0.1"})
    try:
        node_b = cluster.add_node(**node_args, node_ip_address=NODE_B_IP, resources={"node_b": 4})
        cluster.wait_for_nodes()
        ray.init(
            address=cluster.address,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": ROOT, "GLOO_SOCKET_IFNAME": "lo"}},
        )
        try:
            return sync_across_nodes(cluster.head_node.node_id, node_b.node_id)
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)


def sync_across_nodes(node_a: str, node_b: str) -> dict[str, Any]:
    addresses = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert addresses == {node_a: "127.0.0.1", node_b: NODE_B_IP}, addresses

    def on(node: str) -> dict[str, Any]:
        return {"num_cpus": 0, "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

    trainer = TrainerActor.options(**on(node_b)).remote(lambda: MixedModel(seed=0))
    workers = {
        "same-node-module": WorkerActor.options(**on(node_b)).remote(lambda: MixedModel(seed=1)),
        "same-node-loader": WorkerActor.options(**on(node_b)).remote(lambda: LoadingModel(seed=2), sink="load_weights"),
        "other-node": WorkerActor.options(**on(node_a)).remote(lambda: MixedModel(seed=3)),
    }
    handles = [trainer, *workers.values()]
    try:
        placed = dict(zip(["trainer", *workers], get([h.call.remote(node_of) for h in handles])))
        assert placed == {
            "trainer": node_b,
            "same-node-module": node_b,
            "same-node-loader": node_b,
            "other-node": node_a,
        }, placed
        reports = []
        before = set(get(trainer.call.remote(listening)))
        with WeightSync(trainer, workers, transport="auto", buffer_bytes=64 * 1024, timeout_s=TIMEOUT) as ws:
            chosen = ws.transports()
            assert chosen == {"same-node-module": "direct", "same-node-loader": "ipc", "other-node": "broadcast"}, (
                chosen
            )
            for version in (1, 2):
                get(trainer.call.remote(perturb, 100 + version))
                report = ws.sync(version)
                assert report.transports == {"direct": 1, "ipc": 1, "broadcast": 1}, report.transports
                assert [w.version for w in report.workers] == [version] * 3, report.workers
                expected = get(trainer.call.remote(state_of))
                for name, worker in workers.items():
                    got = get(worker.call.remote(state_of))
                    assert got.keys() == expected.keys(), (name, sorted(got), sorted(expected))
                    for tensor in expected:
                        assert torch.equal(got[tensor], expected[tensor]), f"{name}: {tensor} differs"
                reports.append(report.to_dict())
            opened = sorted(set(get(trainer.call.remote(listening))) - before)
            hosts = {address.rsplit(":", 1)[0] for address in opened}
            assert NODE_B_IP in hosts, f"no rendezvous listener on the trainer node's address {NODE_B_IP}: {opened}"
            assert not hosts & {"0.0.0.0", "::"}, f"a weightsync socket listens on every interface: {opened}"
        return {
            "nodes": {k: addresses[v] for k, v in placed.items()},
            "transports": chosen,
            "syncs": len(reports),
            "trainer_listeners": opened,
            "bit_exact": sorted(workers),
        }
    finally:
        for handle in handles:
            ray.kill(handle)


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)
