"""Refuse bad input up front, never hang, never report a version a worker does not hold."""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import replace
from typing import Any

import pytest
import ray
import torch
from torch import nn

from tests.conftest import RAY_TIMEOUT
from tests.helpers import MixedModel, act, assert_bit_equal, perturb, random_tensor, state_of
from tests.test_ray_e2e import LoadingMixedModel, assert_workers_match, get
from weightsync import (
    SetupError,
    SyncError,
    TrainerActor,
    VerificationError,
    WeightReceiver,
    WeightSender,
    WeightSync,
    WorkerActor,
)
from weightsync.core.halves import unpacker_for
from weightsync.core.packing import ChunkUnpacker
from weightsync.core.sinks import module_tensors
from weightsync.core.wire import (
    PROTOCOL_VERSION,
    ExportNotFound,
    ManifestError,
    ShmHandle,
    Status,
    SyncSettings,
    WeightSyncError,
)
from weightsync.core.wire.shm_names import current_scope
from weightsync.glue.actors import WorkerHost
from weightsync.mechanisms.shm import leftover_segments
from weightsync.tools.bench.chunks import ChunkHandle, consume_chunk, pack_chunk
from weightsync.transports.ipc.halves import IpcReceiver, IpcSender


def trainer_of(actors: Any, factory: Any = None, **options: Any) -> Any:
    return actors.add(
        TrainerActor.options(num_cpus=0).remote(factory or functools.partial(MixedModel, seed=0), **options)
    )


def worker_of(actors: Any, factory: Any = None, **options: Any) -> Any:
    return actors.add(
        WorkerActor.options(num_cpus=0).remote(factory or functools.partial(MixedModel, seed=1), **options)
    )


# --- 1. handshake ------------------------------------------------------------------------


class Renamed(MixedModel):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.extra = nn.Parameter(random_tensor((2,), torch.float32, seed))
        del self.after_odd


class Reshaped(MixedModel):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.odd = nn.Parameter(random_tensor((5, 3), torch.float16, seed))
        self.linear.to(torch.bfloat16)


class Empty(nn.Module):
    pass


def test_handshake_names_worker_and_every_mismatched_tensor_before_any_byte_moves(actors: Any) -> None:
    trainer = trainer_of(actors)
    good = worker_of(actors)
    renamed = worker_of(actors, functools.partial(Renamed, seed=2))
    reshaped = worker_of(actors, functools.partial(Reshaped, seed=3))
    before = {name: get(w.call.remote(state_of)) for name, w in (("renamed", renamed), ("reshaped", reshaped))}
    ws = WeightSync(trainer, {"good": good, "renamed": renamed, "reshaped": reshaped}, transport="broadcast")
    with pytest.raises(SetupError) as info:
        ws.setup()
    text = str(info.value)
    assert "before any byte moved" in text
    assert info.value.culprits == ["renamed", "reshaped"]
    assert info.value.outcomes["renamed"].error == "ManifestError"
    assert "after_odd: sent by the trainer but missing on renamed" in text
    assert "extra: present on renamed but not sent by the trainer" in text
    assert "odd: shape [3, 5] on the trainer, [5, 3] on reshaped" in text
    assert "linear.weight: dtype float32 on the trainer, bfloat16 on reshaped" in text
    assert "good" not in text.replace("goods", "")
    for name, w in (("renamed", renamed), ("reshaped", reshaped)):
        after = get(w.call.remote(state_of))
        for key in before[name]:
            assert_bit_equal(after[key], before[name][key], key)
    # Nothing was left waiting: the good worker alone syncs at once.
    ws.remove_worker("renamed")
    ws.remove_worker("reshaped")
    get(trainer.call.remote(perturb, 4))
    ws.sync(1)
    assert_workers_match(trainer, [good])
    ws.close()


def test_handshake_refuses_differing_buffer_settings_by_name(actors: Any) -> None:
    trainer = trainer_of(actors)
    pinned = worker_of(actors, expect_buffer_bytes=1 << 20, expect_num_buffers=3)
    ws = WeightSync(trainer, {"pinned": pinned}, transport="broadcast", buffer_bytes=1 << 16, num_buffers=2)
    with pytest.raises(
        SetupError,
        match=r"pinned.*buffer_bytes: trainer uses 65536, pinned was configured with 1048576; num_buffers: trainer uses 2, pinned was configured with 3",
    ):
        ws.setup()
    ws.close()


def test_empty_model_is_refused_at_setup(actors: Any) -> None:
    trainer = trainer_of(actors, Empty)
    worker = worker_of(actors, Empty)
    with pytest.raises(SetupError, match="no parameters or buffers to sync"):
        WeightSync(trainer, [worker]).setup()


