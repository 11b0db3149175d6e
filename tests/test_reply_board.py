"""The coordinator's reply board: the answers of a sync's calls from the parties on its host,
read from shared memory instead of Ray's return leg, and exactly what Ray would return."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import pickle
from typing import Any

import pytest
import ray

from tests.helpers import MixedModel, perturb
from tests.test_ray_e2e import assert_workers_match, get
from weightsync import SyncError, WeightSync
from weightsync.core.wire.errors import ExportNotFound, WeightSyncError
from weightsync.core.wire.messages import BoardOffer, SyncCall
from weightsync.core.wire.outcome import Outcome, Status, ok
from weightsync.glue import calls as calls_module
from weightsync.glue.actors import TrainerHost, WorkerHost
from weightsync.glue.replies import SLOT_BYTES, ReplyRound, accept_board, on_board
from weightsync.mechanisms.board import TOO_BIG, ReplyBoard


@pytest.fixture
def board() -> Any:
    made = ReplyBoard.create(4, 1024)
    yield made
    made.close()


# the board itself -----------------------------------------------------------------------
def test_an_answer_posted_in_a_slot_is_read_back_byte_for_byte_only_in_its_round(board: ReplyBoard) -> None:
    data = bytes(range(256)) * 3 + b"tail"
    assert board.take(1, 7) is None  # nothing posted yet
    assert board.post(1, 7, data)
    assert board.take(1, 7) == data
    assert board.take(1, 8) is None  # another round's tag
    assert board.take(0, 7) is None  # another slot


def test_an_answer_too_big_for_its_slot_says_read_rays_answer(board: ReplyBoard) -> None:
    assert not board.post(2, 3, b"x" * 1025)
    assert board.take(2, 3) is TOO_BIG
    assert not board.post(3, 3, None)
    assert board.take(3, 3) is TOO_BIG


def test_bytes_changed_under_a_posted_answer_are_not_taken(board: ReplyBoard) -> None:
    """A writer of an earlier round overwriting a slot the current round's party posted in:
    the reader takes no mixture (the digest no longer matches)."""
    board.post(0, 5, b"a" * 100)
    board._slots[0][4:].view("uint8")[:3] = (1, 2, 3)  # a late writer's first bytes
    assert board.take(0, 5) is None


def test_a_party_maps_the_board_from_its_handle_and_a_malformed_offer_is_refused(board: ReplyBoard) -> None:
    mapped = ReplyBoard.attach(board.handle(), 4, 1024)
    mapped.post(3, 2, b"from the party")
    assert board.take(3, 2) == b"from the party"
    with pytest.raises(WeightSyncError, match=board.path):
        ReplyBoard.attach(board.handle(), 8, 1024)


def test_a_board_whose_name_was_removed_cannot_be_mapped_and_says_which() -> None:
    gone = ReplyBoard.create(1, 64)
    handle = gone.handle()
    gone.unlink()
    with pytest.raises(ExportNotFound, match=handle.path):
        ReplyBoard.attach(handle, 1, 64)
    gone.close()


def test_offers_and_reply_slots_refuse_impossible_numbers_by_name(board: ReplyBoard) -> None:
    with pytest.raises(WeightSyncError, match="slot"):
        _offer(board, slots=0)
    with pytest.raises(WeightSyncError, match="party"):
        _offer(board, party="")
    with pytest.raises(WeightSyncError, match="reply slot"):
        SyncCall(seq=0, version=1, reply=(0, 0))
    with pytest.raises(WeightSyncError, match="reply slot"):
        SyncCall(seq=0, version=1, reply=(-1, 2))


# the party's side, without Ray ------------------------------------------------------------
def _offer(board: ReplyBoard, owner: str = "WeightSync a", slots: int | None = None, party: str = "p") -> BoardOffer:
    return BoardOffer(
        board=board.handle(),
        slots=board.slots if slots is None else slots,
        slot_bytes=board.slot_bytes,
        owner=owner,
        party=party,
        doorbell="\0weightsync-test-doorbell",
        doorbell_key=b"k" * 16,
    )


class _Party:
    """A worker actor's instance, its ``ws_receive`` answering on the board."""

    def __init__(self, answer: Any = None, raises: BaseException | None = None) -> None:
        self.answer, self.raises = answer, raises

    @on_board
    def ws_receive(self, call: SyncCall) -> Any:
        if self.raises is not None:
            raise self.raises
        return self.answer


