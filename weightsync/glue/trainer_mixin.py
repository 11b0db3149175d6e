"""The trainer's side of the coordinator's protocol, as a mixin for any trainer actor.

Mix :class:`TrainerMixin` into a Ray actor that holds ``self.model`` (or overrides
``weightsync_model()``); :class:`~weightsync.glue.coordinator.WeightSync` drives its ``ws_*``
methods, each answering an :class:`~weightsync.core.wire.outcome.Outcome`. Call order per
session: ws_describe -> ws_manifest (-> ws_layout for ranks) -> ws_open, once per step of
each transport plug-in's setup -> per sync ws_send (or ws_push) -> ws_teardown. No method
names a transport: ws_open runs whatever action the plug-in it is handed declares.

One trainer may feed several WeightSyncs (rollout engines and an evaluation pool, say):
each coordinator has a session of its own on this party (its endpoint, with its halves,
groups, regions and push state), picked by the coordinator's label (``owner``, or
``SyncCall.owner``), so one's setup, syncs, failures and close never touch another's.
The actor runs one call at a time, so their syncs take turns here.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from weightsync.core import registry
from weightsync.core.abandon import abandon_send
from weightsync.core.lora.source import send_adapter
from weightsync.core.plugin import Plugin
from weightsync.core.policy import judge
from weightsync.core.sender import WeightSender
from weightsync.core.sharded import ShardedSender, has_dtensors
from weightsync.core.wire.errors import SettingsError, SyncError, WeightSyncError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import BoardOffer, EndpointInfo, PushResult, SourceLayout, SyncCall
from weightsync.core.wire.outcome import Outcome
from weightsync.core.wire.session import TRAINER_PARTY
from weightsync.core.wire.settings import SyncSettings
from weightsync.core.wire.sizing import BufferHints
from weightsync.glue.protocol import answer, describe, model_of, resolve_device
from weightsync.glue.replies import on_board, post_reply, reply_board_answer

#: How many closed sessions a trainer party remembers (who closed them), for the message
#: of a push asked of one.
_CLOSED_KEPT = 16


class TrainerMixin:
    """Weight-sync methods for a trainer actor. Needs ``self.model`` (or override
    ``weightsync_model``); optionally ``self.device`` and ``self.wire_dtype``."""

    def weightsync_model(self) -> nn.Module:
        return model_of(self, "TrainerMixin")

    def weightsync_device(self) -> torch.device:
        return resolve_device(getattr(self, "device", "cpu"))

    def _senders(self) -> dict[str, WeightSender]:
        senders: dict[str, WeightSender] | None = getattr(self, "_ws_senders", None)
        if senders is None:
            senders = {}
            self._ws_senders = senders
        return senders

    def _closed(self) -> dict[str, str]:
        closed: dict[str, str] | None = getattr(self, "_ws_closed", None)
        if closed is None:
            closed = {}
            self._ws_closed = closed
        return closed

    def _ws(self, owner: str | None = None) -> WeightSender:
        """The endpoint of coordinator ``owner``'s session on this party, made on first use;
        None: the session set up last (what a hook installed from inside the actor means)."""
        senders = self._senders()
        if owner is None:
            owner = next(reversed(senders), "")  # set up last: see ws_manifest
        sender = senders.get(owner)
        if sender is None:
            model = self.weightsync_model()
            kind = ShardedSender if has_dtensors(model) else WeightSender
            sender = kind(
                model=model,
                device=self.weightsync_device(),
                wire_dtype=getattr(self, "wire_dtype", None),
            )
            sender.owner = owner
            sender.answer_early = functools.partial(post_reply, self)
            if isinstance(sender, ShardedSender):
                sender.known_owners = lambda: tuple(self._senders())
            senders[owner] = sender
        return sender

    def _me(self, owner: str = "") -> str:
        senders = self._senders()
        sender = senders.get(owner) or next(iter(senders.values()), None)
        return sender.name if sender is not None else TRAINER_PARTY

    def _ws_abandon(self, call: SyncCall) -> bool:
        """``ws_send`` for ``call`` ended: abort this party's side if it never began (see
        :func:`weightsync.glue.replies.abandon_unbegun`)."""
        sender = self._senders().get(call.owner)
        return sender is not None and abandon_send(sender, call)

    def weightsync_sessions(self) -> dict[str, tuple[str, ...]]:
        """Per coordinator with a session on this party (its ``WeightSync.label``), the
        transports open in it now; a closed WeightSync's session is gone."""
        return {owner: tuple(sorted(sender.halves)) for owner, sender in self._senders().items()}

    def ws_describe(self, owner: str = "") -> Outcome:
        def run() -> EndpointInfo:
            info = describe(self.weightsync_device(), True)
            sender = self._ws(owner)
            return replace(info, shards=sender.shards()) if isinstance(sender, ShardedSender) else info

        return answer(self._me(owner), "describe", run)

    def ws_manifest(
        self,
        settings: SyncSettings,
        party: str = TRAINER_PARTY,
        ranks: Sequence[str] = (),
        hints: BufferHints | None = None,
        owner: str = "",
    ) -> Outcome:
        """The manifest of the model as it is now, which starts coordinator ``owner``'s
        Session on this party (closing only that coordinator's last one); ``party``/``ranks``:
        this rank's name and every rank's, in rank order (a sharded trainer checks it was
        given its mesh's order); ``hints``: what ``buffer_bytes="auto"`` is sized from. With
        ``settings.lora`` the manifest is the PEFT model's adapter (:mod:`weightsync.core.lora`)."""

        def build() -> Manifest:
            sender = self._ws(owner)
            senders = self._senders()
            senders[owner] = senders.pop(owner)  # the session set up last goes last
            if isinstance(sender, ShardedSender):
                sender.bind(party, ranks)
            sender.name = party
            send_adapter(sender, settings.lora)
            return sender.manifest(settings, hints, owner)

        return answer(party, "manifest", build)

    def ws_layout(self, party: str = TRAINER_PARTY, owner: str = "") -> Outcome:
        """Whether this rank's model is sharded (DTensors) and over which mesh: the ranks of one
        trainer must agree (a plain rank among sharded ones would never join their gathers)."""

        def layout() -> SourceLayout:
            sender = self._ws(owner)
            return sender.layout() if isinstance(sender, ShardedSender) else SourceLayout(sharded=False)

        return answer(party, "layout", layout)

    def ws_open(self, plugin: Plugin, action: str, *args: Any, owner: str = "") -> Outcome:
        """One step of ``plugin``'s setup on this party: its trainer action ``action``."""
        return answer(
            self._me(owner),
            f"{plugin.name} {action}",
            lambda: plugin.action("trainer", action)(self._ws(owner), *args),
        )

    @on_board
    def ws_send(self, call: SyncCall) -> Outcome:
        """The trainer's side of one sync (in the session of ``call.owner``); each worker's
        receive runs alongside it."""
        return answer(self._me(call.owner), "send", lambda: self._ws(call.owner).send(call))

    def ws_checksums(self, owner: str = "") -> Outcome:
        return answer(self._me(owner), "checksums", lambda: self._ws(owner).checksums())

    def ws_reply_board(self, offer: BoardOffer) -> Outcome:
        """Take coordinator ``offer.owner``'s reply board: answers "" once this actor will
        answer its sync calls there too, else why not (:mod:`weightsync.glue.replies`)."""
        return reply_board_answer(self, offer)

    # push mode ----------------------------------------------------------------------------
    @on_board
    def ws_push(self, call: SyncCall, owner: str = "") -> Outcome:
        """Push mode: one sync of the listening workers of coordinator ``owner``'s session
        (``WeightSync.sync`` calls this)."""
        owner = call.owner or owner
        return answer(self._me(owner), "push", lambda: self._push(self._ws(owner), call, owner))

    @staticmethod
    def _push(sender: WeightSender, call: SyncCall, owner: str = "") -> PushResult:
        return registry.mode("push").sync(sender, call, owner)

    def _push_sender(self, sync: str | None) -> WeightSender:
        """The session a push from inside this actor runs in: the one of WeightSync ``sync``
        (its label), or else the only one in push mode."""
        senders = self._senders()
        if sync is not None:
            found = senders.get(sync)
            if found is not None:
                return found
            closed = self._closed().get(sync)
            raise SettingsError(
                f"{self._me()}: the session of {sync} on this trainer was closed ({closed}); set it up again from "
                "the driver before pushing"
                if closed
                else f"{self._me()}: no session of a WeightSync labelled {sync!r} on this trainer (open: "
                f"{', '.join(repr(k) for k in sorted(senders)) or 'none'}); pass WeightSync.label"
            )
        pushing = [s for s in senders.values() if _pushes(s)]
        if len(pushing) > 1:
            raise SettingsError(
                f"{self._me()}: {len(pushing)} WeightSyncs have push sessions on this trainer "
                f"({', '.join(sorted(repr(s.owner) for s in pushing))}); say which: "
                "weightsync_push(version, sync=ws.label)"
            )
        if pushing:
            return pushing[0]
        if len(senders) == 1:
            return next(iter(senders.values()))  # its mode says why it cannot push
        raise SettingsError(
            f"{self._me()}: no push-mode session is open on this trainer: set one up with "
            "WeightSync(..., push=True).setup() from the driver first"
        )

    def weightsync_push(
        self, version: int, verify: bool = False, force: bool = False, sync: str | None = None
    ) -> PushResult:
        """Sync ``version`` to every listening worker from inside this actor's own method.

        For a loop that trains and pushes in one call (no Ray call for the sync at all)::

            def train_and_push(self, step):
                ...optimizer.step()...
                return self.weightsync_push(version=step)

        ``sync``: the label (``WeightSync.label``) of the WeightSync whose workers to push to,
        needed only when several WeightSyncs set this trainer up in push mode.

        Raises :class:`~weightsync.core.wire.errors.SyncError` naming the culprits when any
        worker failed (``WeightSync.sync()`` or ``setup()`` from the driver sets up again,
        without the workers found dead), or naming the workers whose tensors moved since
        their export, which were not written (a reload replaced them): ``WeightSync.sync()``
        from the driver exports them again.
        """
        sender = self._push_sender(sync)
        me = sender.name
        result = self._push(sender, SyncCall(seq=0, version=version, verify=verify, force=force, owner=sender.owner))
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

    def ws_teardown(self, abort: bool = False, by: str = "", owner: str = "", forget: bool = False) -> Outcome:
        """Close coordinator ``owner``'s transports on this party (no other coordinator's);
        ``by``: the coordinator's label and why; ``forget`` (its ``close()``): drop that
        session altogether, remembering only who closed it."""

        def teardown() -> None:
            senders = self._senders()
            sender = senders.get(owner)
            if sender is None:
                return
            try:
                sender.close_transports(abort, by)
            finally:
                if forget:
                    del senders[owner]
                    closed = self._closed()
                    closed.pop(owner, None)
                    closed[owner] = sender.closed_by or by or "close()"
                    while len(closed) > _CLOSED_KEPT:
                        del closed[next(iter(closed))]

        return answer(self._me(owner), "teardown", teardown)


def _pushes(sender: WeightSender) -> bool:
    """Whether ``sender``'s session is set up in push mode."""
    armed = registry.mode("push").armed
    return armed is not None and armed(sender)
