"""weightsync.packed_tensor: vLLM's packed weight-transfer API, bit-exact over real gloo groups."""

from __future__ import annotations

import multiprocessing as mp
import warnings
from typing import Any

import pytest
import torch

import weightsync
from tests.helpers import assert_bit_equal, random_tensor
from tests.packed_procs import (
    BUFFER,
    LAYOUT,
    Collector,
    Scenario,
    cpu_shims_for_vllm,
    expected_chunks,
    gloo_world,
    metadata,
    mismatched_pair,
    mismatches,
    model,
    post_iter,
    sent,
    shm_ipc_consumer,
)
from weightsync import packed_tensor as pt
from weightsync.compat import packed_ipc
from weightsync.core.wire import DeviceMismatch, UnsupportedDtypeError
from weightsync.core.wire.shm_names import current_scope
from weightsync.mechanisms.shm import leftover_segments

CTX = mp.get_context("spawn")


class Recorder:
    """A group that keeps a copy of everything the producer broadcasts (one process)."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []
        self.aborted = False

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.sent.append(tensor.clone())

    @property
    def chunks(self) -> list[torch.Tensor]:
        """The data chunks (uint8), without the size headers (int64)."""
        return [t for t in self.sent if t.dtype == torch.uint8]

    @property
    def headers(self) -> list[list[int]]:
        return [t.tolist() for t in self.sent if t.dtype == torch.int64]

    def abort(self) -> None:
        self.aborted = True


class Replayer:
    """A group that hands a consumer the broadcasts a Recorder kept, in order.

    By default each receive must be exactly as large as the broadcast it meets (NCCL's rule).
    ``as_gloo`` follows gloo instead: a shorter broadcast fills the start of a larger receive
    and returns; a longer one is where gloo aborts the process (here: ``GlooAbort``).
    """

    def __init__(self, chunks: list[torch.Tensor], as_gloo: bool = False) -> None:
        self.chunks = list(chunks)
        self.as_gloo = as_gloo

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        chunk = self.chunks.pop(0).reshape(-1).view(torch.uint8)
        flat = tensor.reshape(-1).view(torch.uint8)
        if self.as_gloo and chunk.numel() > flat.numel():
            raise GlooAbort(f"a {chunk.numel()}-byte broadcast into a {flat.numel()}-byte receive")
        if not self.as_gloo:
            assert flat.numel() == chunk.numel(), (
                f"consumer chunk of {flat.numel()} bytes, producer sent {chunk.numel()}"
            )
        flat[: chunk.numel()].copy_(chunk)


class GlooAbort(Exception):
    """Where a real gloo receive would abort the process."""


def sizes_of(layout: list[tuple[str, torch.Tensor]]) -> list[int]:
    return [t.numel() * t.element_size() for _, t in layout]


def test_the_reference_modules_public_names_are_all_here() -> None:
    for name in (
        "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
        "DEFAULT_PACKED_NUM_BUFFERS",
        "PackedChunk",
        "pack_tensors",
        "unpack_tensor",
        "packed_nccl_broadcast_producer",
        "packed_nccl_broadcast_consumer",
        "PackedIpcChunk",
        "packed_ipc_producer",
        "PackedBufferImporter",
        "packed_ipc_consumer",
    ):
        assert hasattr(pt, name), name
    assert pt.DEFAULT_PACKED_BUFFER_SIZE_BYTES == 1 << 30 and pt.DEFAULT_PACKED_NUM_BUFFERS == 2
    assert weightsync.pack_tensors is pt.pack_tensors and weightsync.unpack_tensor is pt.unpack_tensor
    assert weightsync.PackedChunk is pt.PackedChunk


@pytest.mark.parametrize("num_buffers", [1, 2, 3])
def test_broadcast_boundaries_follow_the_running_total_rule_and_round_trip(num_buffers: int) -> None:
    recorder = Recorder()
    with pytest.warns(UserWarning) as warned:
        pt.packed_nccl_broadcast_producer(iter(model(1)), recorder, 0, post_iter, BUFFER, num_buffers)
    wire = sent(1)
    oversize = {name for name, t in wire if t.numel() * t.element_size() > BUFFER}
    assert oversize == {"cast_proj", "big", "ids"}
    assert all(any(f"'{name}'" in str(w.message) for w in warned) for name in oversize)
    assert len(warned) == len(oversize)
    chunks = expected_chunks(sizes_of(wire), BUFFER)
    assert len(chunks) >= 5
    assert [c.numel() for c in recorder.chunks] == [sum(sizes_of([wire[i] for i in c])) for c in chunks]
    assert recorder.headers == [], "no size header unless asked for"
    collector = Collector()
    pt.packed_nccl_broadcast_consumer(
        iter(metadata(1)), Replayer(recorder.sent), 0, collector, BUFFER, num_buffers, "cpu"
    )
    assert collector.chunks == [[wire[i][0] for i in c] for c in chunks]
    assert mismatches(collector.tensors, wire) == []


def _recorded(seed: int, size_header: bool = True) -> Recorder:
    recorder = Recorder()
    with pytest.warns(UserWarning):  # the oversize tensors' warnings, tested above
        pt.packed_nccl_broadcast_producer(iter(model(seed)), recorder, 0, post_iter, BUFFER, 2, size_header=size_header)
    return recorder


def test_each_chunk_is_preceded_by_its_size_and_the_stream_by_an_end() -> None:
    recorder = _recorded(2)
    sizes = [c.numel() for c in recorder.chunks]
    counts = [len(c) for c in expected_chunks(sizes_of(sent(2)), BUFFER)]
    assert [h[1:] for h in recorder.headers] == [*([BUFFER, n, k] for n, k in zip(sizes, counts)), [BUFFER, 0, 0]]
    kinds = [t.dtype for t in recorder.sent]
    assert kinds == [torch.int64, torch.uint8] * len(sizes) + [torch.int64], "a header before every chunk"
    collector = Collector()
    pt.packed_nccl_broadcast_consumer(
        iter(metadata(2)), Replayer(recorder.sent, as_gloo=True), 0, collector, BUFFER, 2, "cpu", size_header=True
    )
    assert mismatches(collector.tensors, sent(2)) == []


@pytest.mark.parametrize("factor", [4, 2])
def test_a_consumer_with_a_larger_buffer_raises_naming_both_sizes(factor: int) -> None:
    recorder = _recorded(3)
    collector = Collector()
    with pytest.raises(ValueError, match=rf"buffer_size_bytes={BUFFER}, this consumer's={BUFFER * factor}"):
        pt.packed_nccl_broadcast_consumer(
            iter(metadata(3)),
            Replayer(recorder.sent, as_gloo=True),
            0,
            collector,
            BUFFER * factor,
            2,
            "cpu",
            size_header=True,
        )
    assert collector.chunks == [], "nothing may be handed over from a chunk of the wrong size"


def test_a_consumer_whose_metadata_differs_raises_naming_the_chunk_and_never_receives_it() -> None:
    recorder = _recorded(4)
    meta = metadata(4)
    # One more element in the first chunk's second tensor: same tensor count, 4 bytes more.
    wrong = [(name, ([8] if name == "after_odd" else shape, dtype)) for name, (shape, dtype) in meta]
    collector = Collector()
    replayer = Replayer(recorder.sent, as_gloo=True)
    with pytest.raises(ValueError, match=r"from tensor 'odd_half'.*sent 3 tensors in 85 bytes.*3 tensors in 89 bytes"):
        pt.packed_nccl_broadcast_consumer(iter(wrong), replayer, 0, collector, BUFFER, 2, "cpu", size_header=True)
    assert collector.chunks == []
    assert replayer.chunks[0] is recorder.sent[1], "the mismatching chunk must not be received"


def test_a_consumer_expecting_fewer_or_more_tensors_raises_naming_where() -> None:
    meta = metadata(5)
    with pytest.raises(ValueError, match="sends more than this consumer's metadata lists"):
        pt.packed_nccl_broadcast_consumer(
            iter(meta[:3]),
            Replayer(_recorded(5).sent, as_gloo=True),
            0,
            Collector(),
            BUFFER,
            2,
            "cpu",
            size_header=True,
        )
    short = Recorder()  # a producer that sends only the first chunk's three tensors
    pt.packed_nccl_broadcast_producer(iter(model(5)[:3]), short, 0, post_iter, BUFFER, 2, size_header=True)
    with pytest.raises(ValueError, match=f"the producer ended before tensor '{meta[3][0]}'"):
        pt.packed_nccl_broadcast_consumer(
            iter(meta), Replayer(short.sent, as_gloo=True), 0, Collector(), BUFFER, 2, "cpu", size_header=True
        )


def test_a_header_sent_to_a_default_consumer_is_named_not_unpacked_as_weights() -> None:
    collector = Collector()
    with pytest.raises(ValueError, match=r"chunk 0 \(from tensor 'odd_half'\).*size header.*size_header=True"):
        pt.packed_nccl_broadcast_consumer(
            iter(metadata(6)), Replayer(_recorded(6).sent, as_gloo=True), 0, collector, BUFFER, 2, "cpu"
        )
    assert collector.chunks == [], "the header's bytes must not be handed over as tensors"


def test_a_header_less_producer_meeting_a_header_consumer_is_named_not_a_gloo_abort() -> None:
    collector = Collector()
    with pytest.raises(ValueError, match=r"chunk 0 \(from tensor 'odd_half'\).*expects a size header.*sent none"):
        pt.packed_nccl_broadcast_consumer(
            iter(metadata(7)),
            Replayer(_recorded(7, size_header=False).sent, as_gloo=True),
            0,
            collector,
            BUFFER,
            2,
            "cpu",
            size_header=True,
        )
    assert collector.chunks == []


def test_metadata_is_what_post_iter_func_returned_so_a_cast_round_trips() -> None:
    items = [("w", random_tensor((4, 3), torch.float32, 7)), ("v", random_tensor((5,), torch.float32, 8))]
    chunk = pt.pack_tensors(iter(items), lambda item: item[1].to(torch.bfloat16).reshape(-1), 1 << 20)
    assert chunk is not None
    assert chunk.dtypes == [torch.bfloat16, torch.bfloat16] and chunk.shapes == [[12], [5]]
    assert chunk.tensor_sizes == [24, 10] and chunk.packed_tensor.numel() == 34
    for (name, tensor), (_, original) in zip(
        pt.unpack_tensor(chunk.packed_tensor, chunk.names, chunk.shapes, chunk.dtypes, chunk.tensor_sizes), items
    ):
        assert_bit_equal(tensor, original.to(torch.bfloat16).reshape(-1), name)


def test_pack_tensors_takes_0d_and_empty_tensors_and_appends_to_tensor_list() -> None:
    items = [
        ("s", random_tensor((), torch.float32, 1)),
        ("e", torch.empty(0, 3)),
        ("h", random_tensor((3,), torch.float16, 2)),
    ]
    held = [random_tensor((6,), torch.uint8, 3)]
    chunk = pt.pack_tensors(iter(items), lambda item: item[1], 100, tensor_list=held, current_size=6)
    assert chunk is not None and chunk.names == ["s", "e", "h"] and len(held) == 4
    assert torch.equal(chunk.packed_tensor[:6], held[0])
    out = pt.unpack_tensor(chunk.packed_tensor[6:], chunk.names, chunk.shapes, chunk.dtypes, chunk.tensor_sizes)
    for (name, tensor), (_, original) in zip(out, items):
        assert_bit_equal(tensor, original, name)
    assert pt.pack_tensors(iter([]), lambda item: item[1], 100) is None


def test_unpack_refuses_dtype_names_outside_the_allow_list_and_wrong_sizes_by_tensor() -> None:
    packed = random_tensor((16,), torch.uint8, 4)
    assert pt.unpack_tensor(packed, ["x"], [[4]], ["float32"], [16])[0][1].dtype == torch.float32  # type: ignore[list-item]
    with pytest.raises(UnsupportedDtypeError, match="'Tensor'"):
        pt.unpack_tensor(packed, ["x"], [[4]], ["Tensor"], [16])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="tensor 'x'"):
        pt.unpack_tensor(packed, ["x"], [[4]], [torch.float32], [12])
    with pytest.raises(UnsupportedDtypeError, match="'Tensor'"):
        pt.packed_nccl_broadcast_consumer(iter([("x", ([4], "Tensor"))]), Replayer([]), 0, print, 64, 1, "cpu")


def test_an_empty_iterator_sends_nothing_and_returns() -> None:
    recorder = Recorder()
    pt.packed_nccl_broadcast_producer(iter([]), recorder, 0, post_iter, BUFFER, 2)
    collector = Collector()
    pt.packed_nccl_broadcast_consumer(iter([]), Replayer([]), 0, collector, BUFFER, 2, "cpu")
    assert recorder.chunks == [] and collector.chunks == []
    before = set(leftover_segments(scope=current_scope()))
    assert list(pt.packed_ipc_producer(iter([]), pt.CPU_HANDLE_KEY, post_iter, BUFFER)) == []
    assert set(leftover_segments(scope=current_scope())) == before


def test_a_failure_midway_aborts_the_group_and_propagates() -> None:
    recorder = Recorder()

    def broken(item: tuple[str, torch.Tensor]) -> torch.Tensor:
        if item[0] == "fp8":
            raise RuntimeError("cast failed for fp8")
        return post_iter(item)

    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="fp8"):
        pt.packed_nccl_broadcast_producer(iter(model(2)), recorder, 0, broken, BUFFER, 2)
    assert recorder.aborted
    with pytest.raises(TypeError, match="'a'"):
        pt.pack_tensors(iter([("a", torch.ones(2))]), lambda item: None, 10)  # type: ignore[arg-type, return-value]
    with pytest.raises(ValueError, match="num_buffers"):
        pt.packed_nccl_broadcast_producer(iter(model(2)), recorder, 0, post_iter, BUFFER, 0)


def test_ipc_producer_refuses_an_oversize_tensor_naming_the_size_needed() -> None:
    items = [("small", torch.ones(4)), ("huge", torch.ones(100))]
    before = set(leftover_segments(scope=current_scope()))
    with pytest.raises(ValueError, match=r"'huge'.*exceeds buffer_size_bytes=128.*at least 400"):
        list(pt.packed_ipc_producer(iter(items), pt.CPU_HANDLE_KEY, lambda item: item[1], 128))
    assert set(leftover_segments(scope=current_scope())) == before


def test_the_oversize_warning_opens_with_vllms_words_so_its_filters_still_match() -> None:
    vpt = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    items = [("w", random_tensor((64,), torch.float32, 3))]
    with pytest.warns(UserWarning) as theirs:
        vpt.pack_tensors(iter(items), lambda item: item[1], 100)
    with pytest.warns(UserWarning, match=r"Tensor 'w' has size 256 bytes, which exceeds buffer_size_bytes=100") as ours:
        chunk = pt.pack_tensors(iter(items), lambda item: item[1], 100)
    assert chunk is not None and chunk.names == ["w"]
    assert len(theirs) == len(ours) == 1
    assert str(ours[0].message).startswith(str(theirs[0].message).rstrip("."))


def test_an_ipc_handle_for_other_gpus_only_is_vllms_value_error_naming_both(monkeypatch: Any) -> None:
    # The lookup runs before anything touches CUDA, so a stand-in UUID tests it on CPU.
    monkeypatch.setattr(packed_ipc, "gpu_uuid_of", lambda index: f"GPU-here-{index}")
    handle = {"GPU-elsewhere": tuple(range(8))}
    with pytest.raises(ValueError, match=r"IPC handle not found for GPU UUID GPU-here-1.*GPU-elsewhere") as caught:
        pt.packed_ipc_consumer(handle, ["w"], [[2]], ["float32"], [8], 1, pt.PackedBufferImporter())
    assert isinstance(caught.value, DeviceMismatch)
    args = packed_ipc.rebuild_args_for({"GPU-here-1": tuple(range(8)), **handle}, "GPU-here-1", 3)
    assert args == [0, 1, 2, 3, 4, 5, 3, 7]


def test_ipc_on_cpu_in_one_process_maps_once_and_delivers_trailing_empty_tensors() -> None:
    items = [("a", random_tensor((30,), torch.float32, 1)), ("b", random_tensor((3,), torch.float16, 2))]
    items += [("z0", torch.empty(0)), ("z1", torch.empty(0, 2, dtype=torch.int64))]
    importer = pt.PackedBufferImporter()
    got: dict[str, torch.Tensor] = {}
    chunks = 0
    for chunk in pt.packed_ipc_producer(iter(items), pt.CPU_HANDLE_KEY, lambda item: item[1], 120):
        assert isinstance(chunk, pt.PackedIpcChunk) and sum(chunk.tensor_sizes) <= 120
        for name, tensor in pt.packed_ipc_consumer(
            chunk.ipc_handle, chunk.names, chunk.shapes, chunk.dtype_names, chunk.tensor_sizes, -1, importer
        ):
            got[name] = tensor
        chunks += 1
    assert chunks == 2 and importer.mapped == 1 and importer.released == 0
    importer.close()
    assert importer.released == 1
    assert mismatches(got, items) == []
    with pytest.raises(UnsupportedDtypeError):
        pt.PackedIpcChunk(["a"], [[1]], ["Tensor"], [4], {"cpu": None})


def _collect(queue: Any, count: int) -> list[Any]:
    out = []
    for _ in range(count):
        item = queue.get(timeout=120)
        assert item[-1] is None, f"child failed:\n{item[-1]}"
        out.append(item)
    return out


def _run_world(tmp_path: Any, scenarios: list[Scenario]) -> list[Any]:
    queue = CTX.Queue()
    world = 3
    rdzv = f"file://{tmp_path}/rendezvous"
    children = [CTX.Process(target=gloo_world, args=(r, world, rdzv, scenarios, queue)) for r in range(world)]
    for child in children:
        child.start()
    try:
        results = _collect(queue, world)
    finally:
        for child in children:
            child.join(timeout=60)
    for child in children:
        assert child.exitcode == 0
    return [entry for _, rank_results, _ in results for entry in rank_results]


def test_every_broadcast_round_trips_over_real_gloo_groups_between_processes(tmp_path: Any) -> None:
    scenarios: list[Scenario] = [
        (group, nbuf, seed, "ws", "ws", "awkward", header)
        for seed, (group, nbuf, header) in enumerate(
            [
                ("world", 1, None),
                ("world", 2, True),
                ("world", 3, None),
                ("pair", 1, True),
                ("pair", 2, None),
                ("pair", 3, True),
                ("weightsync", 2, None),
                ("weightsync", 2, True),
            ]
        )
    ]
    results = _run_world(tmp_path, scenarios)
    expected_receivers = {"world": 2, "pair": 1, "weightsync": 2}
    for scenario in scenarios:
        mine = [r for r in results if tuple(r[0]) == scenario]
        assert len(mine) == expected_receivers[scenario[0]], scenario
        wire = sent(scenario[2])
        chunks = [[wire[i][0] for i in c] for c in expected_chunks(sizes_of(wire), BUFFER)]
        for _, bad, received_chunks in mine:
            assert bad == [], f"{scenario}: tensors differ or missing: {bad}"
            assert received_chunks == chunks, scenario
    assert any(name == "big" for name, _ in sent(0)) and len(LAYOUT) == len(sent(0))


@pytest.mark.parametrize(
    ("consumer_buffer", "headers", "named"),
    [
        (BUFFER * 4, (True, True), f"buffer_size_bytes={BUFFER}, this consumer's={BUFFER * 4}"),
        (BUFFER, (False, True), "expects a size header (size_header=True) and the producer sent none"),
        (BUFFER, (True, False), "the producer sent a weightsync size header"),
    ],
    ids=["buffer-sizes", "header-less-producer", "header-to-default-consumer"],
)
def test_a_mismatched_consumer_over_real_gloo_raises_instead_of_aborting(
    tmp_path: Any, consumer_buffer: int, headers: tuple[bool, bool], named: str
) -> None:
    queue = CTX.Queue()
    rdzv = f"file://{tmp_path}/rendezvous"
    children = [CTX.Process(target=mismatched_pair, args=(r, rdzv, consumer_buffer, headers, queue)) for r in range(2)]
    for child in children:
        child.start()
    try:
        outcomes = {rank: outcome for rank, outcome, _ in _collect(queue, 2)}
    finally:
        for child in children:
            child.join(timeout=120)
    assert [child.exitcode for child in children] == [0, 0], "a rank died (gloo aborts on a size mismatch)"
    consumer = outcomes[1]
    assert consumer is not None and consumer.startswith("ValueError")
    assert named in consumer


def test_interoperates_both_ways_with_vllms_own_module(tmp_path: Any) -> None:
    try:
        pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    except pytest.skip.Exception as skip:
        print(f"vLLM is not importable here, interoperability not tested: {skip}")
        raise
    # weightsync's side at its default size_header, as a trainer or engine that switched its import runs it.
    scenarios: list[Scenario] = [
        ("world", 2, 20, "ws", "vllm", "aligned", None),
        ("world", 2, 21, "vllm", "ws", "aligned", None),
        ("pair", 1, 22, "vllm", "ws", "odd", None),
    ]
    results = _run_world(tmp_path, scenarios)
    assert len(results) == 5
    for scenario, bad, received_chunks in results:
        assert bad == [], f"{scenario}: tensors differ or missing: {bad}"
        wire = sent(scenario[2], scenario[5])
        assert received_chunks == [[wire[i][0] for i in c] for c in expected_chunks(sizes_of(wire), BUFFER)]


def _recorded_both(monkeypatch: Any, layout: str, buffer: int | None) -> tuple[Recorder, Recorder]:
    """Each module's producer at its defaults (``buffer`` None: vLLM's default 1 GiB too),
    recorded; vLLM's is fed what goes on the wire, as it records the original dtypes."""
    vpt = cpu_shims_for_vllm(monkeypatch.setattr)
    sized = () if buffer is None else (buffer,)
    ours, theirs = Recorder(), Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the oversize tensors' warnings, tested above
        pt.packed_nccl_broadcast_producer(iter(model(40, layout)), ours, 0, post_iter, *sized)
        vpt.packed_nccl_broadcast_producer(iter(sent(40, layout)), theirs, 0, lambda item: item[1], *sized)
    return ours, theirs