def _call(slot: int, tag: int, owner: str = "WeightSync a") -> SyncCall:
    return SyncCall(seq=0, version=1, owner=owner, reply=(slot, tag))


def test_a_sync_method_posts_what_it_returned_and_returns_it(board: ReplyBoard) -> None:
    party = _Party(answer=ok("worker-0", "receive", [1, 2, 3]))
    assert accept_board(party, _offer(board)) == ""
    round_ = ReplyRound(board, 4, frozenset({"worker-0"}), doorbell=None)
    told = round_.call(("worker-0", "receive"), SyncCall(seq=0, version=1, owner="WeightSync a"))
    assert told.reply == (0, 4)
    assert round_.call(("far", "receive"), told) is told  # a party off the board: unchanged
    assert party.ws_receive(told) is party.answer
    assert round_.take(("worker-0", "receive")) == party.answer


def test_a_method_that_raises_marks_its_slot_for_ray_at_once_and_raises(board: ReplyBoard) -> None:
    party = _Party(raises=RuntimeError("worker-0 broke"))
    accept_board(party, _offer(board))
    with pytest.raises(RuntimeError, match="worker-0 broke"):
        party.ws_receive(_call(1, 9))
    assert board.take(1, 9) is TOO_BIG


def test_an_answer_bigger_than_a_slot_goes_through_ray(board: ReplyBoard) -> None:
    party = _Party(answer=ok("worker-0", "receive", "x" * 2048))
    accept_board(party, _offer(board))
    party.ws_receive(_call(0, 1))
    assert board.take(0, 1) is TOO_BIG


def test_a_call_of_another_coordinator_or_without_a_slot_posts_nothing(board: ReplyBoard) -> None:
    party = _Party(answer=ok("worker-0", "receive", 1))
    accept_board(party, _offer(board))
    party.ws_receive(_call(2, 3, owner="WeightSync b"))
    party.ws_receive(SyncCall(seq=0, version=1, owner="WeightSync a"))
    assert board.take(2, 3) is None


def test_an_answer_posted_for_another_slot_is_not_taken_as_this_ones(board: ReplyBoard) -> None:
    board.post(0, 3, pickle.dumps((1, 3, "slot 1's answer")))
    round_ = ReplyRound(board, 3, frozenset({"a"}), doorbell=None)
    round_.slots[("a", "receive")] = 0
    assert round_.take(("a", "receive")) is None


def test_an_async_sync_method_answers_on_the_board_too(board: ReplyBoard) -> None:
    class AsyncParty:
        @on_board
        async def ws_receive(self, call: SyncCall) -> Any:
            return ok("engine", "receive", "async")

    party = AsyncParty()
    assert accept_board(party, _offer(board)) == ""
    answer = asyncio.run(party.ws_receive(_call(3, 2)))
    assert pickle.loads(board.take(3, 2))[2] == answer  # type: ignore[arg-type]


def test_an_actor_overriding_a_sync_method_declines_the_board_naming_it(board: ReplyBoard) -> None:
    class Overrides(WorkerHost):
        def ws_receive(self, call: Any) -> Any:
            return super().ws_receive(call)

    why = accept_board(Overrides.__new__(Overrides), _offer(board))
    assert "ws_receive" in why and "on_board" in why


def test_an_actor_keeps_one_board_per_coordinator_and_a_bounded_number() -> None:
    party = _Party()
    boards = [ReplyBoard.create(1, 64) for _ in range(10)]
    for i, made in enumerate(boards):
        assert accept_board(party, _offer(made, owner=f"WeightSync {i}")) == ""
    assert accept_board(party, _offer(boards[9], owner="WeightSync 9")) == ""
    held = party._ws_reply_boards  # type: ignore[attr-defined]
    assert list(held) == [f"WeightSync {i}" for i in range(2, 10)]
    for made in boards:
        made.close()


