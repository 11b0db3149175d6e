"""A trainer actor that can be stopped in the middle of a sync's transfer, at a known tensor.

The real trainer (``TrainerHost``, the real sender and transports); only the sequence of
tensors its next sync reads is wrapped, so that reading tensor ``index`` first blocks on a
gate (or ends the process): the tensors before it have been packed and sent, the engine's
receive is under way, and the test acts while the transfer is provably in flight::

    trainer = GatedTrainer.options(max_concurrency=2).remote(factory, wire_dtype=torch.bfloat16)
    ray.get(trainer.gate_at.remote(3))
    thread: ws.sync(v)                     # blocks in the trainer's send, at tensor 3
    ray.get(trainer.wait_gated.remote(60)) # True once the send reached the gate
    ... generate on the engine, read the worker ...
    ray.get(trainer.open_gate.remote())    # the transfer goes on; the sync completes

``die_at(index)`` ends the trainer's process (``os._exit``) when the send reaches that tensor.
The actor needs ``max_concurrency=2``: ``open_gate`` runs while ``ws_send`` waits.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import ray
import torch

from weightsync.core.halves import Sources
from weightsync.core.wire.messages import SyncCall
from weightsync.core.wire.outcome import Outcome
from weightsync.glue.actors import TrainerHost


class _Gated(Sequence[torch.Tensor]):
    """``tensors``, where the first read of index ``at`` or beyond runs ``stop`` once."""

    def __init__(self, tensors: Sequence[torch.Tensor], at: int, stop: Any) -> None:
        self._tensors, self._at, self._stop = tensors, at, stop

    def __len__(self) -> int:
        return len(self._tensors)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int) and self._stop is not None and index >= self._at:
            stop, self._stop = self._stop, None
            stop()
        return self._tensors[index]


class _GatedTrainer(TrainerHost):
    _gate: int | None = None
    _die = False
    _after = False

    def gate_at(self, index: int) -> None:
        """The next sync stops before reading tensor ``index`` until :meth:`open_gate`."""
        self._gate, self._die = index, False
        self._opened, self._reached = threading.Event(), threading.Event()

    def gate_after_send(self) -> None:
        """The next sync's send completes, then waits before answering until :meth:`open_gate`
        (a broadcast worker has every byte and waits for the commit that needs this answer)."""
        self._after = True
        self._opened, self._reached = threading.Event(), threading.Event()

    def die_at(self, index: int) -> None:
        """The next sync ends this process before reading tensor ``index``."""
        self._gate, self._die = index, True

    def wait_gated(self, timeout_s: float) -> bool:
        """True once the running sync waits at the gate."""
        return self._reached.wait(timeout_s)

    def open_gate(self) -> None:
        self._opened.set()

    def ws_send(self, call: SyncCall) -> Outcome:
        index, self._gate = self._gate, None  # one sync only
        if self._after:
            self._after = False
            sent = super().ws_send(call)
            self._reached.set()
            self._opened.wait(300)
            return sent
        if index is None:
            return super().ws_send(call)
        sender = self._ws()
        original = sender.checked_sources

        def stop() -> None:
            if self._die:
                os._exit(1)
            self._reached.set()
            self._opened.wait(300)

        def gated() -> Sources:
            sources = original()
            return Sources(_Gated(sources.tensors, index, stop), sources.key, sources.streamed, sources.local)

        sender.checked_sources = gated  # type: ignore[method-assign]
        try:
            return super().ws_send(call)
        finally:
            del sender.checked_sources


GatedTrainer: Any = ray.remote(_GatedTrainer)
