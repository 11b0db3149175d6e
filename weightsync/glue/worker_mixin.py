"""The worker's side of the coordinator's protocol, as a mixin for any inference actor.

Mix :class:`WorkerMixin` into a Ray actor that holds ``self.model`` (or overrides
``weightsync_model()``), or forward the protocol to the processes that hold the model
(:func:`forward_worker_protocol`). Call order per session: ws_describe -> ws_accept ->
ws_open, once per step of its transport plug-in's setup -> per sync ws_receive (and
ws_commit, when the transport's worker cannot tell that the sender finished), ws_settle
after a failure -> ws_teardown. No method names a transport.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from weightsync.core.abandon import abandon_receive
from weightsync.core.ownership import foreign
from weightsync.core.plugin import Plugin
from weightsync.core.receiver import WeightReceiver
from weightsync.core.sinks import ModuleSink, Sink
from weightsync.core.wire.casts import TensorCast
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import BoardOffer, EndpointInfo, SyncCall
from weightsync.core.wire.outcome import Outcome
from weightsync.core.wire.session import TRAINER_PARTY
from weightsync.core.wire.settings import DEFAULT_TIMEOUT_S
from weightsync.glue.protocol import answer, describe, model_of, resolve_device
from weightsync.glue.replies import REPLYING, on_board, post_reply, reply_board_answer


class WorkerMixin:
    """Weight-sync methods for an inference worker actor. Needs ``self.model`` (or override
    ``weightsync_model``); set ``self.weightsync_sink`` to a Sink to load another way, and
    optionally ``self.expect_buffer_bytes`` / ``self.expect_num_buffers`` /
    ``self.expect_inplace_bytes``. A LoRA sync (``lora=True``) lands in the model's PEFT
    adapter, or where ``self.weightsync_adapter_sink(manifest, who)`` says (an
    :data:`~weightsync.core.lora.sink.AdapterSinkFactory`)."""

    def weightsync_model(self) -> nn.Module:
        return model_of(self, "WorkerMixin")

    def weightsync_device(self) -> torch.device:
        return resolve_device(getattr(self, "device", "cpu"))

    def _wr(self) -> WeightReceiver:
        receiver = getattr(self, "_ws_receiver", None)
        if receiver is None:
            sink: Sink | None = getattr(self, "weightsync_sink", None)
            receiver = WeightReceiver(
                sink if sink is not None else ModuleSink(self.weightsync_model()),
                self.weightsync_device(),
                "worker",
                getattr(self, "expect_buffer_bytes", None),
                getattr(self, "expect_num_buffers", None),
                getattr(self, "expect_inplace_bytes", None),
            )
            receiver.part = getattr(self, "weightsync_part", (0, 1))
            receiver.adapter_sink = getattr(self, "weightsync_adapter_sink", None)
            receiver.answer_early = self._ws_answer_early
            self._ws_receiver = receiver
        return receiver

    def _ws_answer_early(self, call: SyncCall, value: Any) -> None:
        """A listener's answer to a push, left on its coordinator's board as well (the call
        it read from its mailbox names no owner: its session's is this worker's)."""
        post_reply(self, dataclasses.replace(call, owner=self._wr().owner), value)

    def _me(self) -> str:
        receiver = getattr(self, "_ws_receiver", None)
        return receiver.name if receiver is not None else "worker"

    def _ws_abandon(self, call: SyncCall) -> bool:
        """``ws_receive`` for ``call`` ended: abort this worker's side if it never began
        (see :func:`weightsync.glue.replies.abandon_unbegun`)."""
        receiver = getattr(self, "_ws_receiver", None)
        return receiver is not None and abandon_receive(receiver, call)

    def ws_describe(self) -> Outcome:
        sink = getattr(self, "weightsync_sink", None)

        def where() -> EndpointInfo:
            # A sink that transforms on load, or stages, takes no direct writes into the model.
            info = describe(self.weightsync_device(), bool(getattr(sink, "allows_direct", True)))
            return dataclasses.replace(info, stages=bool(getattr(sink, "staged", False)))

        return answer(self._me(), "describe", where)

    def ws_accept(
        self,
        manifest: Manifest,
        name: str,
        server: str = TRAINER_PARTY,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        owner: str = "",
    ) -> Outcome:
        """Check the trainer's manifest and start this worker's Session as ``name``, fed by
        ``server`` (the trainer party named when it fails), for coordinator ``owner`` (which
        takes this worker over from any other); the outcome's value is the tensors its sink
        casts on load (a tuple of ``TensorCast``)."""

        def accept() -> tuple[TensorCast, ...]:
            receiver = self._wr()
            receiver.name = name
            return receiver.accept(manifest, server, timeout_s, owner)

        return answer(name, "accept", accept)

    def ws_open(self, plugin: Plugin, action: str, *args: Any) -> Outcome:
        """One step of ``plugin``'s setup on this worker: its worker action ``action``."""
        return answer(self._me(), f"{plugin.name} {action}", lambda: plugin.action("worker", action)(self._wr(), *args))

    @contextlib.contextmanager
    def weightsync_reading(self) -> Iterator[None]:
        """Hold while reading the weights: a sync never writes them meanwhile.

        In push mode a listener thread writes the weights; with a staging sink
        (``ModuleSink(model, stage="auto")``) a sync writes only its stage, and its commit
        swaps the stage in under this same hold, so a reader waits only for that one copy.
        A staging actor's call order, with a second thread for its own calls (Ray's
        ``max_concurrency=2``)::

            thread 1 (the coordinator)       thread 2 (your generation)
            ws_receive: bytes -> stage       with self.weightsync_reading(): generate(...)  # version N
            (ws_commit): swap, one copy      ...waits for the swap...
                                             with self.weightsync_reading(): generate(...)  # version N+1
        """
        with self._wr().reading():
            yield

    @on_board
    def ws_receive(self, call: SyncCall) -> Outcome:
        """This worker's side of one sync (every transport); commits unless it is a broadcast."""
        return answer(self._me(), "receive", self._wr().receive, call)

    @on_board
    def ws_commit(self, call: SyncCall, received: Outcome, reference: Outcome | None, *sent: Outcome) -> Outcome:
        """A broadcast worker (every worker, with verify) takes the version once its own
        receive, the side of every trainer party serving it and, with verify, the reference
        trainer party's side are known. They arrive as Ray object refs, so Ray starts this as
        soon as all answered."""
        return answer(self._me(), "commit", self._wr().commit, call, received, reference, *sent)

    def ws_reply_board(self, offer: BoardOffer) -> Outcome:
        """Take coordinator ``offer.owner``'s reply board: answers "" once this actor will
        answer its sync calls there too, else why not (:mod:`weightsync.glue.replies`)."""
        return reply_board_answer(self, offer)

    def ws_settle(self, owner: str = "") -> Outcome:
        return answer(self._me(), "settle", self._wr().settle, owner)

    def ws_checksums(self) -> Outcome:
        return answer(self._me(), "checksums", self._wr().checksums)

    def ws_status(self) -> tuple[int | None, str]:
        return self._wr().status()

    def ws_teardown(self, abort: bool = False, owner: str = "") -> Outcome:
        """Close this worker's transports, unless another coordinator than ``owner`` set it up
        since (that one's session stays)."""

        def teardown() -> None:
            receiver = getattr(self, "_ws_receiver", None)
            if receiver is not None and not foreign(receiver.owner, owner):
                receiver.close_transports(abort)

        return answer(self._me(), "teardown", teardown)