# through Ray ------------------------------------------------------------------------------
def _pair(actors: Any, worker_cls: type = WorkerHost, n: int = 1) -> tuple[Any, list[Any]]:
    trainer = actors.add(ray.remote(TrainerHost).options(num_cpus=0).remote(functools.partial(MixedModel, seed=0)))
    workers = [
        actors.add(ray.remote(worker_cls).options(num_cpus=0).remote(functools.partial(MixedModel, seed=i + 1)))
        for i in range(n)
    ]
    return trainer, workers


@pytest.fixture
def through_ray(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """The calls whose answers were read from Ray (not the board), in every gather."""
    seen: list[tuple[str, str]] = []
    original = calls_module._from_ray

    def recording(calls: Any, *args: Any) -> Any:
        seen.extend(calls)
        return original(calls, *args)

    monkeypatch.setattr(calls_module, "_from_ray", recording)
    return seen


@pytest.mark.parametrize("transport", ["direct", "ipc", "broadcast"])
def test_every_answer_of_a_sync_on_this_host_comes_from_the_board_and_the_weights_are_bit_exact(
    transport: str, actors: Any, through_ray: list[tuple[str, str]]
) -> None:
    trainer, workers = _pair(actors, n=2)
    with WeightSync(trainer, workers, transport=transport) as ws:
        assert ws._steps.replies.parties == {"trainer", "worker-0", "worker-1"}
        round_ = ws._steps.replies.round()
        assert round_ is not None and round_.doorbell is not None  # CPU parties: it sleeps on it
        for version in (1, 2, 3):
            get(trainer.call.remote(perturb, version))
            through_ray.clear()
            report = ws.sync(version, verify=version == 3)  # verify: chained commits too
            assert [w.version for w in report.workers] == [version, version]
            assert through_ray == []
        assert_workers_match(trainer, workers)


def test_push_mode_answers_on_the_board(actors: Any, through_ray: list[tuple[str, str]]) -> None:
    trainer, workers = _pair(actors)
    with WeightSync(trainer, workers, transport="direct", push=True) as ws:
        get(trainer.call.remote(perturb, 1))
        through_ray.clear()
        assert ws.sync(1).workers[0].version == 1
        assert through_ray == []
        assert_workers_match(trainer, workers)


class RaisesInReceive(WorkerHost):
    @on_board
    def ws_receive(self, call: Any) -> Any:
        if call.version == 2:
            raise RuntimeError(f"{self._me()} refused version 2 outside the protocol")
        return super().ws_receive(call)


def test_a_party_whose_method_raises_is_named_with_its_error_as_through_ray(actors: Any) -> None:
    trainer, (healthy,) = _pair(actors)
    odd = actors.add(ray.remote(RaisesInReceive).options(num_cpus=0).remote(functools.partial(MixedModel, seed=4)))
    ws = WeightSync(trainer, {"healthy": healthy, "odd": odd}, transport="direct", timeout_s=60)
    ws.sync(1)
    assert "odd" in ws._steps.replies.parties  # its override answers on the board too
    get(trainer.call.remote(perturb, 2))
    with pytest.raises(SyncError) as info:
        ws.sync(2)
    assert info.value.outcomes["odd"].status is Status.FAILED
    assert "refused version 2 outside the protocol" in info.value.outcomes["odd"].message
    assert "odd" in info.value.culprits
    # The trainer was told at once (weightsync/core/abandon.py), not left to its deadline.
    assert info.value.outcomes["trainer"].error == "PeerAborted"
    get(trainer.call.remote(perturb, 3))
    assert [w.version for w in ws.sync(3).workers] == [3, 3]
    assert_workers_match(trainer, [healthy, odd])
    ws.close()


def _one_sync(ws: WeightSync, trainer: Any, workers: list[Any], through_ray: list[tuple[str, str]]) -> list[Any]:
    """A training step and sync 1, every worker then bit-exact; the calls read from Ray."""
    get(trainer.call.remote(perturb, 1))
    through_ray.clear()
    ws.sync(1)
    assert_workers_match(trainer, workers)
    return list(through_ray)


def test_a_party_on_another_host_answers_through_ray_beside_one_on_the_board(
    actors: Any, monkeypatch: pytest.MonkeyPatch, through_ray: list[tuple[str, str]]
) -> None:
    from weightsync.glue import replies

    trainer, (near, far) = _pair(actors, n=2)
    offer = replies.Replies.offer

    def elsewhere(self: Any, handles: Any, infos: Any, gather: Any) -> None:
        moved = dict(infos, far=dataclasses.replace(infos["far"], hostname="another-host"))
        offer(self, handles, moved, gather)

    monkeypatch.setattr(replies.Replies, "offer", elsewhere)
    with WeightSync(trainer, {"near": near, "far": far}, transport="direct") as ws:
        assert ws._steps.replies.parties == {"trainer", "near"}
        assert _one_sync(ws, trainer, [near, far], through_ray) == [("far", "receive")]


class OverridesReceive(WorkerHost):
    def ws_receive(self, call: Any) -> Any:
        return super().ws_receive(call)


def test_a_worker_overriding_its_receive_answers_through_ray_and_syncs_bit_exact(
    actors: Any, through_ray: list[tuple[str, str]]
) -> None:
    trainer, (plain,) = _pair(actors)
    own = actors.add(ray.remote(OverridesReceive).options(num_cpus=0).remote(functools.partial(MixedModel, seed=6)))
    with WeightSync(trainer, {"plain": plain, "own": own}, transport="direct") as ws:
        assert ws._steps.replies.parties == {"trainer", "plain"}
        assert _one_sync(ws, trainer, [plain, own], through_ray) == [("own", "receive")]


def test_the_board_leaves_no_region_behind_and_close_releases_it(actors: Any, no_shm_leftovers: None) -> None:
    trainer, workers = _pair(actors)
    ws = WeightSync(trainer, workers, transport="direct")
    ws.setup()
    assert ws._steps.replies.parties
    ws.sync(1)
    ws.close()
    assert ws._steps.replies.parties == frozenset()


def test_a_slot_holds_a_verified_sync_answer_of_a_model_with_many_tensors() -> None:
    """The slot size fits what a verified sync answers for a model of 1000 tensors (a 70B
    model has fewer): a SendResult with two checksums per tensor."""
    from weightsync.core.wire.messages import SendResult

    result = SendResult(checksums={"direct": [2**63 - 1] * 1000}, tensor_checksums=[2**63 - 1] * 1000)
    answer: Outcome = ok("trainer", "send", result)
    assert len(pickle.dumps((0, 1, answer), protocol=pickle.HIGHEST_PROTOCOL)) <= SLOT_BYTES


def test_reply_board_false_answers_every_call_through_ray(actors: Any, through_ray: list[tuple[str, str]]) -> None:
    trainer, workers = _pair(actors)
    with WeightSync(trainer, workers, transport="direct", reply_board=False) as ws:
        assert ws._steps.replies.parties == frozenset()
        get(trainer.call.remote(perturb, 1))
        through_ray.clear()
        ws.sync(1)
        assert sorted(through_ray) == [("trainer", "send"), ("worker-0", "receive")]
        assert_workers_match(trainer, workers)


def test_a_reply_board_setting_that_is_not_a_bool_is_refused_by_name() -> None:
    from weightsync.core.wire import SettingsError, SyncSettings

    with pytest.raises(SettingsError, match="reply_board"):
        SyncSettings(reply_board="yes")  # type: ignore[arg-type]


def test_an_override_wrapped_too_posts_its_own_answer_after_the_mixins(board: ReplyBoard) -> None:
    """The outermost wrapped method posts: what the override returns, after its work."""
    seen_inside: list[object] = []

    class Base:
        @on_board
        def ws_receive(self, call: SyncCall) -> Any:
            return "the mixin's answer"

    class Sub(Base):
        @on_board
        def ws_receive(self, call: SyncCall) -> Any:
            inner = super().ws_receive(call)
            seen_inside.append(board.take(0, 5))  # nothing posted by the inner method
            return f"{inner}, then the override's"

    party = Sub()
    assert accept_board(party, _offer(board)) == ""
    assert party.ws_receive(_call(0, 5)) == "the mixin's answer, then the override's"
    assert seen_inside == [None]
    assert pickle.loads(board.take(0, 5))[2] == "the mixin's answer, then the override's"  # type: ignore[arg-type]


@pytest.mark.cuda
@pytest.mark.parametrize("transport", ["direct", "ipc"])
def test_on_a_gpu_the_coordinator_polls_the_board_and_every_answer_comes_from_it(
    transport: str, actors: Any, through_ray: list[tuple[str, str]]
) -> None:
    from tests.test_cuda import gpu_pair
    from weightsync.tools.models import PolicyFactory, train_step

    trainer, workers = gpu_pair(
        actors, PolicyFactory("30mb", 0, "cuda"), worker_factory=PolicyFactory("30mb", 1, "cuda")
    )
    with WeightSync(trainer, workers, transport=transport) as ws:
        round_ = ws._steps.replies.round()
        assert round_ is not None and round_.doorbell is None  # parties copy on the GPU: it polls
        for version in (1, 2, 3):
            get(trainer.call.remote(train_step, version))
            through_ray.clear()
            assert ws.sync(version, verify=version == 3).workers[0].version == version
            assert through_ray == []
        assert_workers_match(trainer, workers)


def test_an_actor_class_pickled_by_value_keeps_its_wrapped_sync_method() -> None:
    """Ray pickles a class defined in a script's __main__ (here: in a function) by value."""
    from ray import cloudpickle

    class ScriptTrainer(TrainerHost):
        @on_board
        def ws_send(self, *args: Any, **kwargs: Any) -> Any:
            return super().ws_send(*args, **kwargs)

    again = cloudpickle.loads(cloudpickle.dumps(ScriptTrainer))
    assert accept_board(again.__new__(again), _offer(ReplyBoard.create(1, 64))) == ""


def test_a_forwarding_actor_class_gets_sync_methods_of_its_own_that_answer_on_the_board() -> None:
    """Ray marks an actor's method functions (a concurrency group, as the vLLM engine's
    are): a function shared with WorkerMixin would carry the mark to every other worker class."""
    from weightsync.glue.actors import WORKER_PROTOCOL, WorkerMixin, forward_worker_protocol

    @forward_worker_protocol
    class Forwarding:
        def forward_weightsync(self, method: str, *args: Any, **kwargs: Any) -> Any:
            return ok("engine", method, None)

    for method in WORKER_PROTOCOL:
        assert vars(Forwarding)[method] is not getattr(WorkerMixin, method), method
    engine = Forwarding()
    with ReplyBoard.create(2, 256) as board:
        assert accept_board(engine, _offer(board)) == ""
        engine.ws_receive(_call(1, 6))  # type: ignore[attr-defined]
        assert pickle.loads(board.take(1, 6))[2] == ok("engine", "ws_receive", None)  # type: ignore[arg-type]


def test_ray_method_options_given_to_a_wrapped_sync_method_reach_ray() -> None:
    """Ray reads an actor method's options from the function it reaches through __wrapped__:
    a concurrency group given before or after wrapping (the vLLM engine's "weightsync" group,
    which serializes its sync calls) must reach Ray's metadata."""

    class Engine(WorkerHost):
        @on_board
        @ray.method(concurrency_group="early")  # type: ignore[misc]
        def ws_commit(self, call: Any, *args: Any) -> Any:
            return super().ws_commit(call, *args)

    Engine.ws_receive = ray.method(concurrency_group="late")(on_board(WorkerHost.ws_receive))  # type: ignore[method-assign]
    remote = ray.remote(concurrency_groups={"early": 1, "late": 1})(Engine)  # type: ignore[call-overload]
    groups = remote.__ray_metadata__.method_meta.concurrency_group_for_methods
    assert groups["ws_commit"] == "early" and groups["ws_receive"] == "late"
