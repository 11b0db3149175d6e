"""Push mode's plug-in: direct workers that listen for syncs instead of taking a Ray call each.

Opened after the direct transport, for each trainer party with direct workers::

    listen   each worker starts its listener (mailbox + doorbell)
    arm      the trainer party attaches every mailbox (a Pusher, kept in its extras)
    seal     each worker unlinks its mailbox's shared-memory name

Per sync, ``WeightSync.sync`` makes one call to the trainer (``ws_push``), or the trainer
pushes from inside its own method (``TrainerMixin.weightsync_push``): see
:mod:`weightsync.core.pusher`.
"""

from __future__ import annotations

from weightsync.core.pusher import Pusher
from weightsync.core.transport.plugin import Mode, Opening, Request, TrainerSide, WorkerSide
from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.messages import PushExport

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
    return side.listen()


def _seal(side: WorkerSide) -> None:
    side.seal_listen()


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
    raise SettingsError(
        f"{me}: no push-mode session is open on this trainer (set up without push=True): set it up with "
        "WeightSync(..., push=True).setup() from the driver first"
    )


PUSH = Mode(
    name="push",
    over="direct",
    open=open_push,
    trainer_actions={"arm": _arm},
    worker_actions={"listen": _listen, "seal": _seal},
)
