"""The trainer's endpoint: which tensors travel, under which names and wire dtypes.

:class:`WeightSender` holds the model side of a transfer and the sending halves of the
transports opened for it. It imports no Ray and names no transport: the actors wrap it, any
process layout can drive it, and the plug-ins' setup actions install its halves (it is
their :class:`~weightsync.core.plugin.TrainerSide`). One session, as the
coordinator runs it::

    sender.manifest(settings)            -> Manifest (rebuilt from the model at every setup;
                                            the sender's Session starts here)
    each plug-in's trainer actions       -> sender.install(half)
    per sync: sender.send(call)          -> SendResult, alongside every worker's receive
    sender.close_transports(abort)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from weightsync.core.delta.sending import DeltaSending
from weightsync.core.halves import Rider, SendHalf, Sources, abort_each, shed_traceback
from weightsync.core.packing import read_checksums, tensor_checksums, word_sum
from weightsync.core.riders import RiddenTensors
from weightsync.core.sinks import module_tensors
from weightsync.core.tensor_paths import TensorPaths
from weightsync.core.wire.adapter import AdapterConfig
from weightsync.core.wire.dtypes import check_wire_dtype
from weightsync.core.wire.errors import ModelChangedError, WeightSyncError
from weightsync.core.wire.manifest import Manifest, TensorSpec
from weightsync.core.wire.messages import SendResult, SyncCall
from weightsync.core.wire.session import TRAINER_PARTY, Session
from weightsync.core.wire.settings import SyncSettings
from weightsync.core.wire.sizing import BufferHints, free_memory_bytes, resolve_buffers
from weightsync.mechanisms.batched_copy import PlanKey, plan_key

Transform = Callable[[str, torch.Tensor], torch.Tensor]


@dataclass
class WeightSender:
    """The trainer's side. Reads (name, tensor) pairs from a module (or any source).

    ``wire_dtype`` casts floating tensors on the wire (fp32 master weights sent as bf16);
    the cast happens inside the copy into the buffer, so it costs no extra pass. A general
    ``transform(name, tensor)`` runs per sync instead and may allocate. ``adapter``, with a
    ``source`` of a LoRA adapter's tensors: what they mean, read at each setup into the
    Manifest (:mod:`weightsync.core.lora`).
    """

    model: nn.Module | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    source: Callable[[], Sequence[tuple[str, torch.Tensor]]] | None = None
    wire_dtype: torch.dtype | None = None
    transform: Transform | None = None
    name: str = TRAINER_PARTY
    adapter: Callable[[], AdapterConfig] | None = None

    def __post_init__(self) -> None:
        if self.model is None and self.source is None:
            raise ValueError("WeightSender needs a model or a source callable")
        check_wire_dtype(self.wire_dtype)
        self._session: Session | None = None
        self.halves: dict[str, SendHalf] = {}
        #: What one setup step of a plug-in leaves for a later one (see TrainerSide.extras).
        self.extras: dict[str, Any] = {}
        self._paths: TensorPaths | None = None  # how the last fully checked tensors were reached
        self._checked_key: PlanKey | None = None  # their layout when last checked
        #: Who set up this party's current session, and who last tore its transports down
        #: (the coordinators' labels): what a push that finds no session is told.
        self.owner, self.closed_by = "", ""
        #: (owner, seq) of the last sync whose halves were started here (see weightsync.core.abandon).
        self.began: tuple[str, int] | None = None
        #: Delta sessions: the base and its encoder (kept across setups of the same tensors).
        self.delta: DeltaSending | None = None
        #: Leaves a part of a sync's answer early (see TrainerSide.answer_early).
        self.answer_early: Callable[[SyncCall, Any], None] | None = None

    def _pairs(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.source()) if self.source is not None else module_tensors(self.model)  # type: ignore[arg-type]

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        pairs = self._pairs()
        if self.transform is not None:
            pairs = [(n, self.transform(n, t.detach())) for n, t in pairs]
        return [(n, t.detach()) for n, t in pairs]

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        if self.wire_dtype is not None and dtype.is_floating_point:
            return self.wire_dtype
        return dtype

    def specs(self) -> list[TensorSpec]:
        # Shapes and dtypes only: detaching every tensor costs more than reading them.
        pairs = self.named_tensors() if self.transform is not None else self._pairs()
        return [TensorSpec.of(n, t, self._wire(t.dtype)) for n, t in pairs]

    def manifest(self, settings: SyncSettings, hints: BufferHints | None = None, owner: str = "") -> Manifest:
        """Fix the wire contract for a new session from the model as it is now;
        ``buffer_bytes="auto"`` is resolved here, from ``hints`` (:class:`BufferHints`);
        ``owner`` labels the coordinator setting it up."""
        self.close_transports()
        self.owner, self.closed_by = owner, ""
        self._paths = None
        self._checked_key = None
        adapter = self.adapter() if self.adapter is not None else None  # before the tensors, which check it
        specs = self.specs()
        if hints is None:
            free = free_memory_bytes(self.device)
            hints = BufferHints(device=self.device.type, free_bytes=() if free is None else (free,))
        buffer_bytes, num_buffers = resolve_buffers(
            settings.buffer_bytes, specs, settings.num_buffers, settings.alignment, hints
        )
        manifest = Manifest.build(
            specs, buffer_bytes, num_buffers, settings.alignment, settings.inplace_bytes, settings.delta
        )
        if adapter is not None:
            manifest = replace(manifest, adapter=adapter)
        if not settings.delta:
            self.delta = None  # its base's memory goes with it
        elif self.delta is None or self.delta.where != settings.delta_base:
            self.delta = DeltaSending(settings.delta_base)
        self._session = Session(manifest=manifest, party=self.name, server=self.name, timeout_s=settings.timeout_s)
        return manifest

    @property
    def session(self) -> Session:
        if self._session is None:
            raise WeightSyncError(f"{self.name}: no manifest yet; run setup()")
        return self._session

    @property
    def current_manifest(self) -> Manifest:
        return self.session.manifest

    def checked_sources(self) -> Sources:
        """This sync's tensors in manifest order and their :func:`plan_key`; refuses, naming
        the tensors, a model that changed since setup (added, removed, reshaped, re-typed).

        The tensors may be the module's own parameters, not detached (detaching 194 of them costs
        more than checking them): copy from them under ``torch.no_grad()``. Names are checked again
        only when the module's structure changed since the last check (:class:`TensorPaths`):
        walking and naming every tensor each sync costs more than the copies of a small model. The
        key of the last checked tensors is kept, and returned as the same object while nothing
        moved, so a copy plan keyed on it is reused with an identity check.
        """
        manifest = self.current_manifest
        plain = self.model is not None and self.source is None and self.transform is None
        paths = self._paths
        if plain and paths is not None and paths.unchanged():
            current = paths.tensors
            key = plan_key(current)
            if key == self._checked_key:
                return Sources(current, self._checked_key)
            if all(
                row[1] == spec.shape and self._wire(row[3]) == spec.torch_dtype
                for row, spec in zip(key, manifest.specs)
            ):
                self._checked_key = key
                return Sources(current, key)
        tensors = [t for _, t in self.checked_pairs(manifest)]
        key = plan_key(tensors)
        if plain:
            self._paths = TensorPaths(self.model, manifest.names)  # type: ignore[arg-type]
            self._checked_key = key
        return Sources(tensors, key)

    def sources(self) -> list[torch.Tensor]:
        """This sync's tensors in manifest order, detached (see :meth:`checked_sources`)."""
        return [t.detach() for t in self.checked_sources().tensors]

    def checked_pairs(self, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
        """Every (name, tensor) to send, after refusing, naming the tensors, a model that
        changed since ``manifest`` was made."""
        pairs = self.named_tensors()
        problems = self._changes(manifest, pairs)
        if problems:
            raise ModelChangedError(
                f"{self.name}: the model changed since setup (nothing was sent): {'; '.join(problems)}; "
                "run WeightSync.setup() again once every worker holds the same model"
            )
        return pairs

    def _changes(self, manifest: Manifest, pairs: Sequence[tuple[str, torch.Tensor]]) -> list[str]:
        now = {n: t for n, t in pairs}
        then = {s.name: s for s in manifest.specs}
        problems = [f"{n} added" for n in now if n not in then]
        problems += [f"{n} removed" for n in then if n not in now]
        for name in then.keys() & now.keys():
            spec, tensor = then[name], now[name]
            if tuple(tensor.shape) != spec.shape:
                problems.append(f"{name} is now {list(tensor.shape)}, was {list(spec.shape)}")
            elif self._wire(tensor.dtype) != spec.torch_dtype:
                problems.append(f"{name} is now {tensor.dtype}, the manifest sends {spec.dtype}")
        if not problems and [n for n, _ in pairs] != list(manifest.names):
            problems.append("the tensors' order changed")
        return sorted(problems)

    def checksums(self) -> list[int]:
        """Per tensor, the checksum of its bytes as they travel (after the wire cast)."""
        manifest = self.current_manifest
        sources = self.checked_sources()
        with torch.no_grad():
            return tensor_checksums([t.to(s.torch_dtype) for s, t in zip(manifest.specs, sources.tensors)])

    # one sync ---------------------------------------------------------------------------
    def send(self, call: SyncCall) -> SendResult:
        """The trainer's side of one sync: each transport of ``call.targets`` in turn.

        Any failure is told to every peer of every transport at once (abort words, the
        broadcast agreement or a group abort) before it is raised.
        """
        start = time.perf_counter()
        # One deadline for the whole call, whichever transports it drives: the workers'
        # and the coordinator's deadlines are counted from the same moment.
        deadline = self.session.deadlines.leader(time.monotonic())
        call = self.resolve(call)
        failure: BaseException | None = None
        sources: Sources | None = None
        try:
            self.start_halves(call)
            sources = self.checked_sources()
            checksums, stale = self.drive(sources, call, deadline)
        except BaseException as exc:  # noqa: BLE001 - re-raised below, once the peers know
            failure = shed_traceback(exc)
        if failure is not None:
            self.abort_halves(call, failure)
            raise failure
        assert sources is not None
        return SendResult(
            checksums=checksums,
            stale=stale,
            seconds=time.perf_counter() - start,
            tensor_checksums=sources.checksums or [],
            sent_bytes=self.sent_bytes(call),
        )

    def drive(self, sources: Sources, call: SyncCall, deadline: float) -> tuple[dict[str, list[int]], tuple[str, ...]]:
        """Run this sync's halves over ``sources`` in the order of ``call.targets``;
        (checksums per transport, stale workers). With ``verify``, first one walk for the
        checksum of every tensor as it travels (``sources.checksums``), what each worker's
        destination is compared with before it commits."""
        checksums: dict[str, list[int]] = {}
        stale: tuple[str, ...] = ()
        for kind in call.kinds:
            self.open_half(kind).sent_nbytes = None
        if call.verify:
            specs = self.current_manifest.specs
            with torch.no_grad():
                # One cast at a time: streamed sources must not all be alive at once.
                sources.checksums = read_checksums(
                    [word_sum(t.to(spec.torch_dtype)) for t, spec in zip(sources.tensors, specs)]
                )
        prepared = (
            self.delta.prepare(self.current_manifest, self.halves, sources, call, self.device) if self.delta else None
        )
        sources.delta = prepared  # what the caller reports (sent bytes, the base's token)
        if prepared is not None and sources.streamed:
            # The encoder made this sync's one walk: every half sends from the base.
            walked = Sources(prepared.dense, None, local=sources.local)
            walked.checksums, walked.delta, sources = sources.checksums, prepared, walked
        sources.deltas = self.delta if self.current_manifest.agreed.delta else None
        riders = self._riders(sources, call, deadline)
        shared = RiddenTensors(sources.tensors, list(riders.values())) if riders else None
        carried = Sources(shared, None, streamed=True, local=sources.local) if shared is not None else sources
        carried.checksums = sources.checksums
        for kind in call.kinds:
            if kind in riders:
                continue
            walks = self.open_half(kind).walks(call.to(kind), call.verify) > 0
            checksums[kind], found = self.open_half(kind).send(carried if walks else sources, call, deadline)
            stale += found
        if shared is not None:
            shared.complete()
        for kind, rider in riders.items():
            checksums[kind], found = rider.finish()
            stale += found
        if prepared is not None:
            prepared.complete()
        return checksums, stale

    def sent_bytes(self, call: SyncCall) -> dict[str, int]:
        """Per transport of the sync just sent, the bytes it moved (each once, whatever its
        peers): what the half says (a delta, a rank's own rows), else the Manifest's."""
        total = self.current_manifest.total_bytes
        return {kind: n if (n := self.open_half(kind).sent_nbytes) is not None else total for kind in call.kinds}

    def _riders(self, sources: Sources, call: SyncCall, deadline: float) -> dict[str, Rider]:
        """On streamed sources, the halves that ride the walk of another (none when no half
        of this sync walks the sources itself): see :mod:`weightsync.core.riders`."""
        if not sources.streamed or not self._carrier(call):
            return {}
        riders: dict[str, Rider] = {}
        for kind in call.kinds:
            rider = self.open_half(kind).ride(sources, call, deadline)
            if rider is not None:
                riders[kind] = rider
        return riders

    def _carrier(self, call: SyncCall) -> bool:
        """Whether a half of this sync that cannot ride walks the sources itself."""
        halves = [(kind, self.open_half(kind)) for kind in call.kinds]
        return any(not half.rides and half.walks(call.to(kind), call.verify) > 0 for kind, half in halves)

    def resolve(self, call: SyncCall) -> SyncCall:
        """``call`` with its targets given: the order of ``call.targets`` is the order the
        halves are driven in (the coordinator's, by each transport's ``send_order``); a call
        without them drives every open half, with all its peers, in the order they were
        installed (a single-process caller that opened them itself)."""
        if call.targets is not None:
            return call
        return replace(call, targets={kind: half.peers for kind, half in self.halves.items()})

    def walks(self, call: SyncCall) -> int:
        """The passes over the tensors this sync makes: one for the checksums with ``verify``,
        then its halves' (see weightsync.core.sharded); in a delta session the encoder's
        one walk serves every half."""
        if self.delta is not None and self.delta.carried(self.current_manifest, self.halves, call):
            return int(call.verify) + 1
        carried = self._carrier(call)
        return int(call.verify) + sum(
            self.open_half(kind).walks(call.to(kind), call.verify)
            for kind in call.kinds
            if not (carried and self.open_half(kind).rides)
        )

    def start_halves(self, call: SyncCall) -> None:
        """Tell this sync's halves it starts (before any check that may fail it)."""
        self.began = (call.owner, call.seq)
        for kind in call.kinds:
            half = self.halves.get(kind)
            if half is not None:
                half.start(call)

    def abort_halves(self, call: SyncCall, failure: BaseException | None = None) -> None:
        """Tell every peer of this sync's transports that this side failed (``failure``:
        the cause, which stays the error raised whatever an abort does; see
        :func:`~weightsync.core.halves.abort_each`)."""
        abort_each([h for kind in call.kinds if (h := self.halves.get(kind)) is not None], failure)

    # transports (the plug-ins' TrainerSide) ---------------------------------------------
    def half(self, kind: str) -> SendHalf | None:
        return self.halves.get(kind)

    def open_half(self, kind: str) -> SendHalf:
        half = self.halves.get(kind)
        if half is None:
            raise WeightSyncError(
                f"{self.name}: asked to drive the {kind!r} transport, which is not open on this party; run setup()"
            )
        return half

    def install(self, half: SendHalf) -> None:
        """Make ``half`` this party's half of its transport, closing the one it replaces."""
        self._close(half.kind)
        self.halves[half.kind] = half

    def _close(self, kind: str, abort: bool = False) -> None:
        half = self.halves.pop(kind, None)
        if half is not None:
            half.close(abort)

    def close_transports(self, abort: bool = False, by: str = "") -> None:
        """Close every half and extra; ``by`` (a coordinator's label and why) is recorded
        when a push session was among them.

        With ``abort`` the peers are told first, through each half's ``tear_down``; so are
        those of the halves a push still in flight on another thread drives, whatever
        ``abort`` says, so that push ends now rather than at its deadline. The extras (a
        pusher) close before the halves, so that push ends before the memory it reads is
        released."""
        # An extra that drives syncs of its own (a pusher, whose ``kind`` is the transport it
        # drives) says, as it stops, whether one is in flight. ``by`` is recorded only when
        # there was one to tear down: a push finding none is told who closed it.
        drivers = [e for e in self.extras.values() if callable(getattr(e, "stop", None))]
        if by and drivers:
            self.closed_by = by
        pushing = {e.kind for e in drivers if e.stop()}
        extras, self.extras = self.extras, {}
        told: BaseException | None = None
        torn = [h for kind, h in self.halves.items() if abort or kind in pushing]
        if torn:
            try:
                abort_each(torn, None, torn_down_by=by or f"{self.name}'s teardown")
            except BaseException as exc:  # noqa: BLE001 - raised below, once everything is closed
                told = exc
        for extra in extras.values():
            close = getattr(extra, "close", None)
            if callable(close):
                close()
        for kind in list(self.halves):
            self._close(kind, abort)
        if told is not None:
            raise told
