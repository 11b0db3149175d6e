"""Push mode's plug-in: direct workers that listen for syncs instead of taking a Ray call each.

Opened after the direct transport, for each trainer party with direct workers::

    listen   each worker starts its listener (mailbox + doorbell)
    arm      the trainer party attaches every mailbox (a Pusher, kept in its extras)
    seal     each worker unlinks its mailbox's shared-memory name

Per sync, ``WeightSync.sync`` makes one call to the trainer (``ws_push``), or the trainer
pushes from inside its own method (``TrainerMixin.weightsync_push``): see
:mod:`weightsync.transports.push.pusher`.
"""

from __future__ import annotations

from weightsync.core.plugin import Mode, Opening, Request, TrainerSide, WorkerSide
from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.messages import PushResult, SyncCall
from weightsync.transports.push.listener import Listener
from weightsync.transports.push.messages import PushExport
from weightsync.transports.push.pusher import Pusher

_KEY = "pusher"


def open_push(opening: Opening) -> None:
    me, members = opening.server, opening.members
    exports = opening.step({name: Request(action="listen") for name in members}, "starting the listeners")
    opening.step(
        {me: Request(action="arm", args=(tuple(exports[n] for n in members),))}, "attaching the listeners' mailboxes"
    )
    opening.step({name: Request(action="seal") for name in members}, "sealing the mailboxes")


def _arm(side: TrainerSide, exports: tuple[PushExport, ...]) -> None:
    old = side.extras.pop(_KEY, None)
    if old is not None:
        old.close()
    pusher = Pusher(side.session, PUSH.over)
    pusher.attach(exports)
    side.extras[_KEY] = pusher


def _listen(side: WorkerSide) -> PushExport:
    def start() -> Listener:
        return Listener(side.session.party, side.device, side.receive_pushed, side.status, side.gate)

    listener = side.listen(start)
    assert isinstance(listener, Listener)
    return listener.export()


def _seal(side: WorkerSide) -> None:
    if isinstance(side.listener, Listener):
        side.listener.seal()


def pusher_of(side: TrainerSide, owner: str = "") -> Pusher:
    """The trainer party's pusher; refuses, saying what happened and what to do, when push
    mode is not set up. ``owner``: the label of the coordinator asking (none from inside
    the trainer)."""
    pusher = side.extras.get(_KEY)
    if isinstance(pusher, Pusher):
        return pusher
    me = getattr(side, "name", "trainer")
    current, closed_by = getattr(side, "owner", ""), getattr(side, "closed_by", "")
    if owner and current and current != owner:
        raise SettingsError(
            f"{me}: this trainer's push session was torn down by another WeightSync ({current}), which set up "
            "this trainer since: two WeightSyncs cannot share one trainer's push session; close the other one, "
            "then this one's next sync sets up again"
        )
    if closed_by:
        raise SettingsError(
            f"{me}: this trainer's push session was torn down by {closed_by}; run setup() (or sync()) on a "
            "WeightSync(..., push=True) from the driver before pushing again"
        )
    last = f"its last setup, by {current}, opened none" if current else "none was opened"
    raise SettingsError(
        f"{me}: no push-mode session is open on this trainer ({last}: set up without push=True, or the setup "
        "failed): set it up with WeightSync(..., push=True).setup() from the driver first"
    )


def push_sync(side: TrainerSide, call: SyncCall, owner: str = "") -> PushResult:
    """One pushed sync from the trainer party ``side`` (see :class:`Pusher`)."""
    return pusher_of(side, owner).push(side.send, call)


PUSH = Mode(
    name="push",
    over="direct",
    sync=push_sync,
    open=open_push,
    trainer_actions={"arm": _arm},
    worker_actions={"listen": _listen, "seal": _seal},
)
