"""The contract of a transport plug-in: one object declares what every layer above needs.

A transport is its mechanism (the halves that move one sync's bytes,
:mod:`weightsync.core.halves`) and its plug-in, a :class:`Transport`: how its
parties open it at setup and which halves that builds, when a worker may commit, whom it
can serve and where it stands among the candidates of ``transport="auto"``, and when the
trainer drives it within a sync. The coordinator, the mixins, the sharded source, the
choice of transport and the CLI loop over the registry (:mod:`weightsync.core.registry`);
none of them names a transport. A half itself says how many walks over a sharded source
it consumes (:meth:`SendHalf.walks`) and whether its worker may commit alone
(:attr:`ReceiveHalf.knows_sender_finished`).

Setup, as the coordinator runs it for each transport, once per serving party that has
workers on it::

    transport.open(opening)        the transport's own steps, each one
        opening.step({party: Request(action, args)}, when) -> {party: value}
    on each party that is asked:   transport.trainer_actions[action](side, *args)
                                   transport.worker_actions[action](side, *args)

``side`` is the party's endpoint seen through :class:`TrainerSide` or :class:`WorkerSide`:
its :class:`~weightsync.core.wire.session.Session`, its device, and where its halves go.
The plug-in object travels with every step (pickled by reference to its module), so a
plug-in defined anywhere, a test module included, needs no registration in the parties'
processes: only the coordinator's registry must know it.

A :class:`Mode` is a plug-in that runs syncs differently over one transport's halves
(push mode over ``direct``): it opens after that transport, with the same steps.
"""

from __future__ import annotations

import enum
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from weightsync.core.halves import Landing, ReceiveHalf, SendHalf
from weightsync.core.wire.errors import SettingsError
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import EndpointInfo, PushResult, ReceiveResult, SendResult, SyncCall
from weightsync.core.wire.plan import Chunk
from weightsync.core.wire.session import Session

_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")


class Serving(str, enum.Enum):
    """Which trainer party serves a worker on a transport (see :mod:`weightsync.glue.ranks`)."""

    LEAD = "lead"
    """Only the lead party (rank 0 of a sharded trainer): it forms the transport's group."""

    NEAREST = "nearest"
    """The rank on the worker's device (or ``worker_ranks[name]``): colocated transports."""

    EVERY = "every"
    """Every rank at once, each sending its own part (owner sends): opened once, by the
    lead, with every rank among the servers; a worker commits on every rank's answer."""


@dataclass(frozen=True, kw_only=True)
class Request:
    """One party's part of a setup step: the plug-in's action to run there, with its arguments."""

    action: str
    args: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.action, str) or not self.action:
            raise SettingsError(f"a setup request names an action, got {self.action!r}")
        object.__setattr__(self, "args", tuple(self.args))


class Opening(Protocol):
    """What a plug-in's ``open`` is given: the parties of one serving party's opening."""

    @property
    def server(self) -> str:
        """The trainer party serving :attr:`members` (``trainer`` or ``trainer-rank-<i>``)."""

    @property
    def servers(self) -> tuple[str, ...]:
        """Every trainer party serving :attr:`members`: ``(server,)``, or with
        ``Serving.EVERY`` every rank in rank order."""

    @property
    def members(self) -> tuple[str, ...]:
        """The workers of this transport that :attr:`server` serves, in a fixed order."""

    @property
    def options(self) -> Mapping[str, Any]:
        """The coordinator's transport options (``backend`` for broadcast)."""

    def info(self, party: str) -> EndpointInfo:
        """Where ``party`` lives (what it answered when it was described at this setup)."""

    def step(self, requests: Mapping[str, Request], when: str) -> dict[str, Any]:
        """Run every party's request at once; each party's value. Raises SetupError naming
        every party that failed (the coordinator tears the set-up down first)."""


class TrainerSide(Protocol):
    """A trainer party's endpoint as a plug-in's trainer actions see it."""

    @property
    def session(self) -> Session:
        """This set-up's Session (raises before the manifest was built)."""

    @property
    def device(self) -> torch.device: ...

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The party's tensors as it holds them (a sharded rank's DTensors, not gathered)."""

    #: What one setup step leaves for a later one (a rendezvous store, a pusher); closed
    #: (when it has ``close()``) and cleared with the party's transports. One that drives
    #: syncs of its own on another thread (a pusher) has ``kind``, the transport it drives,
    #: and ``stop() -> bool``, True when one is in flight: the teardown then tears that
    #: transport's half down first, so the sync ends before ``close()`` waits for it.
    extras: dict[str, Any]

    def half(self, kind: str) -> SendHalf | None:
        """The open sending half of transport ``kind``, if any."""

    def install(self, half: SendHalf) -> None:
        """Make ``half`` this party's half of ``half.kind``, closing the one it replaces."""

    def send(self, call: SyncCall) -> SendResult:
        """The trainer's side of one sync (what a :class:`Mode` drives its own way)."""

    #: Where this party leaves its part of a sync's answer as soon as it has it, in the slot
    #: ``call.reply`` names (``SyncCall.parts``; the glue's reply board); None: its call's
    #: return alone carries it.
    answer_early: Callable[[SyncCall, Any], None] | None


