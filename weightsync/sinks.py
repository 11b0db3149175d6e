"""Where received tensors land on a worker.

* :class:`ModuleSink` copies into an ``nn.Module``'s parameters and buffers by name. Its
  destinations are the parameters themselves, so unpacking is one copy from the buffer
  straight into the weights, and it allows the one-copy ``direct`` transport.
* :class:`LoadWeightsSink` hands ``(name, tensor)`` lists to a ``load_weights`` callable,
  the convention of inference engines (vLLM's ``model.load_weights``), which rename, fuse
  and shard as they load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch
from torch import nn

from weightsync.spec import Manifest, TensorSpec


def module_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A module's parameters and persistent buffers, in registration order.

    Tied tensors (one Parameter registered under two names, as tied embeddings are) appear
    once, under their first name, so they travel once and stay tied on the worker.
    """
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for name, param in module.named_parameters():
        seen.add(id(param))
        out.append((name, param))
    for module_name, sub in module.named_modules():
        skip: set[str] = getattr(sub, "_non_persistent_buffers_set", set())
        for buffer_name, buffer in sub.named_buffers(recurse=False):
            if buffer is None or buffer_name in skip or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            out.append((f"{module_name}.{buffer_name}" if module_name else buffer_name, buffer))
    return out


def module_tensor_list(module: nn.Module) -> list[torch.Tensor]:
    """The tensors of :func:`module_tensors`, same order, without building their names.

    About three times cheaper, for the per-sync check that a module still holds the very
    tensor objects it held when its names were last checked.
    """
    modules: list[nn.Module] = []
    visited: set[int] = set()
    stack = [module]
    while stack:  # preorder, each module once, as named_modules() walks
        current = stack.pop()
        if id(current) in visited:
            continue
        visited.add(id(current))
        modules.append(current)
        stack.extend(reversed([child for child in current._modules.values() if child is not None]))
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for current in modules:
        for param in current._parameters.values():
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                out.append(param)
    for current in modules:
        skip = current._non_persistent_buffers_set
        for name, buffer in current._buffers.items():
            if buffer is None or name in skip or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            out.append(buffer)
    return out


def same_objects(a: Sequence[object], b: Sequence[object]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class Sink(Protocol):
    """What a receiver needs from the place tensors go."""

    #: True when the sink keeps references to what it is handed past the call; it then
    #: gets clones, never views into a buffer that the next chunk overwrites.
    keeps_references: bool

    def local_specs(self) -> Sequence[TensorSpec] | None:
        """What this worker holds, for the handshake; None accepts any manifest."""

    def destinations(self, manifest: Manifest) -> list[torch.Tensor | None]:
        """Per spec, a contiguous tensor to copy straight into, or None to be handed it."""

    def consume(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Take tensors that had no destination."""

    def direct_tensors(self, manifest: Manifest) -> list[torch.Tensor] | None:
        """The tensors the direct transport may write into, or None if it may not."""

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        """Point the held tensor for spec ``index`` at ``tensor`` (direct transport)."""


class ModuleSink:
    """Copies received tensors into ``module``'s parameters and buffers by name."""

    keeps_references = False

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._by_name: dict[str, torch.Tensor] = {}
        self._order: list[torch.Tensor] = []
        self._checked: list[torch.Tensor] = []  # module_tensor_list when _order was built

    def held(self) -> dict[str, torch.Tensor]:
        return dict(module_tensors(self.module))

    def local_specs(self) -> list[TensorSpec]:
        return [TensorSpec.of(name, tensor) for name, tensor in module_tensors(self.module)]

    def destinations(self, manifest: Manifest) -> list[torch.Tensor | None]:
        self._by_name = self.held()
        self._order = [self._by_name[spec.name] for spec in manifest.specs]
        return [t.data if t.is_contiguous() else None for t in self._order]

    def consume(self, items: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in items:
                self._by_name[name].copy_(tensor)

    def direct_tensors(self, manifest: Manifest) -> list[torch.Tensor]:
        current = module_tensor_list(self.module)
        if not same_objects(current, self._checked):
            held = self.held()
            self._order = [held[spec.name] for spec in manifest.specs]
            self._checked = current
        return [t.data for t in self._order]

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        self._order[index].data = tensor


class LoadWeightsSink:
    """Hands each chunk's tensors to ``load_weights(iterable of (name, tensor))``.

    ``copies_immediately=True`` (the engines' behaviour: each weight is copied into the
    engine's own parameter inside the call) passes views into the receive buffer, which
    saves a copy; pass False for a loader that keeps references (for instance one that
    buffers tensors to replay later), and it gets clones instead. ``expected_specs``, when
    given, is checked against the trainer's manifest in the handshake.
    """

    def __init__(
        self,
        load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object],
        copies_immediately: bool = True,
        expected_specs: Sequence[TensorSpec] | None = None,
    ) -> None:
        self._load_weights = load_weights
        self.keeps_references = not copies_immediately
        self._expected = list(expected_specs) if expected_specs is not None else None

    def local_specs(self) -> list[TensorSpec] | None:
        return self._expected

    def destinations(self, manifest: Manifest) -> list[torch.Tensor | None]:
        return [None] * len(manifest.specs)

    def consume(self, items: list[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            self._load_weights(iter(items))

    def direct_tensors(self, manifest: Manifest) -> None:
        return None

    def rebind(self, index: int, tensor: torch.Tensor) -> None:
        raise TypeError("LoadWeightsSink transforms tensors on load; it cannot take direct writes")
