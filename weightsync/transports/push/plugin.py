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
from weightsync.core.wire.messages import PushAnswer, PushResult, SyncCall
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
    def tell(call: SyncCall, answer: PushAnswer) -> None:
        if side.answer_early is not None:
            side.answer_early(call, answer)

    def start() -> Listener:
        return Listener(side.session.party, side.device, side.receive_pushed, side.status, side.gate, tell)

    listener = side.listen(start)
    assert isinstance(listener, Listener)
    return listener.export()


def _seal(side: WorkerSide) -> None:
    if isinstance(side.listener, Listener):
        side.listener.seal()


def pusher_of(side: TrainerSide) -> Pusher:
    """The trainer party's pusher; refuses, saying what happened and what to do, when push
    mode is not set up on this session (each coordinator's session on a trainer is its own,
    so another coordinator's setup never takes this one's pusher)."""
    pusher = side.extras.get(_KEY)
    if isinstance(pusher, Pusher):
        return pusher
    me = getattr(side, "name", "trainer")
    current, closed_by = getattr(side, "owner", ""), getattr(side, "closed_by", "")
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


def armed(side: TrainerSide) -> bool:
    """Whether push mode is set up on the trainer party ``side`` (its pusher attached)."""
    return isinstance(side.extras.get(_KEY), Pusher)


def push_sync(side: TrainerSide, call: SyncCall, owner: str = "") -> PushResult:
    """One pushed sync from the trainer party ``side`` (see :class:`Pusher`); ``side`` is
    ``owner``'s session already, picked by the trainer party."""
    half = side.half(PUSH.over)
    return pusher_of(side).push(side.send, call, getattr(half, "abandon", None), side.answer_early)


PUSH = Mode(
    name="push",
    over="direct",
    sync=push_sync,
    armed=armed,
    open=open_push,
    trainer_actions={"arm": _arm},
    worker_actions={"listen": _listen, "seal": _seal},
)