class Listening(Protocol):
    """A worker's listener (push mode): a thread that runs the worker's syncs when its
    server rings, with no Ray call; it lives until the worker's transports close."""

    #: True while it runs a sync (a teardown then tears the worker's half down first).
    busy: bool

    def stop(self) -> None:
        """Ask it to end, without blocking."""

    def close(self, timeout_s: float) -> bool:
        """Stop, join and release; False (nothing released) when it did not end in time."""


class WorkerSide(Protocol):
    """A worker's endpoint as a plug-in's worker actions see it."""

    @property
    def session(self) -> Session: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def sink(self) -> Landing: ...

    #: Which part of its worker this endpoint is, and of how many (``EndpointInfo.parts``):
    #: ``(0, 1)`` for a worker of one process, ``(k, N)`` on an engine's TP rank k of N.
    part: tuple[int, int]

    #: Held while anything writes the worker's weights outside a sync call (an export).
    gate: threading.RLock

    def half(self, kind: str) -> ReceiveHalf | None: ...

    def install(self, half: ReceiveHalf) -> None:
        """Make ``half`` this worker's transport, closing the one it had."""

    #: Push mode's listener while one listens (see :meth:`listen`).
    listener: Listening | None

    def listen(self, start: Callable[[], Listening]) -> Listening:
        """Push mode: keep the listener ``start`` makes (stopping the one it had) until the
        worker's transports close."""

    def receive_pushed(self, call: SyncCall) -> ReceiveResult:
        """One sync's receive that no commit call follows (what a listener runs)."""

    def status(self) -> tuple[int | None, str]:
        """(version, state) of the worker now."""

    #: Where this worker leaves its answer to a pushed sync as soon as it has it, in the slot
    #: ``call.reply`` names (see :attr:`TrainerSide.answer_early`).
    answer_early: Callable[[SyncCall, Any], None] | None


Action = Callable[..., Any]
#: ``fits(trainer, worker, name)``: why the transport cannot serve worker ``name`` placed at
#: ``worker`` from ``trainer`` (ending with what to use instead), or None when it can.
Fit = Callable[[EndpointInfo, EndpointInfo, str], "str | None"]
#: ``fits_every(ranks, worker, name)``: as :data:`Fit`, for a transport every rank serves at
#: once whose fit depends on the ranks together (how many, which one sits where).
FitEvery = Callable[[Sequence[EndpointInfo], EndpointInfo, str], "str | None"]


def _no_chunks(manifest: Manifest) -> tuple[Chunk, ...]:
    return manifest.chunks


#: What ``python -m weightsync doctor`` prints for a transport: (label, None when usable on
#: this host, else why not).
Usability = Sequence[tuple[str, "str | None"]]


class Slots(enum.Enum):
    """How a transport uses the packing buffers (slots) the Manifest lays out, which
    ``buffer_bytes="auto"`` sizes (:mod:`weightsync.core.wire.sizing`)."""

    NONE = "none"
    """It writes straight into the worker's tensors: no slots."""

    OVERLAPPED = "overlapped"
    """Packing chunk k+1 overlaps moving chunk k over a link or on another device, so
    ``num_buffers`` slots rotate."""

    ONE_DEVICE = "one device"
    """Both sides copy through the slots on the trainer's device: on a GPU, whose
    kernels from two processes are time-sliced, a second slot overlaps nothing and only
    adds hand-offs, so ``"auto"`` puts the memory of ``num_buffers`` slots into one."""


