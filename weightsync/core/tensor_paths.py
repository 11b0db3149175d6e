"""The objects along the path to each named tensor of a module, recorded once so that a
per-sync check that the module still holds the same tensors costs a few lookups.

The trainer's endpoint (:mod:`weightsync.core.sender`), a PEFT adapter's source
(:mod:`weightsync.core.lora.peft_model`) and a worker's ``ModuleSink`` check their tensors
every sync: walking and naming every tensor costs more than the copies of a small model, so
they record the links once and look each up again.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import is_

import torch
from torch import nn


class TensorPaths:
    """The objects along the path to each named tensor of a module, for a cheap re-check.

    Each link (a module's ``_modules``, ``_parameters`` or ``_buffers`` entry) is recorded
    once; :meth:`unchanged` looks each up again. If every link still holds the same object,
    every name still reaches the same tensor object, without walking the module tree or
    building names (which costs more per sync than the copies of a small model).
    The number of entries in every module's tables is recorded too, so a tensor or module
    added anywhere is noticed, and so is each module's set of non-persistent buffers, so a
    buffer made persistent or non-persistent (which a full walk would add or drop) is too.
    A tensor object can still have been given new storage or a new dtype (``p.data = ...``):
    callers compare data pointers, shapes and dtypes for that.
    """

    def __init__(self, module: nn.Module, names: Sequence[str]) -> None:
        links: dict[tuple[int, str], tuple[dict[str, object], str, object]] = {}

        def follow(name: str) -> torch.Tensor:
            owner = module
            *path, leaf = name.split(".")
            for part in path:
                child = owner._modules[part]
                assert child is not None
                links[(id(owner._modules), part)] = (owner._modules, part, child)  # type: ignore[assignment]
                owner = child
            table = owner._parameters if leaf in owner._parameters else owner._buffers
            tensor = table[leaf]
            assert tensor is not None
            links[(id(table), leaf)] = (table, leaf, tensor)  # type: ignore[assignment]
            return tensor

        self.tensors = [follow(name) for name in names]
        # Every other name of a tied or shared tensor too: untying one (a new tensor under
        # the second name) must send the caller back to a full check.
        for alias, _ in module.named_parameters(remove_duplicate=False):
            follow(alias)
        for module_name, sub in module.named_modules(remove_duplicate=False):
            for buffer_name in sub._buffers:
                if buffer_name not in sub._non_persistent_buffers_set and sub._buffers[buffer_name] is not None:
                    follow(f"{module_name}.{buffer_name}" if module_name else buffer_name)
        # Kept as parallel lists so that :meth:`unchanged` runs its loops in C (``map``):
        # a per-sync Python loop over a few hundred links costs more than the lookups.
        recorded = list(links.values())
        self._tables = [table for table, _, _ in recorded]
        self._keys = [key for _, key, _ in recorded]
        self._objects = [obj for _, _, obj in recorded]
        # How many entries each module's tables hold: a tensor or module added anywhere
        # (which no recorded link would notice) changes one of these counts.
        self._counted = [table for sub in module.modules() for table in (sub._parameters, sub._buffers, sub._modules)]
        self._counts = [len(table) for table in self._counted]
        # Which buffers each module keeps out of its state: ``register_buffer(name, buffer,
        # persistent=...)`` on a registered name moves it in or out of the synced tensors
        # while every table keeps its objects and counts.
        self._transient = [sub._non_persistent_buffers_set for sub in module.modules()]
        self._transient_then = [frozenset(names) for names in self._transient]
        # ``nn.Module`` makes its tables plain dicts, whose ``get`` maps in C; a table of
        # another mapping type (set by hand) is looked up through its own ``get``.
        self._plain = all(type(table) is dict for table in self._tables)

    def unchanged(self) -> bool:
        if list(map(len, self._counted)) != self._counts or self._transient != self._transient_then:
            return False
        if self._plain:
            return all(map(is_, map(dict.get, self._tables, self._keys), self._objects))
        return all(table.get(key) is obj for table, key, obj in zip(self._tables, self._keys, self._objects))
