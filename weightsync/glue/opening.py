"""Opening each transport at setup: the steps between describing the parties and the first sync.

Each function runs its transport's setup steps through ``step(calls, when)``, the
coordinator's way of submitting calls and waiting for every outcome (raising SetupError
naming each failure). Call order, from ``WeightSync.setup``::

    open_broadcast   trainer opens the rendezvous store (and the NCCL id); every rank joins
    open_ipc         trainer exports slots; each worker attaches; trainer seals
    open_direct      each worker exports its tensors; trainer maps them; workers seal
    open_push        push mode: each direct worker starts its listener; trainer attaches; seal
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from weightsync.core.wire.messages import EndpointInfo, GroupSpec
from weightsync.core.wire.outcome import Outcome
from weightsync.core.wire.settings import SyncSettings

Calls = dict[tuple[str, str], Any]
Step = Callable[[Calls, str], Mapping[str, Outcome]]
Members = Sequence[tuple[str, Any]]
#: (party name, actor handle) of the trainer, or of the trainer rank serving the members
Party = tuple[str, Any]


def open_broadcast(
    step: Step, party: Party, info: EndpointInfo, members: Members, settings: SyncSettings, backend: str | None
) -> None:
    """Form one broadcast group: the trainer (rank 0 of a sharded one) is rank 0, ``members``
    ranks 1.. in order."""
    if not members:
        return
    me, trainer = party
    world = len(members) + 1
    chosen = backend or ("nccl" if info.device == "cuda" else "gloo")
    timeout = settings.timeout_s
    host, port = step(
        {(me, "store"): trainer.ws_open_store.remote(world, timeout, info.node_ip)},
        "opening the rendezvous store",
    )[me].value
    nccl_id = None
    if chosen == "nccl":
        nccl_id = step({(me, "nccl id"): trainer.ws_nccl_id.remote()}, "making the NCCL id")[me].value
    group = f"weightsync-{uuid.uuid4().hex[:8]}"
    names = (me, *(name for name, _ in members))

    def spec(rank: int) -> GroupSpec:
        return GroupSpec(
            name=group,
            store_host=host,
            store_port=port,
            rank=rank,
            world_size=world,
            timeout_s=timeout,
            backend=chosen,
            nccl_id=nccl_id,
        )

    calls: Calls = {(me, "join"): trainer.ws_join_broadcast.remote(spec(0), names)}
    for rank, (name, handle) in enumerate(members, start=1):
        calls[(name, "join")] = handle.ws_join_broadcast.remote(spec(rank), names)
    step(calls, "forming the broadcast group")


def open_ipc(step: Step, party: Party, members: Members, settings: SyncSettings) -> None:
    """One slot export for every IPC worker, attached by each, then sealed."""
    if not members:
        return
    me, trainer = party
    timeout = settings.timeout_s
    export = step(
        {(me, "export"): trainer.ws_export_ipc.remote([name for name, _ in members], timeout)},
        "exporting IPC slots",
    )[me].value
    step(
        {(name, "attach"): handle.ws_attach_ipc.remote(export, i, timeout) for i, (name, handle) in enumerate(members)},
        "attaching IPC slots",
    )
    step({(me, "seal"): trainer.ws_seal_ipc.remote()}, "sealing IPC exports")


def open_direct(step: Step, party: Party, members: Members, settings: SyncSettings) -> None:
    """Each worker exports its tensors, the trainer maps the exports, the workers seal."""
    if not members:
        return
    me, trainer = party
    timeout = settings.timeout_s
    exports = step(
        {(name, "export"): handle.ws_export_direct.remote(timeout) for name, handle in members},
        "exporting direct targets",
    )
    step(
        {(me, f"map {name}"): trainer.ws_map_direct.remote(exports[name].value, timeout) for name, _ in members},
        "mapping direct targets",
    )
    step({(name, "seal"): handle.ws_seal_direct.remote() for name, handle in members}, "sealing direct exports")


def open_push(step: Step, party: Party, members: Members, settings: SyncSettings) -> None:
    """Push mode: every direct worker listens, the trainer attaches their mailboxes."""
    if not members:
        return
    me, trainer = party
    timeout = settings.timeout_s
    exports = step(
        {(name, "listen"): handle.ws_listen.remote(timeout) for name, handle in members}, "starting the listeners"
    )
    step(
        {(me, "arm"): trainer.ws_arm.remote([exports[name].value for name, _ in members], timeout)},
        "attaching the listeners' mailboxes",
    )
    step({(name, "seal"): handle.ws_seal_listen.remote() for name, handle in members}, "sealing the mailboxes")