def test_protocol_version_and_tampered_manifest_are_refused_by_the_receiver() -> None:
    receiver = WeightReceiver(MixedModel(seed=1), name="worker-7")
    good = WeightSender(MixedModel(seed=0)).manifest(SyncSettings(buffer_bytes=4096))
    future = replace(good, protocol_version=PROTOCOL_VERSION + 1)
    with pytest.raises(ManifestError, match="protocol version mismatch"):
        receiver.accept(future)
    with pytest.raises(ManifestError, match="expected a Manifest, got dict"):
        receiver.accept({"specs": []})  # type: ignore[arg-type]
    assert receiver.manifest is None


def test_ipc_and_direct_refuse_workers_off_the_trainers_device(actors: Any) -> None:
    ws = WeightSync(trainer_of(actors), [worker_of(actors)], transport="ipc")
    # Pretend the worker lives elsewhere: the coordinator must refuse, naming it.
    from weightsync.core.choice import choose_transport
    from weightsync.core.wire import EndpointInfo, SettingsError

    def where(node: str) -> EndpointInfo:
        return EndpointInfo(
            node_id=node, node_ip="127.0.0.1", hostname="h", pid=1, device="cpu", gpu_uuid=None, sink_allows_direct=True
        )

    w = ws._members.members["worker-0"]
    with pytest.raises(SettingsError, match="worker-0: transport 'ipc' needs the worker on the trainer's device"):
        choose_transport(where("this-node"), where("other-node"), w.requested, w.name)


# --- 2 and 3. timeouts and dead peers ------------------------------------------------------


class CrashingModel(LoadingMixedModel):
    """Dies (os._exit) or stalls inside load_weights when told to, mid-transfer."""

    fault = ""

    def load_weights(self, weights: Any) -> set[str]:
        if self.fault == "exit":
            os._exit(17)
        if self.fault == "stall":
            threading.Event().wait(30)
        return super().load_weights(weights)


def set_fault(model: nn.Module, fault: str) -> None:
    model.fault = fault  # type: ignore[assignment]


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_worker_killed_mid_sync_is_named_dropped_and_the_rest_sync_again(transport: str, actors: Any) -> None:
    trainer = trainer_of(actors)
    healthy = worker_of(actors)
    doomed = worker_of(actors, functools.partial(CrashingModel, seed=2), sink="load_weights")
    ws = WeightSync(
        trainer, {"healthy": healthy, "doomed": doomed}, transport=transport, buffer_bytes=1024, timeout_s=10
    )
    ws.setup()
    get(trainer.call.remote(perturb, 1))
    ws.sync(1)
    get(doomed.call.remote(set_fault, "exit"))
    get(trainer.call.remote(perturb, 2))
    with pytest.raises(SyncError) as info:
        ws.sync(2)
    assert "doomed" in info.value.dead
    assert info.value.outcomes["doomed"].status is Status.DEAD
    assert info.value.culprits == ["doomed"]
    assert "dropped dead worker(s) doomed" in str(info.value)
    assert list(ws.workers) == ["healthy"]
    # The healthy worker holds version 1 or is dirty; it never claims version 2.
    version, state = ws.status()["healthy"]
    assert (version, state) in ((1, "committed"), (1, "dirty"))
    report = ws.sync(3)
    assert [(w.name, w.version) for w in report.workers] == [("healthy", 3)]
    assert_workers_match(trainer, [healthy])
    # A replacement joins and the group is re-formed with it.
    replacement = worker_of(actors, functools.partial(MixedModel, seed=9))
    ws.add_worker(replacement, "replacement")
    get(trainer.call.remote(perturb, 4))
    ws.sync(4)
    assert_workers_match(trainer, [healthy, replacement])
    ws.close()


def test_stuck_worker_times_out_naming_it_and_the_trainer_stays_usable(actors: Any) -> None:
    trainer = trainer_of(actors)
    healthy = worker_of(actors)
    stuck = worker_of(actors, functools.partial(CrashingModel, seed=2), sink="load_weights")
    ws = WeightSync(trainer, {"healthy": healthy, "stuck": stuck}, transport="ipc", buffer_bytes=1024, timeout_s=2)
    ws.setup()
    get(stuck.call.remote(set_fault, "stall"))
    get(trainer.call.remote(perturb, 1))
    with pytest.raises(SyncError) as info:
        ws.sync(1)
    text = str(info.value)
    assert info.value.culprits == ["stuck"], text
    assert info.value.outcomes["stuck"].status is Status.TIMED_OUT
    assert info.value.outcomes["trainer"].error == "TransferTimeout"
    assert info.value.outcomes["trainer"].blames == ("stuck",)
    ws.remove_worker("stuck")
    ray.kill(stuck)
    ws.sync(2)
    assert_workers_match(trainer, [healthy])
    ws.close()


