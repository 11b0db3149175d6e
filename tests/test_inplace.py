"""In-place broadcast of large tensors mixed with packed small ones, over a real gloo group.

The ranks are threads of this process, each with its own gloo group member over loopback
(gloo releases the GIL while it moves bytes), so a sync costs milliseconds, not a spawn.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import pytest
import torch
from torch import nn

from tests.helpers import assert_bit_equal, random_tensor
from weightsync import WeightReceiver, WeightSender
from weightsync.core import registry
from weightsync.core.local import open_local
from weightsync.core.packing import tensor_checksums
from weightsync.core.sinks import LoadWeightsSink, ModuleSink
from weightsync.core.wire import ChecksumMismatch, Manifest, ManifestError, SettingsError, SyncCall, SyncSettings
from weightsync.core.wire.outcome import ok
from weightsync.core.wire.sizing import BufferHints, resolve_buffers
from weightsync.mechanisms.gloo import GlooCommunicator, open_store
from weightsync.transports.broadcast.halves import BroadcastReceiver, BroadcastSender

#: name, shape, dtype: bytes >= THRESHOLD go in place, the rest are packed (some split).
LAYOUT = [
    ("embed", (64, 96), torch.bfloat16),  # 12288 bytes: in place
    ("norm0", (96,), torch.float32),
    ("odd", (3, 5), torch.float16),
    ("q", (96, 48), torch.float32),  # 18432: in place
    ("bias", (48,), torch.float32),
    ("mid", (40, 40), torch.float16),  # 3200: packed, larger than the 2 KiB buffer: split
    ("fp8", (4096 + 33,), torch.float8_e4m3fn),  # 4129: in place, odd length
    ("mask", (9, 3), torch.bool),
    ("step", (), torch.int64),
    ("down", (48, 96), torch.float32),  # in place, last
]
THRESHOLD = 4096
SETTINGS = SyncSettings(buffer_bytes=2048, num_buffers=2, inplace_bytes=THRESHOLD)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    return {n: random_tensor(s, d, seed * 100 + i) for i, (n, s, d) in enumerate(LAYOUT)}


class Model(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        for name, t in tensors(seed).items():
            self.register_buffer(name, t.clone())

    def load(self, seed: int) -> None:
        for name, t in tensors(seed).items():
            getattr(self, name).copy_(t)


class Loader:
    """A load_weights callable that keeps copies of what it was handed."""

    def __init__(self) -> None:
        self.got: dict[str, torch.Tensor] = {}

    def __call__(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, t in items:
            self.got[name] = t.clone()


def run_group(
    sender: WeightSender,
    receivers: Sequence[WeightReceiver],
    calls: Sequence[SyncCall],
    between: Callable[[int], None] = lambda i: None,
) -> list[list[Any]]:
    """Open a gloo group of the sender and ``receivers`` (threads), run every call, and
    return per receiver the outcome of each call (a ReceiveResult, or the exception)."""
    manifest = sender.current_manifest
    for r in receivers:
        r.accept(manifest)
    world = len(receivers) + 1
    members = ["trainer", *(r.name for r in receivers)]
    store = open_store("127.0.0.1", 0, world, 30.0)
    results: list[list[Any]] = [[] for _ in receivers]
    sent: list[Any] = []
    barrier = threading.Barrier(world)

    def rank(i: int) -> None:
        if i == 0:
            comm = GlooCommunicator("127.0.0.1", store.port, 0, world, "t", 30.0, store=store)
            sender.install(BroadcastSender(comm, sender.session, members))
        else:
            receiver = receivers[i - 1]
            comm = GlooCommunicator("127.0.0.1", store.port, i, world, "t", 30.0)
            receiver.install(BroadcastReceiver(comm, receiver.session, members))
        for n, call in enumerate(calls):
            if i == 0:
                between(n)
            barrier.wait(60)
            try:
                if i == 0:
                    sent.append(sender.send(call))
                else:
                    results[i - 1].append(receivers[i - 1].receive(call))
            except Exception as exc:
                (sent if i == 0 else results[i - 1]).append(exc)
            barrier.wait(60)

    threads = [threading.Thread(target=rank, args=(i,), daemon=True) for i in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    for r in receivers:
        r.close_transports()
    sender.close_transports()
    for i, (call, s) in enumerate(zip(calls, sent)):
        assert not isinstance(s, Exception), f"trainer failed sync {i}: {s!r}"
        for r, res in zip(receivers, results):
            if not isinstance(res[i], Exception):
                try:  # broadcast commits in a second step, given both sides' outcomes
                    r.commit(call, ok(r.name, "receive", res[i]), None, ok("trainer", "send", s))
                except Exception as exc:
                    res[i] = exc
    return results


def test_plan_sends_large_tensors_in_place_in_manifest_order() -> None:
    sender = WeightSender(Model(0))
    m = sender.manifest(SETTINGS)
    inplace = [m.specs[c.pieces[0].spec_index].name for c in m.broadcast_chunks if c.inplace]
    assert inplace == ["embed", "q", "fp8", "down"]
    order = [p.spec_index for c in m.broadcast_chunks for p in c.pieces]
    assert order == sorted(order) and sorted(set(order)) == list(range(len(LAYOUT)))
    assert not any(c.inplace for c in m.chunks)  # ipc's plan packs everything
    assert sum(p.nbytes for c in m.chunks for p in c.pieces) == m.total_bytes
    off = sender.manifest(SETTINGS.with_overrides(inplace_bytes=0))
    assert off.broadcast_chunks == off.chunks


def test_mixed_in_place_and_packed_bit_exact_into_modules_and_load_weights() -> None:
    model = Model(0)
    sender = WeightSender(model)
    sender.manifest(SETTINGS)
    loader, views = Loader(), Loader()
    receivers = [
        WeightReceiver(Model(50), name="module"),
        WeightReceiver(LoadWeightsSink(loader, copies_immediately=False), name="loader"),
        WeightReceiver(LoadWeightsSink(views, copies_immediately=True), name="views"),
    ]
    seeds = [1, 2]
    calls = [SyncCall(seq=i, version=i + 1, verify=(i == 1)) for i in range(len(seeds))]
    results = run_group(sender, receivers, calls, between=lambda i: model.load(seeds[i]))
    for res in results:
        assert not any(isinstance(r, Exception) for r in res), res
    want = tensors(seeds[-1])
    held = dict(receivers[0].sink.module.named_buffers())  # type: ignore[attr-defined]
    for name, t in want.items():
        assert_bit_equal(held[name], t, name)
        assert_bit_equal(loader.got[name], t, name)
        assert_bit_equal(views.got[name], t, name)
    assert receivers[0].version == 2 and receivers[1].version == 2


class OddLanding(ModuleSink):
    """A sink whose destinations are not plain: one strided, one of another dtype."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.q64 = torch.zeros(96, 48, dtype=torch.float64)

    def destinations(self, manifest: Manifest) -> list[torch.Tensor | None]:
        dests = super().destinations(manifest)
        dests[manifest.names.index("q")] = self.q64  # received fp32 bytes must never land raw here
        return dests

    def checksums(self, manifest: Manifest) -> list[int]:
        """What it holds: ``q`` lives in ``q64`` (verify reads the destinations back)."""
        sums = super().checksums(manifest)
        sums[manifest.names.index("q")] = tensor_checksums([self.q64.float()])[0]
        return sums