@dataclass(frozen=True, kw_only=True)
class Plugin:
    """What every plug-in declares: its name, its setup steps and the actions they run."""

    name: str
    """Lower case, at most 32 characters: how users request it (``transport="ipc"``)."""

    open: Callable[[Opening], None]
    """The setup steps, run by the coordinator once per serving party with members."""

    trainer_actions: Mapping[str, Action] = field(default_factory=dict)
    """Actions a step may ask of a trainer party: ``action(side: TrainerSide, *args)``."""

    worker_actions: Mapping[str, Action] = field(default_factory=dict)
    """Actions a step may ask of a worker: ``action(side: WorkerSide, *args)``."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise SettingsError(
                f"a transport plug-in's name must be lower case letters, digits, '-' or '_' (at most 32, "
                f"starting with a letter), got {self.name!r}"
            )
        if not callable(self.open):
            raise SettingsError(f"plug-in {self.name!r}: open must be callable")
        for side, actions in (("trainer", self.trainer_actions), ("worker", self.worker_actions)):
            bad = sorted(str(k) for k, v in actions.items() if not isinstance(k, str) or not callable(v))
            if bad:
                raise SettingsError(f"plug-in {self.name!r}: {side} actions {bad} must map names to callables")
        object.__setattr__(self, "trainer_actions", dict(self.trainer_actions))
        object.__setattr__(self, "worker_actions", dict(self.worker_actions))

    def action(self, side: str, name: str) -> Action:
        """The ``side`` ("trainer" or "worker") action ``name``; refuses one it does not declare."""
        actions = self.trainer_actions if side == "trainer" else self.worker_actions
        found = actions.get(name)
        if found is None:
            raise SettingsError(f"plug-in {self.name!r} has no {side} action {name!r}; it declares {sorted(actions)}")
        return found


@dataclass(frozen=True, kw_only=True)
class Transport(Plugin):
    """One transport: its halves, whom it serves, and how ``auto`` ranks it."""

    send_half: type[SendHalf]
    """The trainer's half its setup builds."""

    receive_half: type[ReceiveHalf]
    """The worker's half its setup builds; its ``knows_sender_finished`` is the commit rule."""

    fits: Fit
    """Whether it can serve a worker placed there (see :data:`Fit`)."""

    serving: Serving = Serving.NEAREST
    """Which trainer party serves its workers."""

    auto_rank: int | None = None
    """Its place among ``auto``'s candidates (the lowest that fits wins); None: only on request."""

    send_order: int = 100
    """When the trainer drives it within a sync (lowest first; built-ins: direct 10, ipc 20,
    broadcast 30: colocated workers are written while the broadcast workers still wait)."""

    plan: Callable[[Manifest], Sequence[Chunk]] = _no_chunks
    """The chunks it moves a manifest in (what a sync's report counts)."""

    usable_here: Callable[[], Usability] | None = None
    """Whether it can run on this host, per variant (the doctor's rows); None: no check."""

    fits_every: FitEvery | None = None
    """With ``Serving.EVERY``: checked once against all the ranks, before :attr:`fits` is
    checked against each (see :data:`FitEvery`); None: :attr:`fits` alone decides."""

    slots: Slots = Slots.OVERLAPPED
    """How it uses the Manifest's packing buffers (see :class:`Slots`)."""

    feeds_parts: bool = False
    """True when each part of a worker of several processes (``EndpointInfo.parts``: an
    engine's TP ranks) runs every worker action and receives its own bytes, from its own
    trainer rank; an engine then forwards each of its calls to every part and answers for
    all of them. False: part 0 is the worker, and hands the bytes on to its other parts."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fits_every is not None and (not callable(self.fits_every) or self.serving is not Serving.EVERY):
            raise SettingsError(f"transport {self.name!r}: fits_every must be callable, and only with Serving.EVERY")
        if self.feeds_parts and self.serving is not Serving.EVERY:
            raise SettingsError(f"transport {self.name!r}: feeds_parts needs Serving.EVERY (each part has its rank)")
        if not (isinstance(self.send_half, type) and issubclass(self.send_half, SendHalf)):
            raise SettingsError(f"transport {self.name!r}: send_half must be a SendHalf subclass")
        if not (isinstance(self.receive_half, type) and issubclass(self.receive_half, ReceiveHalf)):
            raise SettingsError(f"transport {self.name!r}: receive_half must be a ReceiveHalf subclass")
        if not callable(self.fits) or not callable(self.plan):
            raise SettingsError(f"transport {self.name!r}: fits and plan must be callable")
        if self.usable_here is not None and not callable(self.usable_here):
            raise SettingsError(f"transport {self.name!r}: usable_here must be callable or None")
        if self.auto_rank is not None and not isinstance(self.auto_rank, int):
            raise SettingsError(f"transport {self.name!r}: auto_rank must be an int or None")
        object.__setattr__(self, "serving", Serving(self.serving))
        if not isinstance(self.slots, Slots):
            known = ", ".join(f"Slots.{s.name}" for s in Slots)
            raise SettingsError(f"transport {self.name!r}: slots must be one of {known}, got {self.slots!r}")

    @property
    def commits_alone(self) -> bool:
        """True when a worker's receive returning means the sender finished too, so the
        worker commits at once; otherwise it commits in a call chained on the sender's answer."""
        return self.receive_half.knows_sender_finished


@dataclass(frozen=True, kw_only=True)
class Mode(Plugin):
    """A way of running syncs over one transport's halves (push mode over direct)."""

    over: str
    """The transport every worker must use in this mode; it is opened first."""

    sync: Callable[[TrainerSide, SyncCall, str], PushResult]
    """One sync in this mode, run on the serving trainer party: ``sync(side, call, owner)``
    (``owner``: the label of the coordinator asking, "" from inside the trainer); refuses,
    saying what to do, when the mode is not set up on ``side``."""

    armed: Callable[[TrainerSide], bool] | None = None
    """Whether the mode is set up on the trainer party ``side`` now (a trainer that several
    coordinators set up picks the session a sync from inside it is for); None: it cannot tell."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.over, str) or not self.over:
            raise SettingsError(f"mode {self.name!r}: over must name a transport")
        if not callable(self.sync):
            raise SettingsError(f"mode {self.name!r}: sync must be callable")
        if self.armed is not None and not callable(self.armed):
            raise SettingsError(f"mode {self.name!r}: armed must be callable or None")