def test_killed_trainer_leaves_every_worker_at_its_last_committed_version(actors: Any) -> None:
    trainer = trainer_of(actors)
    workers = [worker_of(actors), worker_of(actors, functools.partial(MixedModel, seed=2))]
    ws = WeightSync(trainer, workers, transport="broadcast", timeout_s=5)
    get(trainer.call.remote(perturb, 1))
    ws.sync(1)
    held = get(workers[0].call.remote(state_of))
    ray.kill(trainer)
    with pytest.raises((SyncError, WeightSyncError, ray.exceptions.RayActorError)):
        ws.sync(2)
    # Whatever the workers' receive calls saw, none may claim version 2.
    status = ws.status()
    assert {name: version for name, (version, _) in status.items()} == {"worker-0": 1, "worker-1": 1}
    assert {state for _, state in status.values()} <= {"committed", "dirty"}
    now = get(workers[0].call.remote(state_of))
    for name in held:
        assert_bit_equal(now[name], held[name], name)


# --- 4. versions and verification ----------------------------------------------------------


def test_versions_must_increase_unless_forced(actors: Any) -> None:
    trainer = trainer_of(actors)
    worker = worker_of(actors)
    with WeightSync(trainer, [worker], transport="direct") as ws:
        ws.sync(5)
        with pytest.raises(WeightSyncError, match="version 5 is not newer than the last synced version 5"):
            ws.sync(5)
        with pytest.raises(WeightSyncError, match="version 3 is not newer"):
            ws.sync(3)
        assert ws.sync(3, force=True).workers[0].version == 3


class CorruptingWorker(WorkerHost):
    """Fault injection lives here, in the test: flip one bit of a received chunk, once."""

    def corrupt_next(self, chunk_index: int, byte: int) -> None:
        self._corrupt = (chunk_index, byte)

    def ws_receive(self, call: Any) -> Any:
        target = getattr(self, "_corrupt", None)
        if target is None:
            return super().ws_receive(call)
        self._corrupt = None
        original = ChunkUnpacker.unpack

        def unpack(unpacker: ChunkUnpacker, chunk: Any, buffer: torch.Tensor) -> Any:
            if chunk.index == target[0]:
                buffer[target[1]] ^= 1
            return original(unpacker, chunk, buffer)

        ChunkUnpacker.unpack = unpack  # type: ignore[method-assign]
        try:
            return super().ws_receive(call)
        finally:
            ChunkUnpacker.unpack = original  # type: ignore[method-assign]


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_verify_catches_a_flipped_bit_names_worker_and_chunk_and_the_next_sync_repairs(
    transport: str, actors: Any
) -> None:
    trainer = trainer_of(actors)
    clean = worker_of(actors)
    victim = actors.add(ray.remote(CorruptingWorker).options(num_cpus=0).remote(functools.partial(MixedModel, seed=2)))
    ws = WeightSync(trainer, {"clean": clean, "victim": victim}, transport=transport, buffer_bytes=1024, verify=True)
    get(trainer.call.remote(perturb, 1))
    assert ws.sync(1).verified
    get(victim.corrupt_next.remote(chunk_index=1, byte=3))
    get(trainer.call.remote(perturb, 2))
    with pytest.raises(SyncError) as info:
        ws.sync(2)
    text = str(info.value)
    assert "victim: " in text and "chunk 1" in text and "corrupted in transit" in text, text
    assert "victim" in info.value.culprits
    assert info.value.outcomes["victim"].error == "ChecksumMismatch"
    if not info.value.outcomes["clean"].ok:
        # IPC consumers read one shared slot: the flipped bit is really there for the clean
        # worker too, or it was stopped by the victim's abort, naming the cause.
        assert transport == "ipc"
        assert info.value.outcomes["clean"].error in ("PeerAborted", "ChecksumMismatch")
    status = ws.status()
    assert status["victim"] == (1, "dirty")
    # A clean worker the victim's abort stopped before its first byte landed keeps version 1,
    # committed; one stopped mid-copy is dirty.
    stopped = {(1, "committed")} if not info.value.outcomes["clean"].ok else set()
    assert status["clean"] in {(2, "committed"), (1, "dirty"), *stopped}, (status, info.value.outcomes["clean"])
    with pytest.raises(VerificationError, match="victim"):
        ws.verify()
    # The fault was one-shot: the next sync repairs the victim.
    get(trainer.call.remote(perturb, 3))
    ws.sync(3)
    assert ws.status() == {"clean": (3, "committed"), "victim": (3, "committed")}
    assert ws.verify()
    assert_workers_match(trainer, [clean, victim])
    ws.close()