def test_strided_and_other_dtype_destinations_fall_back_bit_exact() -> None:
    model = Model(0)
    sender = WeightSender(model)
    sender.manifest(SETTINGS)
    worker = Model(60)
    # "down" becomes a strided tensor of the same shape: not a valid in-place target.
    worker.down = torch.zeros(96, 48).t()
    assert not worker.down.is_contiguous()
    landing = OddLanding(worker)
    [res] = run_group(
        sender,
        [WeightReceiver(landing, name="odd")],
        [SyncCall(seq=0, version=1, verify=True)],
        between=lambda i: model.load(3),
    )
    assert not isinstance(res[0], Exception), res[0]
    want = tensors(3)
    assert_bit_equal(worker.down, want["down"], "down")
    assert worker.down.stride() == (1, 48)  # still the worker's own strided tensor
    assert torch.equal(landing.q64, want["q"].double())  # unpacked from scratch with the declared copy
    assert_bit_equal(worker.embed, want["embed"], "embed")


def test_trainer_sends_a_strided_tensor_through_a_temporary() -> None:
    model = Model(0)
    model.down = torch.zeros(96, 48).t()  # strided source
    model.down.copy_(tensors(4)["down"])
    sender = WeightSender(model)
    sender.manifest(SETTINGS)
    worker = Model(70)
    [res] = run_group(sender, [WeightReceiver(worker, name="w")], [SyncCall(seq=0, version=1, verify=True)])
    assert not isinstance(res[0], Exception), res[0]
    assert_bit_equal(worker.down, tensors(4)["down"], "down")
    assert_bit_equal(worker.q, tensors(0)["q"], "q")


