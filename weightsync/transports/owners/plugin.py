"""The owners plug-in: a sharded trainer's ranks each send the bytes they hold (owner sends).

For workers on other devices or nodes, as broadcast serves them, but with no gather: rank
``r`` broadcasts only its rows of each bucket, in a group of its own with the workers, and
each worker assembles the R pieces in place (halves: :mod:`weightsync.transports.owners.halves`).
``transport="auto"`` picks it over broadcast for a sharded trainer whose every tensor is
``Shard(0)`` over a 1-D mesh, ``Replicate`` or plain (FSDP2's layout); any other layout
keeps broadcast, which gathers.

Setup, run by the coordinator once, with every rank among the servers::

    placements  every rank says how it holds each tensor (rows or whole); they must agree
    stores      every rank opens the rendezvous store of its own group
    nccl ids    on GPUs: every rank makes its group's NCCL id
    join        every party at once: rank r joins group r as its rank 0; each worker joins
                groups 0..R-1 in order, as rank 1..N of each

Per sync every rank drives it before any transport that gathers (``send_order`` 5), so the
owner groups never wait on the ranks' own collectives.
"""

from __future__ import annotations

import secrets

from weightsync.core.owned_plan import OwnedLayout, agreed_layout, placements
from weightsync.core.plugin import Opening, Request, Serving, TrainerSide, Transport, WorkerSide
from weightsync.core.wire.messages import EndpointInfo
from weightsync.transports.broadcast.messages import GroupSpec
from weightsync.transports.broadcast.plugin import addresses, communicator, nccl_unique_id, rendezvous_store
from weightsync.transports.broadcast.plugin import fits as broadcast_fits
from weightsync.transports.broadcast.plugin import plan as broadcast_plan
from weightsync.transports.owners.halves import KIND, OwnedReceiver, OwnedSender


def open_owned(opening: Opening) -> None:
    ranks, members = opening.servers, opening.members
    layout = agreed_layout(opening, "broadcast")
    world = len(members) + 1
    backend = opening.options.get("backend") or ("nccl" if opening.info(ranks[0]).device == "cuda" else "gloo")
    listen = {r: addresses(opening, r) for r in ranks}
    stores = opening.step(
        {r: Request(action="store", args=(world, listen[r][r])) for r in ranks},
        "opening the owner groups' rendezvous stores",
    )
    ids: dict[str, bytes | None] = dict.fromkeys(ranks)
    if backend == "nccl":
        ids.update(opening.step({r: Request(action="nccl id") for r in ranks}, "making the owner groups' NCCL ids"))

    # Each group's key prefix in its store: unguessable, as for broadcast.
    tags = [secrets.token_hex(16) for _ in ranks]

    def spec(r: int, rank: int) -> GroupSpec:
        host, port = stores[ranks[r]]
        parties = (ranks[r], *members)
        return GroupSpec(
            name=f"weightsync-{tags[r]}",
            store_host=host,
            store_port=port,
            bind_host=listen[ranks[r]][parties[rank]],
            rank=rank,
            world_size=world,
            backend=backend,
            nccl_id=ids[ranks[r]],
            members=(ranks[r], *members),
        )

    requests = {name: Request(action="join", args=(spec(r, 0), layout, r)) for r, name in enumerate(ranks)}
    for w, name in enumerate(members, start=1):
        requests[name] = Request(action="join", args=(tuple(spec(r, w) for r in range(len(ranks))), layout))
    opening.step(requests, "forming the owner groups")


def _join_trainer(side: TrainerSide, spec: GroupSpec, layout: OwnedLayout, rank: int) -> None:
    comm = communicator(spec, side.device, side.session.timeout_s, side.extras.pop("store", None))
    side.install(OwnedSender(comm, side.session, spec.members, layout, rank))


def _join_worker(side: WorkerSide, specs: tuple[GroupSpec, ...], layout: OwnedLayout) -> None:
    comms = []
    try:
        for spec in specs:
            comms.append(communicator(spec, side.device, side.session.timeout_s))
    except BaseException:
        for comm in comms:
            comm.abort()
        raise
    side.install(OwnedReceiver(comms, side.session, [s.members for s in specs], layout))


def fits(trainer: EndpointInfo, worker: EndpointInfo, name: str) -> str | None:
    if trainer.shards == "none":
        return "the trainer is not sharded (owner sends need the ranks of a DTensor trainer); use 'broadcast'"
    if trainer.shards != "owned":
        return (
            "the trainer's layout is not Shard(0) over a 1-D mesh, Replicate or plain for every tensor, so its "
            "ranks cannot send what they hold; use 'broadcast' (it gathers)"
        )
    return broadcast_fits(trainer, worker, name)


OWNERS = Transport(
    name=KIND,
    open=open_owned,
    trainer_actions={
        "placements": placements,
        "store": rendezvous_store,
        "nccl id": nccl_unique_id,
        "join": _join_trainer,
    },
    worker_actions={"join": _join_worker},
    send_half=OwnedSender,
    receive_half=OwnedReceiver,
    fits=fits,
    serving=Serving.EVERY,
    auto_rank=25,
    send_order=5,
    plan=broadcast_plan,
)
