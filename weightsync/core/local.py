"""A transport plug-in's setup run in this process: endpoints without actors or a cluster.

The coordinator runs a plug-in's steps over Ray; :func:`open_local` runs the same steps
on endpoints that live in this process (a trainer's :class:`~weightsync.core.sender.WeightSender`
and workers' :class:`~weightsync.core.receiver.WeightReceiver`), each party's action in its
own thread, as the parties would run them at once (a group's join blocks until every rank
joined). For tests, tools and single-process layouts. Call order::

    manifest = sender.manifest(settings)
    for r in receivers.values(): r.accept(manifest, sender.name, settings.timeout_s)
    open_local(registry.get("ipc"), sender, receivers)
    # then, per sync: sender.send(call) and every receiver.receive(call), at the same time
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from weightsync.core.placement import describe_here
from weightsync.core.plugin import Plugin, Request, TrainerSide, WorkerSide
from weightsync.core.policy import judge
from weightsync.core.wire.messages import EndpointInfo
from weightsync.core.wire.outcome import Outcome, failed, ok


@dataclass(frozen=True, kw_only=True)
class LocalOpening:
    """An :class:`~weightsync.core.plugin.Opening` over endpoints of this process."""

    plugin: Plugin
    trainer: TrainerSide
    workers: Mapping[str, WorkerSide]
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def server(self) -> str:
        return self.trainer.session.party

    @property
    def servers(self) -> tuple[str, ...]:
        return (self.server,)

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self.workers)

    def info(self, party: str) -> EndpointInfo:
        side = self.trainer if party == self.server else self.workers[party]
        return describe_here(side.device, node_ip="127.0.0.1")  # every party is in this process

    def step(self, requests: Mapping[str, Request], when: str) -> dict[str, Any]:
        outcomes: dict[str, Outcome] = {}

        def run(party: str, request: Request) -> None:
            if party == self.server:
                side: Any = self.trainer
                action = self.plugin.action("trainer", request.action)
            else:
                side = self.workers[party]
                action = self.plugin.action("worker", request.action)
            try:
                outcomes[party] = ok(party, request.action, action(side, *request.args))
            except Exception as exc:  # noqa: BLE001 - judged with every party's below
                outcomes[party] = failed(party, request.action, exc)

        threads = [threading.Thread(target=run, args=item, daemon=True) for item in requests.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        verdict = judge(outcomes, f"setup failed {when} ({self.plugin.name})")
        if verdict is not None:
            raise verdict.setup_error()
        return {party: outcomes[party].value for party in requests}


def open_local(
    plugin: Plugin,
    trainer: TrainerSide,
    workers: Mapping[str, WorkerSide],
    options: Mapping[str, Any] | None = None,
) -> None:
    """Run ``plugin``'s setup for ``trainer`` serving ``workers`` (by name), in this process."""
    if workers:
        plugin.open(LocalOpening(plugin=plugin, trainer=trainer, workers=workers, options=options or {}))