def test_more_in_place_operations_in_flight_than_buffers_with_temporaries_stay_bit_exact() -> None:
    """Four in-place operations in flight over one buffer (INPLACE_DEPTH > num_buffers), every
    in-place source strided, so each goes through a temporary, which num_buffers bounds."""
    model = Model(0)
    for name in ("embed", "q", "down"):
        shape = dict((n, s) for n, s, _ in LAYOUT)[name]
        strided = torch.zeros(shape[::-1], dtype=getattr(model, name).dtype).t()
        strided.copy_(getattr(model, name))
        setattr(model, name, strided)
    settings = SyncSettings(buffer_bytes=2048, num_buffers=1, inplace_bytes=THRESHOLD)
    sender = WeightSender(model)
    manifest = sender.manifest(settings)
    assert manifest.inplace_count == 4  # embed, q, fp8, down
    workers = [Model(80), Model(81)]
    calls = [SyncCall(seq=0, version=1, verify=True), SyncCall(seq=1, version=2)]

    def between(n: int) -> None:
        if n == 1:
            for name, t in tensors(6).items():
                getattr(model, name).copy_(t)

    results = run_group(sender, [WeightReceiver(w, name=f"w{i}") for i, w in enumerate(workers)], calls, between)
    for worker, res in zip(workers, results):
        assert not any(isinstance(r, Exception) for r in res), res
        for name, t in tensors(6).items():
            assert_bit_equal(getattr(worker, name), t, name)


