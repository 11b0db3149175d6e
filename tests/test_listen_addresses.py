"""What weightsync opens listens on loopback, or on the one address a cross-node group needs.

The embedded Ray cluster of ``connect()`` runs in a child process: this test process may
already hold the session's cluster (tests/conftest.py), and Ray allows one per process.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.listeners import is_loopback, listening
from weightsync.core.plugin import Request
from weightsync.core.wire.errors import TransferError
from weightsync.core.wire.messages import EndpointInfo
from weightsync.mechanisms.gloo import open_store
from weightsync.tools.head import WORKER_NICENESS
from weightsync.transports.broadcast.messages import GroupSpec
from weightsync.transports.broadcast.plugin import open_broadcast

ROOT = Path(__file__).resolve().parent.parent


def test_the_rendezvous_store_listens_on_its_address_only() -> None:
    store = open_store("127.0.0.1", 0, 2, 10.0)
    port = int(store.port)
    assert [address for address in listening({os.getpid()}) if address[1] == port] == [("127.0.0.1", port)]
    for other in ("127.0.0.2", "::1"):
        with pytest.raises(OSError), socket.create_connection((other, port), timeout=5):
            pass  # torch's own TCPStore server would accept here: it listens on *:port
    client = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=10), use_libuv=True
    )
    client.set("key", b"value")
    assert store.get("key") == b"value"
    del client, store
    assert not [address for address in listening({os.getpid()}) if address[1] == port]  # closed with the store


def test_a_store_address_that_is_not_this_hosts_is_refused_by_name() -> None:
    with pytest.raises(TransferError, match="203.0.113.7"):
        open_store("203.0.113.7", 0, 2, 5.0)


class FakeOpening:
    """An :class:`~weightsync.core.plugin.Opening` that records the requests."""

    def __init__(self, nodes: Mapping[str, str]) -> None:
        self.nodes = dict(nodes)
        self.requests: dict[str, dict[str, Request]] = {}

    @property
    def server(self) -> str:
        return "trainer"

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(name for name in self.nodes if name != "trainer")

    @property
    def options(self) -> Mapping[str, Any]:
        return {"backend": "gloo"}

    def info(self, party: str) -> EndpointInfo:
        ip = self.nodes[party]
        return EndpointInfo(
            node_id=f"node-{ip}", node_ip=ip, hostname="h", pid=1, device="cpu", gpu_uuid=None, sink_allows_direct=True
        )

    def step(self, requests: Mapping[str, Request], when: str) -> dict[str, Any]:
        action = next(iter(requests.values())).action
        self.requests[action] = dict(requests)
        if action == "store":
            return {name: (request.args[1], 4242) for name, request in requests.items()}
        return dict.fromkeys(requests)


def joined(opening: FakeOpening) -> dict[str, GroupSpec]:
    open_broadcast(opening)
    return {name: request.args[0] for name, request in opening.requests["join"].items()}


def test_a_group_on_one_node_meets_and_listens_on_loopback() -> None:
    opening = FakeOpening({"trainer": "10.0.0.5", "w0": "10.0.0.5", "w1": "10.0.0.5"})
    specs = joined(opening)
    assert opening.requests["store"]["trainer"].args[1] == "127.0.0.1"
    assert {(s.store_host, s.bind_host) for s in specs.values()} == {("127.0.0.1", "127.0.0.1")}
    names = {s.name for s in specs.values()}
    assert len(names) == 1
    prefix = names.pop().removeprefix("weightsync-")
    assert len(prefix) >= 32 and int(prefix, 16) >= 0  # a 128-bit secret, not a short id


def test_a_group_across_nodes_listens_on_each_partys_own_node_address() -> None:
    opening = FakeOpening({"trainer": "10.0.0.5", "w0": "10.0.0.5", "w1": "10.0.0.6"})
    specs = joined(opening)
    assert opening.requests["store"]["trainer"].args[1] == "10.0.0.5"
    assert {name: (s.store_host, s.bind_host) for name, s in specs.items()} == {
        "trainer": ("10.0.0.5", "10.0.0.5"),
        "w0": ("10.0.0.5", "10.0.0.5"),
        "w1": ("10.0.0.5", "10.0.0.6"),
    }
    first = joined(FakeOpening({"trainer": "10.0.0.5", "w0": "10.0.0.6"}))["trainer"].name
    assert first != specs["trainer"].name  # a fresh prefix per group


CONNECT = """
import json, os, sys
sys.path.insert(0, sys.argv[1])  # this checkout, found by path only: not the working directory
import ray  # imported first, as any program that uses Ray does before calling connect()
from tests.listeners import descendants, listening
from weightsync.tools.cluster import connect
how = connect(num_cpus=1)

@ray.remote
def package() -> tuple[str, int]:
    import weightsync
    return weightsync.__file__, os.nice(0)

try:
    nodes = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    found = listening(descendants(os.getpid()))
    where, nice = ray.get(package.remote(), timeout=120)
    result = {"how": how, "nodes": nodes, "listening": found, "package": where, "nice": nice, "driver": os.nice(0)}
    print("RESULT " + json.dumps(result))
finally:
    ray.shutdown()
"""


def test_the_embedded_cluster_is_on_loopback_and_its_workers_run_this_checkout_at_the_drivers_priority() -> None:
    # No PYTHONPATH and another working directory (Ray hands the driver's to its workers):
    # connect() itself must give the workers this checkout.
    drop = ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_TMPDIR", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    # A cluster of its own that no bare ray.init() elsewhere finds; a short path, since Ray's
    # socket paths under it must stay under 107 bytes.
    env["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="wsc-", dir="/tmp")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CONNECT, str(ROOT)],
            cwd=env["RAY_TMPDIR"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        shutil.rmtree(env["RAY_TMPDIR"], ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    assert result["how"]["node_ip"] == "127.0.0.1" and result["nodes"] == ["127.0.0.1"], result
    assert len(result["listening"]) >= 2, result  # at least the GCS and the raylet
    wide = [(address, port) for address, port in result["listening"] if not is_loopback(address)]
    assert not wide, f"the embedded cluster listens beyond loopback: {wide}"
    assert result["package"] == str(ROOT / "weightsync" / "__init__.py"), result["package"]
    # Not Ray's 15 above the driver: a busy machine would starve the actors past every deadline.
    assert result["nice"] == result["driver"] + WORKER_NICENESS, result
