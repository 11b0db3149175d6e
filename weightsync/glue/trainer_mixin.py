"""The trainer's side of the coordinator's protocol, as a mixin for any trainer actor.

Mix :class:`TrainerMixin` into a Ray actor that holds ``self.model`` (or overrides
``weightsync_model()``); :class:`~weightsync.glue.coordinator.WeightSync` drives its ``ws_*``
methods, each answering an :class:`~weightsync.core.wire.outcome.Outcome`. Call order per
session: ws_describe -> ws_manifest (-> ws_layout for ranks) -> ws_open, once per step of
each transport plug-in's setup -> per sync ws_send (or ws_push) -> ws_teardown. No method
names a transport: ws_open runs whatever action the plug-in it is handed declares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from weightsync.core import registry
from weightsync.core.lora.source import send_adapter
from weightsync.core.plugin import Plugin
from weightsync.core.policy import judge
from weightsync.core.sender import WeightSender
from weightsync.core.sharded import ShardedSender, has_dtensors
from weightsync.core.wire.errors import SyncError, WeightSyncError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import EndpointInfo, PushResult, SourceLayout, SyncCall
from weightsync.core.wire.outcome import Outcome
from weightsync.core.wire.session import TRAINER_PARTY
from weightsync.core.wire.settings import SyncSettings
from weightsync.core.wire.sizing import BufferHints
from weightsync.glue.protocol import answer, describe, model_of, resolve_device


class TrainerMixin:
    """Weight-sync methods for a trainer actor. Needs ``self.model`` (or override
    ``weightsync_model``); optionally ``self.device`` and ``self.wire_dtype``."""

    def weightsync_model(self) -> nn.Module:
        return model_of(self, "TrainerMixin")

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

    def _me(self) -> str:
        sender = getattr(self, "_ws_sender", None)
        return sender.name if sender is not None else TRAINER_PARTY

    def ws_describe(self) -> Outcome:
        def run() -> EndpointInfo:
            info = describe(self.weightsync_device(), True)
            sender = self._ws()
            return replace(info, shards=sender.shards()) if isinstance(sender, ShardedSender) else info

        return answer(self._me(), "describe", run)

    def ws_manifest(
        self,
        settings: SyncSettings,
        party: str = TRAINER_PARTY,
        ranks: Sequence[str] = (),
        hints: BufferHints | None = None,
        owner: str = "",
    ) -> Outcome:
        """The manifest of the model as it is now, which starts this party's Session;
        ``party``/``ranks``: this rank's name and every rank's, in rank order (a sharded
        trainer checks it was given its mesh's order); ``hints``: what
        ``buffer_bytes="auto"`` is sized from; ``owner``: the coordinator's label. With
        ``settings.lora`` the manifest is the PEFT model's adapter (:mod:`weightsync.core.lora`)."""

        def build() -> Manifest:
            sender = self._ws()
            if isinstance(sender, ShardedSender):
                sender.bind(party, ranks)
            sender.name = party
            send_adapter(sender, settings.lora)
            return sender.manifest(settings, hints, owner)

        return answer(party, "manifest", build)

    def ws_layout(self, party: str = TRAINER_PARTY) -> Outcome:
        """Whether this rank's model is sharded (DTensors) and over which mesh: the ranks of one
        trainer must agree (a plain rank among sharded ones would never join their gathers)."""

        def layout() -> SourceLayout:
            sender = self._ws()
            return sender.layout() if isinstance(sender, ShardedSender) else SourceLayout(sharded=False)

        return answer(party, "layout", layout)

    def ws_open(self, plugin: Plugin, action: str, *args: Any) -> Outcome:
        """One step of ``plugin``'s setup on this party: its trainer action ``action``."""
        return answer(
            self._me(), f"{plugin.name} {action}", lambda: plugin.action("trainer", action)(self._ws(), *args)
        )

    def ws_send(self, call: SyncCall) -> Outcome:
        """The trainer's side of one sync; each worker's receive runs alongside it."""
        return answer(self._me(), "send", self._ws().send, call)

    def ws_checksums(self) -> Outcome:
        return answer(self._me(), "checksums", self._ws().checksums)

    # push mode ----------------------------------------------------------------------------
    def ws_push(self, call: SyncCall, owner: str = "") -> Outcome:
        """Push mode: one sync of the listening workers (``WeightSync.sync`` calls this;
        ``owner``: its label, to tell it when another coordinator took the trainer over)."""
        return answer(self._me(), "push", self._ws_push, call, owner)

    def _ws_push(self, call: SyncCall, owner: str = "") -> PushResult:
        return registry.mode("push").sync(self._ws(), call, owner)

    def weightsync_push(self, version: int, verify: bool = False, force: bool = False) -> PushResult:
        """Sync ``version`` to every listening worker from inside this actor's own method.

        For a loop that trains and pushes in one call (no Ray call for the sync at all)::

            def train_and_push(self, step):
                ...optimizer.step()...
                return self.weightsync_push(version=step)

        Raises :class:`~weightsync.core.wire.errors.SyncError` naming the culprits when any
        worker failed (``WeightSync.sync()`` or ``setup()`` from the driver sets up again,
        without the workers found dead), or naming the workers whose tensors moved since
        their export, which were not written (a reload replaced them): ``WeightSync.sync()``
        from the driver exports them again.
        """
        me = self._me()
        result = self._ws_push(SyncCall(seq=0, version=version, verify=verify, force=force))
        if result.setup_needed:
            raise WeightSyncError(f"{me}: an earlier push failed: run WeightSync.setup() before pushing again")
        outcomes = {me: result.sent, **{n: a.outcome for n, a in result.workers.items()}}
        held = {n: (a.version, a.state) for n, a in result.workers.items() if a.state != "unknown"}
        verdict = judge(outcomes, f"push of version {version} failed")
        if verdict is not None:
            text = verdict.message(held)
            if verdict.dead:
                # Membership is the driver's: say what happens to them, as a sync would.
                text += (
                    f"\n  dead worker(s) {', '.join(verdict.dead)}: the next WeightSync.sync() or setup() drops "
                    "them and goes on without them"
                )
            raise SyncError(text, verdict.outcomes, verdict.culprits, verdict.dead, held)
        stale = {n: a.outcome.value.stale for n, a in result.workers.items() if a.outcome.value.stale}
        if stale:
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
        return result

    def ws_teardown(self, abort: bool = False, by: str = "") -> Outcome:
        """Close this party's transports; ``by``: the coordinator's label and why."""

        def teardown() -> None:
            sender = getattr(self, "_ws_sender", None)
            if sender is not None:
                sender.close_transports(abort, by)

        return answer(self._me(), "teardown", teardown)
