"""A transport plug-in written outside the package: each sync's tensors, pickled, travel
through a Ray queue per worker. Slow and simple; it shows that a transport is one module.

Nothing under weightsync/ knows it: the test registers ``PICKLED`` in the driver, and every
setup step carries the plug-in to the party that runs it. Setup::

    open (driver)     one ray.util.queue.Queue per worker
    trainer "attach"  keeps the queues (PickledSender)
    worker "attach"   keeps its queue (PickledReceiver)
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from ray.util.queue import Empty, Queue

from weightsync.core.halves import Landing, ReceiveHalf, SendHalf, Sources
from weightsync.core.plugin import Opening, Request, Serving, TrainerSide, Transport, WorkerSide
from weightsync.core.wire import EndpointInfo, PeerAborted, Session, SyncCall, TransferTimeout, WeightSyncError

KIND = "pickled"
#: Every queue the plug-in made in this process (the driver), for the test to clean up.
QUEUES: list[Queue] = []
_ABORT = "abort"


class PickledSender(SendHalf):
    kind = KIND

    def __init__(self, session: Session, queues: dict[str, Queue]) -> None:
        self.session = session
        self.queues = queues

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(self.queues)

    def send(self, sources: Sources, call: SyncCall, deadline: float) -> tuple[list[int], tuple[str, ...]]:
        specs = self.session.manifest.specs
        with torch.no_grad():
            tensors = [
                t.detach().to("cpu", spec.torch_dtype).contiguous().clone() for spec, t in zip(specs, sources.tensors)
            ]
        payload = pickle.dumps(tensors)
        for worker in call.to(self.kind):
            self.queues[worker].put((call.seq, payload), timeout=max(0.001, deadline - time.monotonic()))
        return [], ()

    def abort(self) -> None:
        for queue in self.queues.values():
            queue.put_nowait((_ABORT, self.session.party))

    def close(self, abort: bool = False) -> None:
        if abort:
            self.abort()
        self.queues = {}


class PickledReceiver(ReceiveHalf):
    kind = KIND
    knows_sender_finished = True  # once the payload arrived, the sender is done with this worker

    def __init__(self, session: Session, queue: Queue) -> None:
        self.session = session
        self.queue = queue

    def receive(self, sink: Landing, call: SyncCall, begin: Callable[[], None]) -> tuple[list[int], tuple[str, ...]]:
        me, server = self.session.party, self.session.server
        deadline = self.session.deadlines.follower(time.monotonic())
        try:
            seq, payload = self.queue.get(timeout=max(0.001, deadline - time.monotonic()))
        except Empty:
            raise TransferTimeout(f"{me}: nothing from {server} by the deadline", blames=[server]) from None
        if seq == _ABORT:
            raise PeerAborted(f"{me}: {payload} failed during the transfer", blames=[server])
        if seq != call.seq:
            raise WeightSyncError(f"{me}: got sync {seq} from {server}, expected {call.seq}")
        tensors: list[torch.Tensor] = pickle.loads(payload)
        manifest = self.session.manifest
        destinations = sink.destinations(manifest)
        begin()
        handed = []
        with torch.no_grad():
            for spec, tensor, destination in zip(manifest.specs, tensors, destinations):
                if destination is None:
                    handed.append((spec.name, tensor))
                else:
                    destination.copy_(tensor)
        if handed:
            sink.consume(handed)
        return [], ()

    def abort(self) -> None:
        pass  # the sender does not wait on its workers

    def close(self, abort: bool = False) -> None:
        pass


def open_pickled(opening: Opening) -> None:
    queues = {name: Queue(actor_options={"num_cpus": 0}) for name in opening.members}
    QUEUES.extend(queues.values())
    requests = {name: Request(action="attach", args=(queues[name],)) for name in opening.members}
    requests[opening.server] = Request(action="attach", args=(queues,))
    opening.step(requests, "handing out the queues")


def _attach_trainer(side: TrainerSide, queues: dict[str, Queue]) -> None:
    side.install(PickledSender(side.session, queues))


def _attach_worker(side: WorkerSide, queue: Queue) -> None:
    side.install(PickledReceiver(side.session, queue))


def fits(trainer: EndpointInfo, worker: EndpointInfo, name: str) -> str | None:
    return None  # anywhere Ray reaches


PICKLED = Transport(
    name=KIND,
    open=open_pickled,
    trainer_actions={"attach": _attach_trainer},
    worker_actions={"attach": _attach_worker},
    send_half=PickledSender,
    receive_half=PickledReceiver,
    fits=fits,
    serving=Serving.NEAREST,
    send_order=40,
)


def shut_queues(queues: Sequence[Any]) -> None:
    for queue in queues:
        queue.shutdown(force=True)
