"""The setup sequence: from a list of parties to open transports, refusing any mismatch first.

Every step is one set of Ray calls, submitted together and judged by the failure policy
(:class:`~weightsync.glue.steps.Steps`). In order::

    close       every party closes what the last session left open
    describe    every party says where it lives (node, device, GPU, free memory, sink)
    board       the parties on the coordinator's host take its reply board
                (:mod:`weightsync.glue.replies`), to answer sync calls on it
    choose      per worker: the trainer rank serving it and its transport (registry, choice)
    manifest    every trainer rank builds the manifest of its model; with ranks, each rank's
                layout too; ranks that disagree are refused by name
    accept      every worker checks the manifest and starts its Session (its server named)
    open        per registered transport, per serving party with workers on it: the
                plug-in's own steps (:mod:`weightsync.glue.opening`)
    mode        push mode: its plug-in's steps, after the transport it runs over

Nothing names a transport: the registry says which exist, whom each serves and in which
order they open.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from weightsync.core import registry
from weightsync.core.plugin import Mode, Serving, Slots
from weightsync.core.policy import judge
from weightsync.core.wire.casts import count_casts
from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import EndpointInfo
from weightsync.core.wire.outcome import Outcome, failed
from weightsync.core.wire.settings import SyncSettings
from weightsync.core.wire.sizing import BufferHints
from weightsync.glue.membership import Member, Membership
from weightsync.glue.opening import open_plugin
from weightsync.glue.steps import Steps

log = logging.getLogger("weightsync")


def slots_on_one_device(transports: Iterable[str]) -> bool:
    """Whether every one of ``transports`` that uses slots fills and drains them on the
    trainer's device alone (``Slots.ONE_DEVICE``), and one of them does."""
    slots = {registry.get(kind).slots for kind in transports} - {Slots.NONE}
    return slots == {Slots.ONE_DEVICE}