#: The methods the coordinator calls on a worker; :func:`forward_worker_protocol` adds them
#: to an actor that hosts its model elsewhere (an inference engine's worker processes).
WORKER_PROTOCOL: tuple[str, ...] = tuple(
    name for name in vars(WorkerMixin) if name.startswith("ws_") and callable(getattr(WorkerMixin, name))
)
#: Of those, the ones a forwarding actor answers itself: it is the party the coordinator
#: calls, so the reply board is mapped there.
LOCAL = ("ws_reply_board",)


def forward_worker_protocol(cls: type) -> type:
    """Class decorator: give ``cls`` every method of :data:`WORKER_PROTOCOL`, each calling
    ``self.forward_weightsync(method_name, *args, **kwargs)``.

    For an actor whose model lives in processes it drives, such as an inference engine
    with its own workers (vLLM's ``collective_rpc``): those processes mix in
    :class:`WorkerMixin`, and this actor forwards the coordinator's calls to them. Apply it
    before ``ray.remote`` (Ray reads an actor's methods when the class is made remote)::

        @ray.remote
        @forward_worker_protocol
        class Engine:
            def forward_weightsync(self, method, *args, **kwargs):
                return self.llm.collective_rpc(method, args=args, kwargs=kwargs)[0]
    """
    if not callable(getattr(cls, "forward_weightsync", None)):
        raise TypeError(f"{cls.__name__} needs a forward_weightsync(method, *args, **kwargs) method")

    def forwarder(method: str) -> Callable[..., Any]:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self.forward_weightsync(method, *args, **kwargs)

        call.__name__ = call.__qualname__ = method
        call.__doc__ = f"Forwards {method} to the processes holding the model."
        # The answer this actor returns (after its own work around the forwarded call) is
        # the one it leaves on the coordinator's reply board.
        return on_board(call) if method in REPLYING else call

    def ws_reply_board(self: Any, offer: BoardOffer) -> Outcome:
        """Take the coordinator's reply board here, in the actor it calls."""
        return reply_board_answer(self, offer)

    # Every method is a function of this class's own: Ray marks the function objects
    # (``ray.method(concurrency_group=...)``), which a shared one would carry to other classes.
    for method in WORKER_PROTOCOL:
        if method not in vars(cls):
            setattr(cls, method, ws_reply_board if method in LOCAL else forwarder(method))
    return cls