def test_verify_compares_full_digests_and_names_the_worker_that_differs(actors: Any) -> None:
    trainer = trainer_of(actors)
    workers = {"a": worker_of(actors), "b": worker_of(actors, functools.partial(MixedModel, seed=2))}
    with WeightSync(trainer, workers, transport="broadcast") as ws:
        ws.sync(1)
        digest = ws.verify()
        assert len(digest) == 64
        get(workers["b"].call.remote(perturb, 99))
        with pytest.raises(VerificationError) as info:
            ws.verify()
        assert set(info.value.mismatches) == {"b"}
        assert info.value.mismatches["b"] in dict(module_tensors(MixedModel()))


# --- 5. concurrency ------------------------------------------------------------------------


def test_concurrent_syncs_on_one_weightsync_are_serialized(actors: Any) -> None:
    trainer = trainer_of(actors)
    workers = [worker_of(actors), worker_of(actors, functools.partial(MixedModel, seed=2))]
    with WeightSync(trainer, workers, transport={"worker-0": "ipc", "worker-1": "broadcast"}, buffer_bytes=1024) as ws:
        start = threading.Barrier(2)
        outcomes: dict[int, Any] = {}

        def run(version: int) -> None:
            start.wait(timeout=RAY_TIMEOUT)
            try:
                outcomes[version] = ws.sync(version)
            except WeightSyncError as exc:
                outcomes[version] = exc

        threads = [threading.Thread(target=run, args=(v,)) for v in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=RAY_TIMEOUT)
        assert outcomes[2].version == 2
        # Version 1 either ran first, or was refused as older: never interleaved.
        assert getattr(outcomes[1], "version", None) == 1 or "not newer" in str(outcomes[1])
        assert ws.status() == {"worker-0": (2, "committed"), "worker-1": (2, "committed")}
        assert_workers_match(trainer, workers)


# --- 6. hygiene ----------------------------------------------------------------------------


def process_usage(model: nn.Module) -> tuple[int, int]:
    """(resident kB, open file descriptors) of the calling process."""
    with open("/proc/self/status") as fh:
        rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS"))
    return rss, len(os.listdir("/proc/self/fd"))


def test_200_syncs_grow_no_host_memory_segments_or_descriptors(actors: Any) -> None:
    trainer = trainer_of(actors)
    workers = {"b": worker_of(actors), "i": worker_of(actors), "d": worker_of(actors)}
    with WeightSync(trainer, workers, transport={"b": "broadcast", "i": "ipc", "d": "direct"}, buffer_bytes=2048) as ws:
        for version in range(1, 21):
            ws.sync(version)
        segments = leftover_segments(scope=current_scope())
        before = {n: get(h.call.remote(process_usage)) for n, h in [("trainer", trainer), *workers.items()]}
        for version in range(21, 201):
            ws.sync(version)
        after = {n: get(h.call.remote(process_usage)) for n, h in [("trainer", trainer), *workers.items()]}
        assert leftover_segments(scope=current_scope()) == segments == []
        for name in before:
            (rss0, fds0), (rss1, fds1) = before[name], after[name]
            # A descriptor per sync would add 180; Ray's own connections in the actor's
            # process come and go by one or two on a loaded machine (seen: 44 -> 45, 51 -> 52).
            assert fds1 <= fds0 + 4, f"{name}: open descriptors grew {fds0} -> {fds1} over 180 syncs"
            assert rss1 - rss0 < 16 * 1024, f"{name}: resident memory grew {rss0} -> {rss1} kB"
        assert_workers_match(trainer, list(workers.values()))


# --- 8. hostile metadata ---------------------------------------------------------------------


def ipc_pair(buffer_bytes: int = 1024) -> tuple[WeightSender, WeightReceiver, MixedModel]:
    sender = WeightSender(MixedModel(seed=0))
    manifest = sender.manifest(SyncSettings(buffer_bytes=buffer_bytes))
    target = MixedModel(seed=1)
    receiver = WeightReceiver(target, name="worker-h")
    receiver.accept(manifest)
    act(receiver, "ipc", "attach", act(sender, "ipc", "export", ("worker-h",)), 0)
    return sender, receiver, target


