"""A sync's report, assembled from the round's answers: bytes, chunks, time, each worker's state."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from weightsync.core import registry
from weightsync.core.wire.casts import count_casts
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import ReceiveResult, SendResult
from weightsync.core.wire.report import SyncReport, WorkerReport
from weightsync.glue.membership import Member


def build_report(
    version: int,
    manifest: Manifest,
    members: Iterable[Member],
    results: Mapping[str, ReceiveResult],
    sent: SendResult,
    seconds: float,
    verified: bool,
) -> SyncReport:
    """The report of one sync. ``chunks`` and ``inplace`` count the plan of the first
    transport of the sync in registry order (with the built-ins: the broadcast plan when a
    broadcast worker took part, else the packed plan)."""
    counts: dict[str, int] = {}
    workers = []
    for m in members:
        counts[m.transport] = counts.get(m.transport, 0) + 1
        r = results[m.name]
        workers.append(
            WorkerReport(
                name=m.name,
                transport=m.transport,
                version=r.version,
                state=r.state,
                seconds=r.seconds,
                held_off_s=r.held_off_s,
                stage=r.stage,
                casts=count_casts(m.casts),
                overflows=dict(r.overflows),
                encoding="" if r.delta is None else ("delta" if r.delta else "dense"),
                sent_bytes=sent.sent_bytes.get(m.transport, manifest.total_bytes),
            )
        )
    plans = [t.plan(manifest) for t in registry.transports() if t.name in counts]
    plan = plans[0] if plans else manifest.chunks
    total = manifest.total_bytes
    return SyncReport(
        version=version,
        bytes=total,
        chunks=len(plan),
        inplace=sum(1 for c in plan if c.inplace),
        seconds=seconds,
        gbps=total / seconds / 1e9 if seconds > 0 else 0.0,
        transports=counts,
        workers=workers,
        verified=verified,
        send_seconds=sent.seconds,
        sent_bytes=max(sent.sent_bytes.values()) if sent.sent_bytes else total,
        adapter=manifest.adapter.summary() if manifest.adapter is not None else "",
    )
