"""Ray metrics for syncs: counts, bytes, a histogram of seconds, failures.

Exported through ``ray.util.metrics``, so the Ray dashboard and its Prometheus endpoint
show them as ``weightsync_syncs``, ``weightsync_bytes``, ``weightsync_sync_seconds`` and
``weightsync_failures``, tagged by the transports used.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from weightsync.core.wire.report import SyncReport

log = logging.getLogger("weightsync")

_BOUNDARIES = [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0]


class SyncMetrics:
    """Created lazily: metrics need a connected Ray, which a WeightSync may predate."""

    def __init__(self) -> None:
        self._made = False
        self._syncs: Any = None
        self._bytes: Any = None
        self._seconds: Any = None
        self._failures: Any = None

    def _make(self) -> bool:
        if not self._made:
            self._made = True
            try:
                from ray.util import metrics

                self._syncs = metrics.Counter("weightsync_syncs", "Completed weight syncs", tag_keys=("transports",))
                self._bytes = metrics.Counter("weightsync_bytes", "Model bytes synced", tag_keys=("transports",))
                self._seconds = metrics.Histogram(
                    "weightsync_sync_seconds", "Wall time of one sync", boundaries=_BOUNDARIES, tag_keys=("transports",)
                )
                self._failures = metrics.Counter("weightsync_failures", "Failed weight syncs")
            except Exception as exc:  # noqa: BLE001 - metrics are optional; say why they are off
                log.warning("weightsync: Ray metrics unavailable, syncs are not exported: %s", exc)
        return self._syncs is not None

    def record(self, report: SyncReport) -> None:
        if self._make():
            tags = {"transports": ",".join(sorted(report.transports))}
            self._syncs.inc(1, tags=tags)
            if report.bytes > 0:  # Ray refuses a zero increment (a model of empty tensors)
                self._bytes.inc(report.bytes, tags=tags)
            self._seconds.observe(report.seconds, tags=tags)

    def failed(self) -> None:
        if self._make():
            self._failures.inc(1)