def pack(sender: WeightSender, chunk: int, slot: int) -> ChunkHandle:
    """The per-chunk IPC hand-off on the trainer's side."""
    ipc = sender.half("ipc")
    assert isinstance(ipc, IpcSender)
    return pack_chunk(ipc, chunk, slot, sender.sources())


def consume(receiver: WeightReceiver, handle: ChunkHandle, unpacker: ChunkUnpacker | None = None) -> None:
    """The per-chunk IPC hand-off on the worker's side."""
    ipc = receiver.half("ipc")
    assert isinstance(ipc, IpcReceiver) and receiver.manifest is not None
    consume_chunk(ipc, handle, unpacker or unpacker_for(receiver.manifest, receiver.sink), receiver.sink.consume)


def test_hostile_chunk_handles_are_refused_and_nothing_is_written(no_shm_leftovers: None) -> None:
    sender, receiver, target = ipc_pair()
    before = state_of(target)
    good = pack(sender, 0, 0)
    n = len(sender.current_manifest.chunks)
    cases = [
        (replace(good, chunk_index=n + 3), f"chunk index {n + 3} out of range"),
        (replace(good, chunk_index=-1), "chunk index -1 out of range"),
        (replace(good, slot=7), "slot 7 out of range"),
        (replace(good, session="0123456789abcdef"), "handle from a previous session"),
        (replace(good, nbytes=good.nbytes + 1), "handle says"),
    ]
    for handle, message in cases:
        with pytest.raises(WeightSyncError, match=message):
            consume(receiver, handle)
        after = state_of(target)
        for name in before:
            assert_bit_equal(after[name], before[name], name)
    consume(receiver, good)
    assert not torch.equal(state_of(target)["odd"], before["odd"])
    receiver.close_transports()
    sender.close_transports()


def test_exports_from_a_closed_session_or_another_host_are_refused(no_shm_leftovers: None) -> None:
    sender, receiver, _ = ipc_pair()
    export = sender.half("ipc")._export  # type: ignore[union-attr]
    receiver.close_transports()
    sender.close_transports()
    late = WeightReceiver(MixedModel(seed=2), name="late")
    late.accept(sender.current_manifest)
    with pytest.raises(ExportNotFound, match="does not exist: it was closed, or belongs to a previous session"):
        act(late, "ipc", "attach", export, 0)
    path = "/dev/shm/weightsync-1-1-0-0123456789abcdef-slots"
    foreign = ShmHandle(path=path, nbytes=16, hostname="another-host", session="s")
    from weightsync.mechanisms.shm import map_shm

    with pytest.raises(ExportNotFound, match="lives on host 'another-host'"):
        map_shm(foreign)


def test_ipc_importer_maps_once_and_releases_once_across_many_chunks(no_shm_leftovers: None) -> None:
    sender, receiver, target = ipc_pair(buffer_bytes=512)
    nchunks = len(sender.current_manifest.chunks)
    assert nchunks > 3
    ipc = receiver.half("ipc")
    assert isinstance(ipc, IpcReceiver)
    for sync in range(3):
        perturb(sender.model, sync)  # type: ignore[arg-type]
        unpacker = unpacker_for(receiver.manifest, receiver.sink)  # type: ignore[arg-type]
        for k in range(nchunks):
            # Consume chunk k before packing chunk k+1 into the reused slot.
            consume(receiver, pack(sender, k, k % 2), unpacker)
        unpacker.finish()
        expected = state_of(sender.model)  # type: ignore[arg-type]
        got = state_of(target)
        for name in expected:
            assert_bit_equal(got[name], expected[name], name)
    assert (ipc.importer.maps, ipc.importer.releases) == (2, 0)
    receiver.close_transports()
    assert (ipc.importer.maps, ipc.importer.releases) == (2, 2)
    sender.close_transports()


def test_unpacker_refuses_a_transfer_that_ends_half_way() -> None:
    sender = WeightSender(MixedModel(seed=0, big=3000))
    m = sender.manifest(SyncSettings(buffer_bytes=1024))
    unpacker = ChunkUnpacker(m.specs, lambda i: None, False)
    buffer = torch.empty(1024, dtype=torch.uint8)
    from weightsync.core.packing import pack_chunk

    split = next(c for c in m.chunks if any(p.nbytes < m.specs[p.spec_index].nbytes for p in c.pieces))
    pack_chunk(split, m.specs, sender.sources(), buffer)
    unpacker.unpack(split, buffer)
    with pytest.raises(ManifestError, match="only partly received: \\['big'\\]"):
        unpacker.finish()