class Setup:
    """Runs the sequence for one WeightSync; :attr:`infos` keeps the last description."""

    def __init__(
        self,
        membership: Membership,
        steps: Steps,
        settings: SyncSettings,
        options: Mapping[str, Any],
        mode: Mode | None,
        worker_ranks: Mapping[str, int],
    ) -> None:
        self.membership = membership
        self.ranks = membership.ranks
        self.steps = steps
        self.settings = settings
        self.options = options
        self.mode = mode
        self.worker_ranks = worker_ranks
        self.infos: dict[str, EndpointInfo] = {}

    def run(self) -> Manifest:
        handles = self.membership.handles()
        self.steps.run(
            {(p, "teardown"): self.steps.close_call(p, h, True, "a new setup") for p, h in handles.items()},
            "closing the last session",
            self.steps.deadlines.startup_s,
        )
        outs = self.steps.run(
            {(p, "describe"): h.ws_describe.remote(**self.steps.trainer_kwargs(p)) for p, h in handles.items()},
            "describing the parties",
        )
        self.infos = {p: o.value for p, o in outs.items()}
        if self.settings.reply_board:
            self.steps.replies.offer(handles, self.infos, self.steps.gather)
        else:
            self.steps.replies.close()
        self._choose()
        manifest = self._manifest()
        self._accept(manifest)
        self.open(self.membership.members.values())
        if self.mode is not None:
            self._open_mode(self.mode)
        log.info(
            "weightsync: set up %d worker(s) %s, %d tensors, %.1f MB, %d chunk(s) of %d bytes",
            len(self.membership.members),
            self.membership.transports(),
            len(manifest.specs),
            manifest.total_bytes / 1e6,
            len(manifest.chunks),
            manifest.agreed.buffer_bytes,
        )
        return manifest

    def _choose(self) -> None:
        """Each worker's serving rank and transport; refused choices fail the setup by name."""
        rank_infos = [self.infos[r] for r in self.ranks.names]
        refused: dict[str, Outcome] = {}
        for member in self.membership.members.values():
            member.info = self.infos[member.name]
            try:
                member.rank, member.transport = self.ranks.choose(
                    member.name, member.info, member.requested, rank_infos, self.worker_ranks
                )
            except SettingsError as exc:
                refused[member.name] = failed(member.name, "choose", exc)
                continue
            if self.mode is not None and member.transport != self.mode.over:
                why = SettingsError(
                    f"{self.mode.name} mode needs every worker on the {self.mode.over} transport; {member.name} would "
                    f"use {member.transport!r} (its sink or placement rules {self.mode.over} out): drop the mode "
                    "or move the worker"
                )
                refused[member.name] = failed(member.name, "choose", why)
        verdict = judge(refused, "setup refused a transport")
        if verdict is not None:
            raise verdict.setup_error()

    def _hints(self) -> BufferHints:
        """What ``buffer_bytes="auto"`` is sized from: the trainer's device, every party's free
        memory, and whether every chosen transport with slots fills and drains them on one device."""
        lead = self.infos[self.ranks.lead]
        free = tuple(i.free_bytes for i in self.infos.values() if i.free_bytes is not None)
        one_device = slots_on_one_device(m.transport for m in self.membership.members.values())
        return BufferHints(device=lead.device, free_bytes=free, one_device=one_device)

    def _manifest(self) -> Manifest:
        ranks = self.ranks
        parties = ranks.parties()
        made = self.steps.run(
            {
                (r, "manifest"): h.ws_manifest.remote(self.settings, r, ranks.names, self._hints(), self.steps.owner)
                for r, h in parties.items()
            },
            "building the manifest",
        )
        layouts = None
        if ranks.sharded:
            laid = self.steps.run(
                {(r, "layout"): h.ws_layout.remote(r, owner=self.steps.owner) for r, h in parties.items()},
                "describing the trainer's ranks",
            )
            layouts = {r: laid[r].value for r in ranks.names}
        verdict = judge(
            ranks.disagreeing({r: made[r].value for r in ranks.names}, layouts), "setup refused the trainer's ranks"
        )
        if verdict is not None:
            self.steps.teardown(abort=True, why="a refused setup")
            raise verdict.setup_error()
        manifest: Manifest = made[ranks.lead].value
        return manifest

    def _accept(self, manifest: Manifest) -> None:
        """Every worker checks the manifest; each one's casts are kept on its Member (and
        logged: a lossy one as a warning, see :mod:`weightsync.core.wire.casts`)."""
        timeout = self.settings.timeout_s
        members = self.membership.members.values()
        outs = self.steps.run(
            {
                (m.name, "accept"): m.handle.ws_accept.remote(
                    manifest, m.name, self.ranks.names[m.rank], timeout, owner=self.steps.owner
                )
                for m in members
            },
            "in the handshake, before any byte moved",
        )
        for m in members:
            m.casts = tuple(outs[m.name].value or ())  # a worker without casts may answer None
            for count in count_casts(m.casts):
                level = logging.WARNING if count.loses else logging.INFO
                log.log(level, "weightsync: %s casts on load %s", m.name, count.line())

    def open(self, members: Iterable[Member]) -> None:
        """Open, in registry order, every transport of ``members`` on each party serving them
        (also to export the workers whose tensors moved since their export, again)."""
        chosen = list(members)
        for transport in registry.transports():
            if transport.serving is Serving.EVERY:
                mine = [m.name for m in chosen if m.transport == transport.name]
                names = self.ranks.names
                open_plugin(transport, self.steps, names[0], mine, self.infos, self.options, names)
                continue
            servers = [0] if transport.serving is Serving.LEAD else range(len(self.ranks.names))
            for rank in servers:
                mine = [m.name for m in chosen if m.transport == transport.name and m.rank == rank]
                open_plugin(transport, self.steps, self.ranks.names[rank], mine, self.infos, self.options)

    def _open_mode(self, mode: Mode) -> None:
        for rank, name in enumerate(self.ranks.names):
            mine = [m.name for m in self.membership.on(mode.over, rank)]
            open_plugin(mode, self.steps, name, mine, self.infos, self.options)
