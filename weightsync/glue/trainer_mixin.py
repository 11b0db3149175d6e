"""The trainer's side of the coordinator's protocol, as a mixin for any trainer actor.

Mix :class:`TrainerMixin` into a Ray actor that holds ``self.model`` (or overrides
``weightsync_model()``); :class:`~weightsync.glue.coordinator.WeightSync` drives its ``ws_*``
methods, each answering an :class:`~weightsync.core.wire.outcome.Outcome`. Call order per
session: ws_describe -> ws_manifest (-> ws_layout for ranks) -> the transports' steps
(ws_open_store/ws_join_broadcast, ws_export_ipc/ws_seal_ipc, ws_map_direct, ws_arm) ->
per sync ws_send (or ws_push) -> ws_teardown.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from weightsync.core.pusher import Pusher
from weightsync.core.sender import WeightSender
from weightsync.core.sharded import ShardedSender, has_dtensors
from weightsync.core.transport.gloo import open_store
from weightsync.core.wire.errors import SettingsError, SyncError, WeightSyncError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import (
    DirectExport,
    GroupSpec,
    PushExport,
    PushResult,
    SourceLayout,
    SyncCall,
)
from weightsync.core.wire.outcome import Outcome, Status, assign_blame, describe_failure
from weightsync.core.wire.settings import SyncSettings
from weightsync.core.wire.sizing import BufferHints
from weightsync.glue.protocol import answer, communicator, describe, resolve_device


class TrainerMixin:
    """Weight-sync methods for a trainer actor. Needs ``self.model`` (or override
    ``weightsync_model``); optionally ``self.device`` and ``self.wire_dtype``."""

    _ws_store: Any = None
    _ws_pusher: Pusher | None = None

    def weightsync_model(self) -> nn.Module:
        return self.model  # type: ignore[attr-defined, no-any-return]

    def weightsync_device(self) -> torch.device:
        return resolve_device(getattr(self, "device", "cpu"))

    def _ws(self) -> WeightSender:
        sender = getattr(self, "_ws_sender", None)
        if sender is None:
            model = self.weightsync_model()
            kind = ShardedSender if has_dtensors(model) else WeightSender
            sender = kind(
                model=model,
                device=self.weightsync_device(),
                wire_dtype=getattr(self, "wire_dtype", None),
            )
            self._ws_sender = sender
        return sender

    def ws_describe(self) -> Outcome:
        return answer("trainer", "describe", describe, self.weightsync_device(), True)

    def ws_manifest(
        self,
        settings: SyncSettings,
        party: str = "trainer",
        ranks: Sequence[str] = (),
        hints: BufferHints | None = None,
    ) -> Outcome:
        """The manifest of the model as it is now; ``party``/``ranks``: this rank's name and
        every rank's, in rank order (a sharded trainer checks it was given its mesh's order);
        ``hints``: what ``buffer_bytes="auto"`` is sized from."""

        def build() -> Manifest:
            sender = self._ws()
            if isinstance(sender, ShardedSender):
                sender.bind(party, ranks)
            sender.name = party
            return sender.manifest(settings, hints)

        return answer(party, "manifest", build)

    def ws_layout(self, party: str = "trainer") -> Outcome:
        """Whether this rank's model is sharded (DTensors) and over which mesh: the ranks of one
        trainer must agree (a plain rank among sharded ones would never join their gathers)."""

        def layout() -> SourceLayout:
            sender = self._ws()
            return sender.layout() if isinstance(sender, ShardedSender) else SourceLayout(sharded=False)

        return answer(party, "layout", layout)

    def ws_open_store(self, world_size: int, timeout_s: float, host: str) -> Outcome:
        def open_it() -> tuple[str, int]:
            self._ws_store = open_store(host, 0, world_size, timeout_s)
            return host, int(self._ws_store.port)

        return answer("trainer", "store", open_it)

    def ws_nccl_id(self) -> Outcome:
        from weightsync.core.transport.nccl import make_unique_id

        return answer("trainer", "nccl id", make_unique_id)

    def ws_join_broadcast(self, spec: GroupSpec, members: Sequence[str]) -> Outcome:
        def join() -> None:
            comm = communicator(spec, self.weightsync_device(), members, self._ws_store)
            self._ws().open_broadcast(comm, members, spec.timeout_s)

        return answer("trainer", "join", join)

    def ws_export_ipc(self, consumer_names: list[str], timeout_s: float) -> Outcome:
        return answer("trainer", "export", self._ws().export_ipc, consumer_names, timeout_s)

    def ws_seal_ipc(self) -> Outcome:
        ipc = self._ws().ipc
        return answer("trainer", "seal", ipc.seal if ipc is not None else lambda: None)

    def ws_map_direct(self, export: DirectExport, timeout_s: float) -> Outcome:
        return answer("trainer", "map", self._ws().map_direct, export, timeout_s)

    def ws_send(self, call: SyncCall) -> Outcome:
        """The trainer's side of one sync; each worker's receive runs alongside it."""
        return answer("trainer", "send", self._ws().send, call)

    def ws_checksums(self) -> Outcome:
        return answer("trainer", "checksums", self._ws().checksums)

    # push mode ----------------------------------------------------------------------------
    def ws_arm(self, exports: Sequence[PushExport], timeout_s: float) -> Outcome:
        def arm() -> None:
            self._ws_close_pusher()
            pusher = Pusher(timeout_s)
            pusher.attach(exports)
            self._ws_pusher = pusher

        return answer("trainer", "arm", arm)

    def ws_push(self, call: SyncCall) -> Outcome:
        """Push mode: one sync of the listening workers (``WeightSync.sync`` calls this)."""
        return answer("trainer", "push", self._ws_push, call)

    def _ws_push(self, call: SyncCall) -> PushResult:
        pusher = self._ws_pusher
        if pusher is None:
            raise SettingsError("push needs WeightSync(..., push=True) set up with this trainer first")
        if not call.direct:
            call = replace(call, direct=pusher.workers, kinds=("direct",))
        return pusher.push(self._ws().send, call)

    def weightsync_push(self, version: int, verify: bool = False, force: bool = False) -> PushResult:
        """Sync ``version`` to every listening worker from inside this actor's own method.

        For a loop that trains and pushes in one call (no Ray call for the sync at all)::

            def train_and_push(self, step):
                ...optimizer.step()...
                return self.weightsync_push(version=step)

        Raises :class:`~weightsync.core.wire.errors.SyncError` naming the culprits when any worker
        failed (run ``WeightSync.setup()`` from the driver before the next push then), or
        naming the workers whose tensors moved since their export, which were not written
        (a reload replaced them): ``WeightSync.sync()`` from the driver exports them again.
        """
        result = self._ws_push(SyncCall(seq=0, version=version, verify=verify, force=force))
        if result.setup_needed:
            raise WeightSyncError("an earlier push failed: run WeightSync.setup() before pushing again")
        stale = {n: a.outcome.value.stale for n, a in result.workers.items() if a.outcome.ok and a.outcome.value.stale}
        if result.ok and stale:
            outcomes = {"trainer": result.sent, **{n: a.outcome for n, a in result.workers.items()}}
            held = {n: (a.version, a.state) for n, a in result.workers.items()}
            moved = "; ".join(f"{n}: {', '.join(names)}" for n, names in sorted(stale.items()))
            raise SyncError(
                f"push of version {version} did not write worker(s) whose tensors moved since their export "
                f"({moved}); their weights are unchanged. Run WeightSync.sync() from the driver, which "
                "exports them again",
                outcomes,
                sorted(stale),
                (),
                held,
            )
        if not result.ok:
            outcomes = {"trainer": result.sent, **{n: a.outcome for n, a in result.workers.items()}}
            culprits = assign_blame(outcomes)
            dead = sorted(n for n, o in outcomes.items() if o.status is Status.DEAD)
            held = {n: (a.version, a.state) for n, a in result.workers.items() if a.state != "unknown"}
            title = f"push of version {version} failed"
            raise SyncError(describe_failure(title, outcomes, culprits), outcomes, culprits, dead, held)
        return result

    def _ws_close_pusher(self) -> None:
        pusher = getattr(self, "_ws_pusher", None)
        self._ws_pusher = None
        if pusher is not None:
            pusher.close()

    def ws_teardown(self, abort: bool = False) -> Outcome:
        def teardown() -> None:
            self._ws_close_pusher()
            sender = getattr(self, "_ws_sender", None)
            if sender is not None:
                sender.close_transports(abort)
            self._ws_store = None

        return answer("trainer", "teardown", teardown)
