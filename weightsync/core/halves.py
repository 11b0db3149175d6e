"""The transport interface: what every mechanism (broadcast, ipc, direct) implements.

Each transport has two halves, one per side, with the same lifecycle::

    setup   the plug-in's steps (:mod:`weightsync.core.plugin`), driven by the
            coordinator (form a group; export and attach slots; export and map a worker's
            tensors), which build the halves below from each party's Session
    sync    SendHalf.send(sources, call, deadline)       on the trainer
            ReceiveHalf.receive(sink, call, begin)       on each worker, at the same time
    failure abort(): tell every peer of this transport at once (abort word, group abort)
    end     close(): release groups, mappings and regions

A half never changes a worker's state itself: the receiver's state machine
(:class:`weightsync.core.receiver.WeightReceiver`) calls ``receive`` and is told, through
``begin``, the moment before the first byte lands in the worker's tensors. Transports
import no endpoint and no Ray.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from weightsync.core.packing import ChunkUnpacker
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import SyncCall

log = logging.getLogger("weightsync")
_T = TypeVar("_T")


class Landing(Protocol):
    """What a receiving half needs from the place tensors go (a sink: see weightsync.core.sinks)."""

    #: True when the sink keeps references to what it is handed past the call; it then
    #: gets clones, never views into a buffer that the next chunk overwrites.
    keeps_references: bool

    def destinations(self, manifest: Manifest) -> list[torch.Tensor | None]:
        """Per spec, a tensor of the spec's dtype and shape to copy into, or None to be handed
        it; refuses (naming the tensor) a held tensor whose dtype or shape left the manifest."""

    def consume(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Take tensors that had no destination."""

    def direct_tensors(self, manifest: Manifest) -> list[torch.Tensor] | None:
        """The tensors the direct transport may write into, or None if it may not."""

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        """Point the held tensor for spec ``index`` at ``tensor`` (direct transport)."""


def unpacker_for(manifest: Manifest, landing: Landing) -> ChunkUnpacker:
    """The unpacker of one sync into ``landing`` (its destinations are looked up once)."""
    destinations = landing.destinations(manifest)
    return ChunkUnpacker(manifest.specs, destinations.__getitem__, landing.keeps_references)


