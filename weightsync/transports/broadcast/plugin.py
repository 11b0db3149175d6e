"""The broadcast plug-in: trainer and workers on different devices or nodes.

Setup, run by the coordinator for the lead trainer party (rank 0 of a sharded trainer,
which serves every broadcast worker)::

    store     the lead opens the rendezvous store: on 127.0.0.1 when every member is on
              its node, else on the address Ray reports for its node (logged), never on
              every interface; the group's keys sit under a random 128-bit prefix, since
              anyone who can reach the store's port can read and write it
    nccl id   on GPUs: the lead makes NCCL's unique id
    join      every member joins the group at once (the lead is rank 0, the workers 1..N
              in order) and installs its half: BroadcastSender / BroadcastReceiver

A worker commits only once the trainer's side is known too (a broadcast receiver cannot
tell that the sender finished): the coordinator chains that commit on both answers.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import Any

import torch

from weightsync.core.placement import gpu_reason, same_device
from weightsync.core.plugin import Opening, Request, Serving, TrainerSide, Transport, WorkerSide
from weightsync.core.wire.manifest import Manifest
from weightsync.core.wire.messages import EndpointInfo
from weightsync.core.wire.plan import Chunk
from weightsync.mechanisms.gloo import GlooCommunicator, open_store
from weightsync.transports.broadcast.halves import BroadcastReceiver, BroadcastSender, Communicator
from weightsync.transports.broadcast.messages import GroupSpec

log = logging.getLogger("weightsync")


def communicator(spec: GroupSpec, device: torch.device, timeout_s: float, store: Any = None) -> Communicator:
    """This rank's communicator of the group ``spec`` describes (gloo, or NCCL through CuPy)."""
    if spec.backend == "nccl":
        from weightsync.mechanisms.nccl import NcclCommunicator

        assert spec.nccl_id is not None
        return NcclCommunicator(spec.nccl_id, spec.rank, spec.world_size, device, timeout_s, spec.members)
    return GlooCommunicator(
        spec.store_host,
        spec.store_port,
        spec.rank,
        spec.world_size,
        spec.name,
        timeout_s,
        bind_host=spec.bind_host or spec.store_host,
        store=store,
    )


def addresses(opening: Opening, server: str | None = None) -> dict[str, str]:
    """The address each party of the group ``server`` (by default the opening's) forms with
    the members listens on: 127.0.0.1 for all when every member is on the serving party's
    node, else each party's own node address as Ray reports it."""
    names = (server or opening.server, *opening.members)
    nodes = {name: opening.info(name).node_ip for name in names}
    if len(set(nodes.values())) == 1:
        return dict.fromkeys(names, "127.0.0.1")
    return nodes


def open_broadcast(opening: Opening) -> None:
    """Form one group: the serving party is rank 0, the members ranks 1.. in order."""
    me, members = opening.server, opening.members
    world = len(members) + 1
    info = opening.info(me)
    backend = opening.options.get("backend") or ("nccl" if info.device == "cuda" else "gloo")
    listen = addresses(opening)
    host, port = opening.step({me: Request(action="store", args=(world, listen[me]))}, "opening the rendezvous store")[
        me
    ]
    if host != "127.0.0.1":
        log.info(
            "broadcast rendezvous of %s listens on %s:%d, the address Ray reports for its node, because %s "
            "are on other nodes",
            me,
            host,
            port,
            ", ".join(m for m in members if listen[m] != host),
        )
    nccl_id = None
    if backend == "nccl":
        nccl_id = opening.step({me: Request(action="nccl id")}, "making the NCCL id")[me]
    names = (me, *members)
    # The store's key prefix: unguessable, so a process that reaches the store cannot find
    # or overwrite the group's keys.
    group = f"weightsync-{secrets.token_hex(16)}"

    def spec(rank: int) -> GroupSpec:
        return GroupSpec(
            name=group,
            store_host=host,
            store_port=port,
            bind_host=listen[names[rank]],
            rank=rank,
            world_size=world,
            backend=backend,
            nccl_id=nccl_id,
            members=names,
        )

    requests = {name: Request(action="join", args=(spec(rank),)) for rank, name in enumerate(names)}
    opening.step(requests, "forming the broadcast group")


def rendezvous_store(side: TrainerSide, world_size: int, host: str) -> tuple[str, int]:
    store = open_store(host, 0, world_size, side.session.timeout_s)
    side.extras["store"] = store
    return host, int(store.port)


def nccl_unique_id(side: TrainerSide) -> bytes:
    from weightsync.mechanisms.nccl import make_unique_id

    return make_unique_id()


def _join_trainer(side: TrainerSide, spec: GroupSpec) -> None:
    comm = communicator(spec, side.device, side.session.timeout_s, side.extras.pop("store", None))
    side.install(BroadcastSender(comm, side.session, spec.members))


def _join_worker(side: WorkerSide, spec: GroupSpec) -> None:
    comm = communicator(spec, side.device, side.session.timeout_s)
    side.install(BroadcastReceiver(comm, side.session, spec.members))


def fits(trainer: EndpointInfo, worker: EndpointInfo, name: str) -> str | None:
    if trainer.device == "cuda" and same_device(trainer, worker):
        return (
            f"shares GPU {trainer.gpu_uuid} with the trainer, and NCCL refuses two ranks on one GPU; "
            "use transport='ipc' or 'direct' (or 'auto')"
        )
    return None


def plan(manifest: Manifest) -> Sequence[Chunk]:
    return manifest.broadcast_chunks


def usable_here() -> list[tuple[str, str | None]]:
    """gloo always; NCCL with a GPU and CuPy able to load NCCL."""
    nccl = gpu_reason()
    if nccl is None:
        try:
            from weightsync.mechanisms.nccl import nccl_version

            if nccl_version() is None:
                nccl = "CuPy cannot load NCCL: pip install nvidia-nccl-cu12 (or -cu13)"
        except ImportError:
            nccl = "CuPy is not installed (GPU broadcast needs weightsync[cuda12] or [cuda13])"
    return [("broadcast (gloo, CPU)", None), ("broadcast (NCCL)", nccl)]


BROADCAST = Transport(
    name="broadcast",
    open=open_broadcast,
    trainer_actions={"store": rendezvous_store, "nccl id": nccl_unique_id, "join": _join_trainer},
    worker_actions={"join": _join_worker},
    send_half=BroadcastSender,
    receive_half=BroadcastReceiver,
    fits=fits,
    serving=Serving.LEAD,
    auto_rank=30,
    send_order=30,
    plan=plan,
    usable_here=usable_here,
)
