"""Test data and comparisons: random bits for every dtype, bit-for-bit equality; one
sync's two sides run at once in the test's process."""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn

from weightsync.core import registry
from weightsync.core.receiver import WeightReceiver
from weightsync.core.sender import WeightSender
from weightsync.core.sinks import module_tensors
from weightsync.core.wire import ALLOWED_DTYPES, Manifest, Session
from weightsync.core.wire.messages import SyncCall


def session_of(manifest: Manifest, party: str = "trainer", server: str = "trainer", timeout_s: float = 30.0) -> Session:
    """A Session for a half made by hand in a test."""
    return Session(manifest=manifest, party=party, server=server, timeout_s=timeout_s)


def act(side: Any, transport: str, action: str, *args: Any) -> Any:
    """Run one setup action of a registered plug-in on an endpoint of this process (what a
    party's ws_open does), for tests whose parties live in separate processes or threads."""
    role = "trainer" if isinstance(side, WeightSender) else "worker"
    return registry.get(transport).action(role, action)(side, *args)


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values of ``dtype`` (random bit patterns for integer, bool and fp8 types)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point and dtype.itemsize >= 2:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """Same dtype, same shape, same bytes (fp8 NaN patterns included)."""
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(bits(actual), bits(expected)), f"{name}: bytes differ"


def assert_models_equal(a: nn.Module, b: nn.Module) -> None:
    ta, tb = dict(module_tensors(a)), dict(module_tensors(b))
    assert ta.keys() == tb.keys()
    for name in ta:
        assert_bit_equal(tb[name], ta[name], name)


def all_dtypes() -> list[torch.dtype]:
    return list(ALLOWED_DTYPES.values())


class MixedModel(nn.Module):
    """Awkward layouts: odd-sized fp16 followed by fp32, several dtypes, a 0-d buffer."""

    def __init__(self, seed: int = 0, big: int = 3000) -> None:
        super().__init__()
        self.odd = nn.Parameter(random_tensor((3, 5), torch.float16, seed))
        self.after_odd = nn.Parameter(random_tensor((7,), torch.float32, seed + 1))
        self.big = nn.Parameter(random_tensor((big, 4), torch.bfloat16, seed + 2))
        self.linear = nn.Linear(6, 10)
        with torch.no_grad():
            self.linear.weight.copy_(random_tensor((10, 6), torch.float32, seed + 3))
            self.linear.bias.copy_(random_tensor((10,), torch.float32, seed + 4))
        self.register_buffer("step", random_tensor((), torch.int64, seed + 5))
        self.register_buffer("mask", random_tensor((9, 3), torch.bool, seed + 6))
        self.register_buffer("empty", torch.empty(0, 4))
        self.register_buffer("scratch", torch.zeros(4), persistent=False)


def loads_by_name(model: nn.Module, held: dict[str, torch.Tensor]) -> nn.Module:
    """``model`` with an engine's way of loading: ``load_weights(pairs)`` copies each pair
    into ``held[name]`` and returns the names loaded."""

    def load_weights(weights: Any) -> set[str]:
        names = set()
        with torch.no_grad():
            for name, tensor in weights:
                held[name].copy_(tensor)
                names.add(name)
        return names

    model.load_weights = load_weights  # type: ignore[assignment]
    return model


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Run inside an actor: a CPU copy of every synced tensor."""
    return {name: t.detach().cpu().clone() for name, t in module_tensors(model)}


def perturb(model: nn.Module, seed: int) -> None:
    """Run inside an actor: change every tensor to new random bits (a stand-in for training)."""
    with torch.no_grad():
        for i, (_, tensor) in enumerate(module_tensors(model)):
            tensor.copy_(random_tensor(tuple(tensor.shape), tensor.dtype, seed * 1000 + i).to(tensor.device))


def bytes_state_of(model: nn.Module) -> dict[str, tuple[str, tuple[int, ...], torch.Tensor]]:
    """Run inside an actor: (dtype, shape, raw bytes) of every synced tensor. Raw uint8 bytes
    survive Ray's pickling for every dtype (fp8 and uint32 tensors do not, in torch 2.11)."""
    return {
        name: (str(t.dtype), tuple(t.shape), t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().clone())
        for name, t in module_tensors(model)
    }


def both_sides(sender: WeightSender, receiver: WeightReceiver, call: SyncCall) -> tuple[Any, Any]:
    """One sync in this process, the receiver on a thread beside the sender (no commit);
    each side's result, or the exception it raised, for the test to look at."""
    got: list[Any] = []

    def receive() -> None:
        try:
            got.append(receiver.receive(call))
        except Exception as exc:  # the test looks at it
            got.append(exc)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    try:
        sent: Any = sender.send(call)
    except Exception as exc:  # the test looks at it
        sent = exc
    thread.join(60)
    assert not thread.is_alive(), "the receiver hung"
    return sent, got[0]