class Sources:
    """The trainer's tensors for one sync, in manifest order, with their copy-plan key.

    ``streamed``: the tensors are made as they are read (a sharded rank gathers them bucket
    by bucket, :mod:`weightsync.core.sharded`): read them in manifest order, keep none past its
    use, and plan nothing on their addresses (``key`` is None). ``checksums``: with
    ``verify``, each tensor's checksum as it travels, computed once per sync by the sender
    (a half that checks per tensor reuses them instead of walking the tensors again).
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        key: object,
        streamed: bool = False,
        local: Sequence[torch.Tensor] | None = None,
    ) -> None:
        self.tensors = tensors
        self.key = key
        self.streamed = streamed
        #: The tensors as this party holds them (a sharded rank's DTensors, not gathered;
        #: by default ``tensors``), for a transport that sends only what each rank owns.
        self.local = tensors if local is None else local
        self.checksums: list[int] | None = None
        #: A delta session's sync as the encoder prepared it (``weightsync.core.delta.
        #: encoder.PreparedSync``): a half that carries deltas asks it what to send its
        #: peers (``for_peers``); None outside delta sessions.
        self.delta: Any = None
        #: The party's delta session (``weightsync.core.delta.sending.DeltaSending``), for a
        #: half that encodes its own tensors (``SendHalf.own_deltas``); None without deltas.
        self.deltas: Any = None


class Rider(Protocol):
    """A half's work done on another half's walk of streamed sources (:meth:`SendHalf.ride`).

    Call order: ``take(i, tensor)`` for every index in manifest order, each once, with the
    tensor as the walk made it (on the stream current at that moment: the copy is ordered
    after the walk's own work on it); then ``finish()`` once, which waits for what was
    queued and hands over, returning what :meth:`SendHalf.send` would have.
    """

    def take(self, index: int, tensor: torch.Tensor) -> None: ...

    def finish(self) -> tuple[list[int], tuple[str, ...]]: ...


class SendHalf(abc.ABC):
    """The trainer's half of one transport for one session."""

    kind: ClassVar[str]
    #: True when, in a delta session, every sync of this half starts with the delta header
    #: and may carry a delta (``weightsync.core.delta``); the others always send dense.
    carries_deltas: ClassVar[bool] = False
    #: True for a half that, in a delta session, encodes its own tensors with an encoder of
    #: its own (``Sources.deltas.encoder_for(kind)``: owner sends, each rank its rows), so
    #: the sender's one encoding walk does not serve it.
    own_deltas: ClassVar[bool] = False
    #: Set by :meth:`send` to the bytes this half moved in the sync (each once, whatever
    #: its peers) when that is not the Manifest's total: a delta, or a rank that sends only
    #: its own rows. The sender clears it before every sync.
    sent_nbytes: int | None = None

    @abc.abstractmethod
    def send(self, sources: Sources, call: SyncCall, deadline: float) -> tuple[list[int], tuple[str, ...]]:
        """Move ``sources`` to this sync's peers of this transport (``call.targets[kind]``)
        by ``deadline`` (one for the trainer's whole sync, whatever it drives); returns
        (checksums, stale peers)."""

    @property
    @abc.abstractmethod
    def peers(self) -> tuple[str, ...]:
        """Every worker this half can reach in this session (what a call without targets drives)."""

    def start(self, call: SyncCall) -> None:
        """Called first in every sync this half takes part in, before any check that may
        fail it: a half with per-sync state resets it (the control blocks' abort epoch)."""
        return None

    def walks(self, targets: Sequence[str], verify: bool) -> int:
        """How many passes in manifest order over ``sources.tensors`` :meth:`send` makes for
        ``targets`` (a sharded source gathers that many times, see weightsync.core.sharded)."""
        return 1

    @property
    def rides(self) -> bool:
        """True when :meth:`ride` takes streamed sources (then another half's walk serves it)."""
        return False

    def ride(self, sources: Sources, call: SyncCall, deadline: float) -> Rider | None:
        """A :class:`Rider` that does this half's work on streamed ``sources`` as another
        half walks them (so a sharded rank gathers once for both), or None when this half
        cannot (the default). Called instead of :meth:`send`."""
        return None

    @abc.abstractmethod
    def abort(self) -> None:
        """Tell every peer at once that this side failed (safe to call at any time)."""

    def tear_down(self, by: str) -> None:
        """The session ends, ``by`` whom, while a sync may still run on another thread (a
        teardown during an in-trainer push): that sync's waits end now, and a sync starting
        after this fails at once instead of waiting for peers. The teardown waits for that
        sync to end (the pusher's ``close()``) before it calls :meth:`close`. By default
        :meth:`abort`, enough for a half no sync drives from another thread."""
        self.abort()

    @abc.abstractmethod
    def close(self, abort: bool = False) -> None:
        """Release what the session holds (with ``abort``: after telling the peers)."""


class ReceiveHalf(abc.ABC):
    """A worker's half of one transport for one session."""

    kind: ClassVar[str]
    #: See :attr:`SendHalf.carries_deltas`: such a half is handed the sink wrapped in a
    #: ``weightsync.core.delta.landing.DeltaReceiving`` in a delta session.
    carries_deltas: ClassVar[bool] = False
    #: True when ``receive`` returning means the trainer finished its side too (the
    #: colocated transports see it on the control block), so the worker may commit at once.
    #: A broadcast receiver cannot tell, and commits in a later call.
    knows_sender_finished: ClassVar[bool]

    def mappings(self) -> tuple[int, int]:
        """(mappings made, mappings released) of other processes' exports by this half."""
        return 0, 0

    def start(self, call: SyncCall) -> None:
        """Called first in every sync, before any check that may fail it (see SendHalf.start)."""
        return None

    def own_senders(self, sent: Sequence[_T]) -> Sequence[_T]:
        """Among every serving party's answers (in rank order), those of the parties whose
        bytes this half received: all of them by default (one sender, or owner sends, where
        each rank sends a part); one rank's for a part of a worker fed by its own rank."""
        return sent

    @abc.abstractmethod
    def receive(self, sink: Landing, call: SyncCall, begin: Callable[[], None]) -> tuple[list[int], tuple[str, ...]]:
        """Take one sync's bytes into ``sink``; returns (checksums, stale tensor names).

        Calls ``begin()`` right before the first byte lands; a failure before that left the
        worker's tensors untouched.
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Tell every peer at once that this side failed (safe to call at any time)."""

    def tear_down(self, by: str) -> None:
        """The session ends, ``by`` whom (see :meth:`SendHalf.tear_down`); by default :meth:`abort`."""
        self.abort()

    @abc.abstractmethod
    def close(self, abort: bool = False) -> None:
        """Release what the session holds."""


class _Aborts(Protocol):
    kind: ClassVar[str]

    def abort(self) -> None: ...

    def tear_down(self, by: str) -> None: ...


def abort_each(halves: Iterable[_Aborts], failure: BaseException | None, torn_down_by: str = "") -> None:
    """Tell every half's peers that this side failed, each in turn, as the failure policy
    wants: a half whose abort itself fails keeps neither the other halves from aborting nor
    ``failure`` (the cause, when this side is failing already) from being the error raised;
    the abort's own error is logged and noted on ``failure``, or raised when there is none.
    An interrupt (a ``BaseException`` that is not an ``Exception``, such as
    ``KeyboardInterrupt``) raised by one half's abort is raised once every other half has
    aborted, in place of ``failure``: it was meant to stop this process. With
    ``torn_down_by`` (the session ends) each half is told through ``tear_down``."""
    first: Exception | None = None
    interrupt: BaseException | None = None
    for half in halves:
        try:
            if torn_down_by:
                half.tear_down(torn_down_by)
            else:
                half.abort()
        except Exception as exc:
            log.error("weightsync: telling the %s transport's peers of a failure failed", half.kind, exc_info=exc)
            note = getattr(failure, "add_note", None)  # Python 3.11+
            if callable(note):
                note(f"(then aborting the {half.kind} transport failed too: {exc!r})")
            if failure is None and first is None:
                first = exc
        except BaseException as exc:  # noqa: BLE001 - raised below, once every half aborted
            if interrupt is None:
                interrupt = exc
    if interrupt is not None:
        if failure is not None and interrupt.__context__ is None:
            interrupt.__context__ = failure  # the traceback shows what was failing
        raise interrupt
    if first is not None:
        raise first


def shed_traceback(exc: BaseException) -> BaseException:
    """``exc`` without its tracebacks (its causes' too), to be raised again after an abort.

    A failed call's frames hold its in-flight collectives, and a gloo group closes its
    sockets, which is what tells the peers at once, only when the last of those is gone.
    """
    log.debug("weightsync: failed, telling the peers: %s", exc, exc_info=exc)
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return exc
