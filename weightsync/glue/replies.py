"""Answers of a sync's calls from the parties on the coordinator's host, read from a reply
board (:mod:`weightsync.mechanisms.board`) instead of waiting for Ray's return leg.

The coordinator still makes every call through Ray, in the same order, and Ray's answer
still comes; a party on its host also leaves the same answer on the board and rings the
coordinator's doorbell, and the coordinator goes on once every party answered there. The
sync methods that answer on the board (:data:`REPLYING`) are wrapped by :func:`on_board`,
which posts what the method returned when its call names a slot (``SyncCall.reply``). In
order::

    setup, after describe:  Replies.offer()   a fresh board and doorbell, offered to each
                                              party on this host (``ws_reply_board``);
                                              those that mapped it answer on it
    per round:              replies.round()   a round tag; round.call(key, call) names the
                                              slot of each call of a party on the board
                            gather(calls, ..., replies=round)   board first, Ray for the rest
    close / next setup:     Replies.close()

A party whose answer does not fit its slot, or whose method raised, marks its slot "read
Ray's answer" at once; one that died or froze never posts, and Ray (asked every few
milliseconds) or the deadline says so, as without a board. An actor whose class overrides
a sync method without :func:`on_board` (so the mixin's answer is not the one Ray returns)
declines the board and answers through Ray alone.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import pickle
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import ray

from weightsync.core.wire.errors import ExportNotFound, TransferTimeout
from weightsync.core.wire.messages import BoardOffer, EndpointInfo, SyncCall
from weightsync.core.wire.outcome import Outcome
from weightsync.glue.protocol import answer
from weightsync.mechanisms.board import TOO_BIG, ReplyBoard
from weightsync.mechanisms.doorbell import Doorbell, ring

log = logging.getLogger("weightsync")
#: Bytes of one answer on the board: a ReceiveResult or SendResult with a few thousand
#: checksums, or a failure's message, fits.
SLOT_BYTES = 32 * 1024
#: The sync calls that answer on the board.
REPLYING = ("ws_send", "ws_receive", "ws_commit", "ws_push")
#: The sync methods that begin a party's side of a sync (see abandon_unbegun): a trainer
#: party's send, a worker's receive (each mixin's ``_ws_abandon`` is for its own one).
_BEGIN = ("ws_send", "ws_receive")
#: The most boards one actor keeps mapped (one per coordinator that set it up lately).
_KEPT = 8
_HELD = "_ws_reply_boards"
_MARK = "_ws_answers_on_board"

Key = tuple[str, str]
Gather = Callable[[Mapping[Key, Any]], dict[Key, Outcome]]
F = TypeVar("F", bound=Callable[..., Any])
#: Set while a wrapped sync method runs (per thread and per asyncio task): a wrapped
#: method called from inside another leaves the posting to the outer one.
_INSIDE: contextvars.ContextVar[bool | None] = contextvars.ContextVar("weightsync_on_board", default=None)


# the party's side ---------------------------------------------------------------------------
def on_board(method: F) -> F:
    """Wrap a sync method ``method(self, call, ...)``: what it returns is also posted in the
    slot ``call.reply`` names; when it raises, the slot says at once that the answer (the
    error) comes through Ray. An ``async`` method stays one. Only the outermost wrapped
    method of a call posts (an override wrapped too that calls ``super()``'s posts what it
    returns, after its own work), so the board carries what Ray returns."""
    # The wrappers refer only to module-level functions, so a class defined in a script's
    # __main__ (which Ray pickles by value) still pickles.
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def waiting(self: Any, call: SyncCall, *args: Any, **kwargs: Any) -> Any:
            return await _answered_async(method, self, call, args, kwargs)

        return _marked(waiting)  # type: ignore[return-value]

    @functools.wraps(method)
    def plain(self: Any, call: SyncCall, *args: Any, **kwargs: Any) -> Any:
        return _answered(method, self, call, args, kwargs)

    return _marked(plain)  # type: ignore[return-value]


def _marked(wrapper: Callable[..., Any]) -> Callable[..., Any]:
    # Ray reads an actor method's options (``ray.method(concurrency_group=...)``) from the
    # innermost function it reaches through ``__wrapped__``: without the link it reads the
    # wrapper, which carries the options given before wrapping (copied) and after.
    del wrapper.__wrapped__  # type: ignore[attr-defined]
    setattr(wrapper, _MARK, True)
    return wrapper


def _answered(method: Callable[..., Any], actor: Any, call: SyncCall, args: Any, kwargs: Any) -> Any:
    with _Posting(actor, call, method.__name__) as posting:
        value = method(actor, call, *args, **kwargs)
    return posting.done(value)


async def _answered_async(method: Callable[..., Any], actor: Any, call: SyncCall, args: Any, kwargs: Any) -> Any:
    with _Posting(actor, call, method.__name__) as posting:
        value = await method(actor, call, *args, **kwargs)
    return posting.done(value)


class _Posting:
    """One wrapped method's run: whether it is the outermost of its call (the one that
    posts), and, when it raises, the post that says so. As the outermost one ends, a side
    that never began the sync tells its peers first (:func:`abandon_unbegun`)."""

    def __init__(self, actor: Any, call: SyncCall, method: str) -> None:
        self.actor, self.call, self.method = actor, call, method

    def __enter__(self) -> _Posting:
        self.outer = _INSIDE.get() is None
        self._token = _INSIDE.set(True)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, *rest: object) -> None:
        _INSIDE.reset(self._token)
        if kind is not None and self.outer:
            abandon_unbegun(self.actor, self.call, self.method, error)
            post_reply(self.actor, self.call, None, failed=True)

    def done(self, value: Any) -> Any:
        if self.outer:
            abandon_unbegun(self.actor, self.call, self.method, None)
            post_reply(self.actor, self.call, value)
        return value


def abandon_unbegun(actor: Any, call: SyncCall, method: str, error: BaseException | None) -> None:
    """``actor``'s ``method`` for ``call`` ended: when its side of the sync never began (an
    override that raised, or answered, first), abort it so its peers stop waiting now
    (:mod:`weightsync.core.abandon`; the mixins' ``_ws_abandon``). An abort that fails is
    logged and noted on ``error``, the method's own failure, which stays the one raised."""
    hook = getattr(actor, "_ws_abandon", None)
    if method not in _BEGIN or not callable(hook):
        return
    try:
        if hook(call):
            log.warning(
                "weightsync: %s of sync %d ended before the sync began there; its peers were told", method, call.seq
            )
    except Exception as exc:
        log.error("weightsync: telling the peers that %s of sync %d never began failed", method, call.seq, exc_info=exc)
        note = getattr(error, "add_note", None)  # Python 3.11+
        if callable(note):
            note(f"(then telling its peers that the sync never began failed too: {exc!r})")


def reply_board_answer(actor: Any, offer: BoardOffer) -> Outcome:
    """What a party's ``ws_reply_board`` answers: "" once it took the board, else why not."""
    return answer(offer.party, "reply board", accept_board, actor, offer)


def accept_board(actor: Any, offer: BoardOffer) -> str:
    """Map ``offer``'s board in this actor; "" once it did, else why it answers through Ray."""
    overridden = [m for m in REPLYING if hasattr(actor, m) and not getattr(getattr(actor, m), _MARK, False)]
    if overridden:
        return f"its class overrides {', '.join(overridden)} without weightsync.glue.replies.on_board"
    try:
        board = ReplyBoard.attach(offer.board, offer.slots, offer.slot_bytes)
    except ExportNotFound as exc:
        return str(exc)
    held: dict[str, tuple[ReplyBoard, BoardOffer]] = getattr(actor, _HELD, None) or {}
    held.pop(offer.owner, None)
    held[offer.owner] = (board, offer)
    while len(held) > _KEPT:
        held.pop(next(iter(held)))
    setattr(actor, _HELD, held)
    return ""


def post_reply(actor: Any, call: SyncCall, value: Any, failed: bool = False) -> None:
    """Leave ``value`` in the slot ``call.reply`` names on coordinator ``call.owner``'s board
    (``failed``: that its answer comes through Ray), and ring; nothing without a slot or a
    board (a process the coordinator did not offer one: an engine's worker, a far party)."""
    if call.reply is None:
        return
    found = (getattr(actor, _HELD, None) or {}).get(call.owner)
    if found is None:
        return
    board, offer = found
    slot, tag = call.reply
    data: bytes | None = None
    if not failed:
        try:
            data = pickle.dumps((slot, tag, value), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            log.debug("weightsync: %s's answer does not pickle (%s); it goes through Ray", offer.party, exc)
    board.post(slot, tag, data)
    if not offer.doorbell:
        return  # the coordinator polls
    try:
        # Never waits: a full queue (the coordinator behind on draining it, or something
        # flooding it) costs only the wake-up; the coordinator reads the board at its next look.
        ring(offer.doorbell, offer.doorbell_key, time.monotonic(), "the coordinator")
    except TransferTimeout as exc:
        log.debug("weightsync: %s's answer is posted; its ring was not taken (%s)", offer.party, exc)


# the coordinator's side -------------------------------------------------------------------
class ReplyRound:
    """One round's slots: which call answers in which slot, and reading them back."""

    def __init__(self, board: ReplyBoard, tag: int, parties: frozenset[str], doorbell: Doorbell | None) -> None:
        self.board = board
        self.tag = tag
        self.parties = parties
        #: What the coordinator sleeps on between looks (rung by each answer); None: it polls
        #: with short sleeps (its parties' copies run on a GPU, so its CPU is free).
        self.doorbell = doorbell
        self.slots: dict[Key, int] = {}

    def call(self, key: Key, call: SyncCall) -> SyncCall:
        """``call`` as party ``key[0]`` gets it for phase ``key[1]``: naming its slot when the
        party answers on the board and a slot is left, else as it is."""
        slot = self.slot(key)
        return call if slot is None else replace(call, reply=(slot, self.tag))

    def slot(self, key: Key) -> int | None:
        """A slot of this round for ``key``'s answer; None when party ``key[0]`` does not
        answer on the board or no slot is left."""
        if key[0] not in self.parties or len(self.slots) >= self.board.slots:
            return None
        slot = self.slots[key] = len(self.slots)
        return slot

    def take(self, key: Key) -> Any:
        """``key``'s answer from the board, :data:`TOO_BIG` (read Ray's), or None (not yet)."""
        slot = self.slots[key]
        data = self.board.take(slot, self.tag)
        if data is None or data is TOO_BIG:
            return data
        assert isinstance(data, bytes)
        posted_slot, posted_tag, value = pickle.loads(data)
        return value if (posted_slot, posted_tag) == (slot, self.tag) else None


class Replies:
    """A coordinator's reply board and the parties that answer on it."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._board: ReplyBoard | None = None
        self._parties: frozenset[str] = frozenset()
        self._doorbell: Doorbell | None = None
        self._tag = 0

    @property
    def parties(self) -> frozenset[str]:
        """The parties answering on the board (none without one)."""
        return self._parties

    def offer(self, handles: Mapping[str, Any], infos: Mapping[str, EndpointInfo], gather: Gather) -> None:
        """A fresh board for this coordinator's parties on its host that can map it (the
        last one is closed); its name is removed once they mapped it."""
        self.close()
        host = socket.gethostname()
        near = [p for p, i in infos.items() if i.hostname == host and hasattr(handles.get(p), "ws_reply_board")]
        if not near or not ray.is_initialized():
            return
        # Each round's calls: a send per trainer party, a receive and a commit per worker
        # (a push: the trainer's call and send, each worker's answer).
        slots = 2 * len(handles)
        board = ReplyBoard.create(slots, SLOT_BYTES)
        # Parties copying on a GPU leave the host's cores idle: polling finds their answers
        # sooner than a sleeping coordinator wakes. On a CPU polling would take a core from
        # the copies, so the coordinator sleeps on a doorbell each answer rings.
        doorbell = None if any(infos[p].device == "cuda" for p in near) else Doorbell()

        def offered(party: str) -> BoardOffer:
            return BoardOffer(
                board=board.handle(),
                slots=slots,
                slot_bytes=SLOT_BYTES,
                owner=self.owner,
                party=party,
                doorbell=doorbell.address if doorbell is not None else "",
                doorbell_key=doorbell.key if doorbell is not None else b"",
            )

        try:
            outs = gather({(p, "reply board"): handles[p].ws_reply_board.remote(offered(p)) for p in near})
        finally:
            board.unlink()
        took = set()
        for (party, _), o in outs.items():
            if o.ok and not o.value:
                took.add(party)
            elif o.ok:
                log.debug("weightsync: %s answers through Ray: %s", party, o.value)
            else:
                log.warning(
                    "weightsync: %s could not take the reply board (%s); it answers through Ray", party, o.line()
                )
        if not took:
            board.close()
            if doorbell is not None:
                doorbell.close()
            return
        self._board, self._parties, self._doorbell = board, frozenset(took), doorbell

    def round(self) -> ReplyRound | None:
        """A new round on the board (None without one: every answer through Ray)."""
        if self._board is None:
            return None
        self._tag += 1
        return ReplyRound(self._board, self._tag, self._parties, self._doorbell)

    def close(self) -> None:
        if self._board is not None:
            self._board.close()
        if self._doorbell is not None:
            self._doorbell.close()
        self._board = self._doorbell = None
        self._parties = frozenset()
