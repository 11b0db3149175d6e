"""A transport plug-in's setup steps, run over Ray: the :class:`Opening` the plug-ins are given.

Each :class:`~weightsync.core.plugin.Request` of a step becomes one call of the
party's ``ws_open(plugin, action, *args)``, all submitted together and awaited once by
:class:`~weightsync.glue.steps.Steps` (a failure raises SetupError naming every failing
party, after the set-up was torn down). Call order, from the setup sequence::

    open_plugin(plugin, steps, server="trainer-rank-1", members=["w2", "w3"], infos, options)
        -> plugin.open(RayOpening(...))     the plug-in's own steps
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightsync.core.plugin import Plugin, Request
from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.messages import EndpointInfo
from weightsync.glue.steps import Steps


@dataclass(frozen=True, kw_only=True)
class RayOpening:
    """One serving party's opening of one plug-in (see :class:`~weightsync.core.plugin.Opening`)."""

    plugin: Plugin
    server: str
    members: tuple[str, ...]
    servers: tuple[str, ...] = ()
    infos: Mapping[str, EndpointInfo]
    steps: Steps
    options: Mapping[str, Any] = field(default_factory=dict)

    def info(self, party: str) -> EndpointInfo:
        found = self.infos.get(party)
        if found is None:
            raise SettingsError(f"{self.plugin.name}: no description of party {party!r} at this setup")
        return found

    def step(self, requests: Mapping[str, Request], when: str) -> dict[str, Any]:
        allowed = {self.server, *self.servers, *self.members}
        strangers = sorted(set(requests) - allowed)
        if strangers:
            raise SettingsError(
                f"plug-in {self.plugin.name!r} asked {strangers} in a step of {self.server}'s opening; "
                f"it may ask only {sorted(allowed)}"
            )
        handles = self.steps.membership.handles()
        calls = {
            (party, request.action): handles[party].ws_open.remote(
                self.plugin, request.action, *request.args, **self.steps.trainer_kwargs(party)
            )
            for party, request in requests.items()
        }
        outs = self.steps.run(calls, f"{when} ({self.plugin.name})")
        return {party: outs[party].value for party in requests}


def open_plugin(
    plugin: Plugin,
    steps: Steps,
    server: str,
    members: Sequence[str],
    infos: Mapping[str, EndpointInfo],
    options: Mapping[str, Any],
    servers: Sequence[str] = (),
) -> None:
    """Run ``plugin``'s setup for ``server`` (with ``servers``: every serving party, ``server``
    first) and its ``members`` (nothing when it has none)."""
    if members:
        plugin.open(
            RayOpening(
                plugin=plugin,
                server=server,
                members=tuple(members),
                servers=tuple(servers) or (server,),
                infos=infos,
                steps=steps,
                options=options,
            )
        )
