"""Dense against delta syncs of the 1gb policy (fp32 master weights, bf16 wire) over gloo broadcast to
2 workers, in one run with the same actors: dense, delta after real AdamW steps at lr 1e-6, delta with
every element changed. Prints each sync and the medians (docs/benchmarks.md, "Delta syncs")::

    .venv/bin/python scripts/delta_sync.py
"""

import dataclasses
import os
import statistics

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
import ray
import torch

import weightsync
from weightsync.glue.actors import TrainerActor, WorkerActor
from weightsync.tools.cluster import connect
from weightsync.tools.models import PolicyFactory, build_policy, train_step


class F:
    def __init__(s, dtype, seed):
        s.cfg = dataclasses.replace(PolicyFactory("1gb", seed).cfg, dtype=dtype)

    def __call__(s):
        return build_policy(s.cfg)


def step(model, v):
    return train_step(model, v, lr=1e-6)


def all_changed(model, v):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)


if __name__ == "__main__":
    connect()
    t = TrainerActor.options(num_cpus=0).remote(F("float32", 0), wire_dtype=torch.bfloat16)
    ws_ = [WorkerActor.options(num_cpus=0).remote(F("bfloat16", i + 1)) for i in range(2)]
    v = 0

    def run(ws, prep, n):
        global v
        out = []
        for _ in range(n):
            v += 1
            if prep:
                ray.get(t.call.remote(prep, v), timeout=600)
            r = ws.sync(v)
            out.append(r)
            print(f"  {r.summary()}", flush=True)
        return out

    dense = weightsync.WeightSync(t, ws_, transport="broadcast", timeout_s=600)
    dense.setup()
    run(dense, None, 1)
    d = run(dense, None, 3)
    dense.close()
    delta = weightsync.WeightSync(t, ws_, transport="broadcast", timeout_s=600, delta=True)
    delta.setup()
    run(delta, None, 1)
    run(delta, step, 1)
    s = run(delta, step, 3)
    a = run(delta, all_changed, 3)
    dense2 = weightsync.WeightSync(t, ws_, transport="broadcast", timeout_s=600)
    dense2.setup()
    d2 = run(dense2, None, 3)
    dense2.close()
    med = lambda rs: statistics.median(r.seconds for r in rs)
    dm = med(d + d2)
    print(
        f"dense median {dm * 1e3:.1f} ms; delta after AdamW lr1e-6 median {med(s) * 1e3:.1f} ms ({dm / med(s):.2f}x faster), sent {statistics.median(r.sent_bytes / r.bytes for r in s) * 100:.1f}%; 100% changed median {med(a) * 1e3:.1f} ms ({med(a) / dm:.3f}x dense), sent {statistics.median(r.sent_bytes / r.bytes for r in a) * 100:.1f}%"
    )
