"""Two Ray nodes on one machine: auto picks direct/ipc on the trainer's node, broadcast across.

The scenario runs in a child process (tests/multinode_sync.py) because it needs a cluster of
its own with two nodes, and this test process may already hold the session's one-node
cluster (tests/conftest.py); Ray allows one cluster connection per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_one_sync_mixes_direct_ipc_on_the_trainers_node_and_broadcast_to_another_node() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_TMPDIR")}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "multinode_sync.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    assert result["nodes"] == {
        "trainer": "127.0.0.2",
        "same-node-module": "127.0.0.2",
        "same-node-loader": "127.0.0.2",
        "other-node": "127.0.0.1",
    }
    assert result["transports"] == {"same-node-module": "direct", "same-node-loader": "ipc", "other-node": "broadcast"}
    assert result["syncs"] == 2
    assert result["bit_exact"] == ["other-node", "same-node-loader", "same-node-module"]
    assert any(address.startswith("127.0.0.2:") for address in result["trainer_listeners"])