@pytest.mark.parametrize("buffer", [None, BUFFER], ids=["default-buffer", "many-chunks"])
def test_default_broadcasts_are_vllms_byte_for_byte(monkeypatch: Any, buffer: int | None) -> None:
    pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    ours, theirs = _recorded_both(monkeypatch, "odd", buffer)
    assert len(theirs.sent) == (1 if buffer is None else len(expected_chunks(sizes_of(sent(40, "odd")), BUFFER)))
    assert [(t.dtype, t.numel()) for t in ours.sent] == [(t.dtype, t.numel()) for t in theirs.sent]
    for index, (mine, vllms) in enumerate(zip(ours.sent, theirs.sent)):
        assert torch.equal(mine, vllms), f"broadcast {index} differs from vLLM's"


@pytest.mark.parametrize("buffer", [None, BUFFER], ids=["default-buffer", "many-chunks"])
def test_each_modules_default_consumer_reads_the_others_default_producer(monkeypatch: Any, buffer: int | None) -> None:
    pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    vpt = cpu_shims_for_vllm(monkeypatch.setattr)
    sized = () if buffer is None else (buffer,)
    # vLLM's consumer reads the aligned layout (it cannot view odd offsets); ours reads odd ones.
    ours, _ = _recorded_both(monkeypatch, "aligned", buffer)
    into_vllm = Collector()
    vpt.packed_nccl_broadcast_consumer(
        iter(metadata(40, "aligned")), Replayer(ours.sent), 0, into_vllm, *sized, device="cpu"
    )
    assert mismatches(into_vllm.tensors, sent(40, "aligned")) == []
    _, theirs = _recorded_both(monkeypatch, "odd", buffer)
    into_ours = Collector()
    pt.packed_nccl_broadcast_consumer(
        iter(metadata(40, "odd")), Replayer(theirs.sent), 0, into_ours, *sized, device="cpu"
    )
    assert mismatches(into_ours.tensors, sent(40, "odd")) == []
    names = [name for name, _ in sent(40, "odd")]
    assert into_ours.chunks == (
        [names]
        if buffer is None
        else [[names[i] for i in c] for c in expected_chunks(sizes_of(sent(40, "odd")), BUFFER)]
    )