def test_verify_catches_a_corrupted_in_place_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flip a bit of an in-place tensor after it landed: the chunk checksums must differ."""
    from weightsync.transports.broadcast import receiver as broadcast

    model = Model(0)
    sender = WeightSender(model)
    sender.manifest(SETTINGS)
    worker = Model(80)
    original = broadcast.contiguous_checksum
    corrupted: list[str] = []

    def corrupt_then_sum(t: torch.Tensor) -> int:
        if t.data_ptr() == worker.q.data_ptr() and not corrupted:
            worker.q.view(torch.int32)[0, 0] ^= 1
            corrupted.append("q")
        return original(t)

    monkeypatch.setattr(broadcast, "contiguous_checksum", corrupt_then_sum)
    [res] = run_group(sender, [WeightReceiver(worker, name="w")], [SyncCall(seq=0, version=1, verify=True)])
    assert corrupted == ["q"]
    assert isinstance(res[0], ChecksumMismatch), res[0]
    assert "w" in str(res[0]) and "chunk" in str(res[0])


def test_tampered_threshold_or_plan_is_refused_naming_the_setting() -> None:
    m = WeightSender(Model(0)).manifest(SETTINGS)
    import dataclasses

    def tampered(**fields: Any) -> Manifest:
        """``m`` with agreed settings changed in transit (unpickled: no checks ran)."""
        agreed = dataclasses.replace(m.agreed)
        for name, value in fields.items():
            object.__setattr__(agreed, name, value)
        return dataclasses.replace(m, agreed=agreed)

    other = tampered(inplace_bytes=THRESHOLD * 4)
    with pytest.raises(ManifestError, match="inplace_bytes"):
        other.validate()
    flipped = tuple(dataclasses.replace(c, inplace=False) if c.inplace else c for c in m.broadcast_chunks)
    with pytest.raises(ManifestError, match="broadcast plan"):
        dataclasses.replace(m, broadcast_chunks=flipped).validate()
    with pytest.raises(ManifestError, match="inplace_bytes"):
        tampered(inplace_bytes=-1).validate()
    with pytest.raises(ManifestError, match="inplace_bytes: trainer uses 4096, w was configured with 0"):
        m.check_buffer_expectations("w", inplace_bytes=0)
    with pytest.raises(SettingsError, match="inplace_bytes"):
        SyncSettings(inplace_bytes=-5)


@pytest.mark.parametrize("bad", [0, -256, 1000, 2.5, "big", True, None])
def test_bad_buffer_bytes_are_refused_naming_the_field(bad: object) -> None:
    if bad is None:
        assert SyncSettings().buffer_bytes == "auto"
        return
    with pytest.raises(SettingsError, match="buffer_bytes.*auto"):
        SyncSettings(buffer_bytes=bad)  # type: ignore[arg-type]


def test_auto_size_is_what_the_model_needs_capped_by_knee_and_free_memory() -> None:
    specs = WeightSender(Model(0)).specs()
    needed, count = resolve_buffers("auto", specs, 2, 256, BufferHints(device="cpu"))
    assert needed % 256 == 0 and sum(s.nbytes for s in specs) <= needed < sum(s.nbytes for s in specs) + 256 * 11
    assert count == 2
    tight, _ = resolve_buffers("auto", specs, 2, 256, BufferHints(device="cpu", free_bytes=(10**9, 8 * 4096)))
    assert tight == 4096  # a quarter of the smallest free memory, over two buffers
    assert tight < max(s.nbytes for s in specs)
    assert resolve_buffers(8192, specs, 2, 256, BufferHints(device="cpu", free_bytes=(1,))) == (8192, 2)


def _pair_sync(sender: WeightSender, receiver: WeightReceiver, call: SyncCall) -> Any:
    """Run one colocated sync: the trainer's send and the worker's receive side by side."""
    got: list[Any] = []
    worker = threading.Thread(target=lambda: got.append(receiver.receive(call)), daemon=True)
    worker.start()
    sender.send(call)
    worker.join(60)
    assert got, "the worker did not finish"
    return got[0]


def test_auto_buffers_smaller_than_a_tensor_sync_bit_exact_over_every_transport(no_shm_leftovers: None) -> None:
    """Free memory so tight that "auto" picks 4 KiB buffers: "q" (18 KiB) and "down" do not
    fit one, so ipc splits them, broadcast sends them in place, direct never packs."""
    model = Model(0)
    sender = WeightSender(model)
    hints = BufferHints(device="cpu", free_bytes=(8 * 4096,))
    m = sender.manifest(SyncSettings(inplace_bytes=16384), hints)
    assert m.agreed.buffer_bytes == 4096 and max(s.nbytes for s in m.specs) > m.agreed.buffer_bytes
    assert any(len({p.spec_index for p in c.pieces}) == 1 and c.nbytes == 4096 for c in m.chunks)  # split in ipc
    want = tensors(5)
    # broadcast: "q" and "down" in place, "embed" (12 KiB) split across packed chunks
    worker_b = Model(90)
    [res] = run_group(
        sender,
        [WeightReceiver(worker_b, name="b")],
        [SyncCall(seq=0, version=1, verify=True)],
        between=lambda i: model.load(5),
    )
    assert not isinstance(res[0], Exception), res[0]
    # ipc, into a load_weights sink, then direct, into a module
    loader = Loader()
    ipc = WeightReceiver(LoadWeightsSink(loader), name="i")
    ipc.accept(m)
    open_local(registry.get("ipc"), sender, {"i": ipc})
    _pair_sync(sender, ipc, SyncCall(seq=0, version=1, targets={"ipc": ("i",)}))
    sender.close_transports()
    ipc.close_transports()
    worker_d = Model(91)
    direct = WeightReceiver(worker_d, name="d")
    direct.accept(m)
    open_local(registry.get("direct"), sender, {"d": direct})
    _pair_sync(sender, direct, SyncCall(seq=0, version=1, targets={"direct": ("d",)}))
    sender.close_transports()
    direct.close_transports()
    for name, t in want.items():
        assert_bit_equal(getattr(worker_b, name), t, name)
        assert_bit_equal(loader.got[name], t, name)
        assert_bit_equal(getattr(worker_d, name), t, name)


class _Recording:
    """Rank 0 of a real one-rank NCCL group that also keeps a copy of every operation's
    bytes, taken on the stream the operation ran on (so after it)."""

    def __init__(self, nccl: Any) -> None:
        self.nccl, self.rank, self.world_size, self.device = nccl, 0, 1, nccl.device
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, src: int, stream_pointer: int) -> Any:
        work = self.nccl.broadcast(tensor, src, stream_pointer)
        self.sent.append(tensor.clone())
        return work

    def agree(self, refuse: bool, deadline: float) -> list[int]:
        return list(self.nccl.agree(refuse, deadline))

    def abort(self) -> None:
        self.nccl.abort()

    def close(self) -> None:
        pass


class _Feeding(_Recording):
    """A receiving rank of two: each operation's target is filled with what rank 0 sent in
    that operation, then the real one-rank NCCL broadcast runs on it, on the same stream."""

    def __init__(self, nccl: Any, sent: list[torch.Tensor]) -> None:
        super().__init__(nccl)
        self.rank, self.world_size, self.feed, self.targets = 1, 2, list(sent), []  # type: ignore[var-annotated]

    def broadcast(self, tensor: torch.Tensor, src: int, stream_pointer: int) -> Any:
        chunk = self.feed.pop(0)
        assert tensor.numel() == chunk.numel() and tensor.dtype == torch.uint8 and tensor.device == self.device
        assert torch.cuda.current_stream(self.device).cuda_stream == stream_pointer
        tensor.copy_(chunk)
        self.targets.append(tensor.data_ptr())
        return self.nccl.broadcast(tensor, src, stream_pointer)


@pytest.mark.cuda
def test_nccl_in_place_and_packed_broadcast_on_cuda_streams_over_a_world_of_one() -> None:
    """The broadcast halves on CUDA tensors over a real one-rank NCCL group: in-place
    operations come from the trainer's own storage and land in the worker's own parameters
    (or, for a load_weights sink, in the scratch buffer), checksums agree, bit-exact."""
    from weightsync.mechanisms.nccl import NcclCommunicator, make_unique_id

    device = torch.device("cuda", 0)
    nccl = NcclCommunicator(make_unique_id(), 0, 1, device, 60.0)
    try:
        model = Model(0).to(device)
        model.load(6)
        sender = WeightSender(model, device=device)
        manifest = sender.manifest(SETTINGS)
        recording = _Recording(nccl)
        sender.install(BroadcastSender(recording, sender.session, ["trainer"]))
        call = SyncCall(seq=0, version=1, verify=True)
        sent = sender.send(call)
        assert len(recording.sent) == len(manifest.broadcast_chunks)
        inplace = [i for i, c in enumerate(manifest.broadcast_chunks) if c.inplace]
        want = tensors(6)
        for worker_sink in ("module", "load_weights"):
            worker = Model(7).to(device)
            loader = Loader()
            sink = ModuleSink(worker) if worker_sink == "module" else LoadWeightsSink(loader)
            receiver = WeightReceiver(sink, device=device, name="w")
            receiver.accept(manifest)
            feeding = _Feeding(nccl, recording.sent)
            receiver.install(BroadcastReceiver(feeding, receiver.session, ["trainer", "w"]))
            got = receiver.receive(call)
            assert got.checksums == sent.checksums["broadcast"]
            receiver.commit(call, ok("w", "receive", got), None, ok("trainer", "send", sent))
            assert receiver.version == 1
            held = dict(worker.named_buffers()) if worker_sink == "module" else loader.got
            for name, t in want.items():
                assert_bit_equal(held[name].cpu(), t, name)
            if worker_sink == "module":
                landed = {feeding.targets[i] for i in inplace}
                names = [manifest.specs[manifest.broadcast_chunks[i].pieces[0].spec_index].name for i in inplace]
                assert landed == {getattr(worker, n).data_ptr() for n in names}  # straight into the parameters
            receiver.close_transports()
        sender.halves["broadcast"].close()
    finally:
        nccl.close()


def test_in_place_broadcast_through_ray_with_auto_buffers_and_a_pinned_threshold(actors: Any) -> None:
    """The product path: WeightSync over Ray, default ("auto") buffers, a threshold that
    sends the policy's large tensors in place, verify on; then a worker pinned to another
    threshold is refused at setup, naming the setting."""
    import ray

    from weightsync import SetupError, TrainerActor, WeightSync, WorkerActor
    from weightsync.tools.models import PolicyFactory, train_step

    def get(ref: Any) -> Any:
        return ray.get(ref, timeout=120)

    def state(model: nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    trainer = actors.add(TrainerActor.options(num_cpus=0).remote(PolicyFactory("1mb", seed=0)))
    workers = [actors.add(WorkerActor.options(num_cpus=0).remote(PolicyFactory("1mb", seed=i + 1))) for i in range(2)]
    with WeightSync(trainer, workers, transport="broadcast", inplace_bytes=65536, verify=True) as ws:
        assert ws.manifest is not None and ws.manifest.inplace_count > 0
        for step in (1, 2):
            get(trainer.call.remote(train_step, step))
            report = ws.sync(step)
            assert report.inplace == ws.manifest.inplace_count and report.verified
            expected = get(trainer.call.remote(state))
            for worker in workers:
                got = get(worker.call.remote(state))
                for name, t in expected.items():
                    assert_bit_equal(got[name], t, name)
    pinned = actors.add(WorkerActor.options(num_cpus=0).remote(PolicyFactory("1mb", seed=3), expect_inplace_bytes=0))
    with pytest.raises(SetupError, match="inplace_bytes"):
        WeightSync(trainer, [pinned], transport="broadcast", inplace_bytes=65536).setup()