def test_vllms_pack_and_unpack_read_ours_and_ours_read_theirs() -> None:
    vpt = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    items = model(5, "aligned")
    theirs = vpt.pack_tensors(iter(items), lambda item: item[1], 100)
    ours = pt.pack_tensors(iter(items), lambda item: item[1], 100)
    assert theirs.names == ours.names and torch.equal(theirs.packed_tensor, ours.packed_tensor)
    for unpacked in (
        vpt.unpack_tensor(ours.packed_tensor, ours.names, ours.shapes, ours.dtypes, ours.tensor_sizes),
        pt.unpack_tensor(theirs.packed_tensor, theirs.names, theirs.shapes, theirs.dtypes, theirs.tensor_sizes),
    ):
        for (name, tensor), (_, original) in zip(unpacked, items):
            assert_bit_equal(tensor, original, name)


def test_shared_memory_ipc_between_processes_reuses_one_buffer_per_transfer() -> None:
    seeds = [31, 32, 33]
    chunks_out = CTX.Queue()
    acks = CTX.Queue()
    before = set(leftover_segments(scope=current_scope()))
    child = CTX.Process(target=shm_ipc_consumer, args=(seeds, chunks_out, acks))
    child.start()
    try:
        for number, seed in enumerate(seeds, start=1):
            count = 0
            for chunk in pt.packed_ipc_producer(iter(model(seed)), pt.CPU_HANDLE_KEY, post_iter, 1700):
                chunks_out.put(chunk)
                kind, mapped, released, error = acks.get(timeout=60)  # chunk k read before k+1 is packed
                assert error is None, error
                assert (kind, mapped, released) == ("chunk", number, number - 1)
                count += 1
            assert count >= 3
            chunks_out.put(None)
            kind, bad, mapped, error = acks.get(timeout=60)
            assert error is None, error
            assert kind == "transfer" and bad == [], f"seed {seed}: {bad}"
        kind, mapped, released, error = acks.get(timeout=60)
        assert (kind, mapped, released, error) == ("closed", len(seeds), len(seeds), None)
    finally:
        child.join(timeout=60)
    assert child.exitcode == 0
    assert set(leftover_segments(scope=current_scope())) == before
