"""A tiny language model, its FSDP2 (gloo, CPU) rank factory and the rank-side helpers.

The factories are module-level functions bound with ``functools.partial``, so Ray ships
them by reference (``tests`` is importable in the actors through PYTHONPATH).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
from torch import nn

from tests.helpers import loads_by_name


class TinyLM(nn.Module):
    """Embedding, a few MLP blocks, a head (optionally tied to the embedding), a buffer."""

    def __init__(self, vocab: int = 37, dim: int = 24, blocks: int = 2, tied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim + 1), nn.GELU(), nn.Linear(2 * dim + 1, dim)) for _ in range(blocks)
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        # Random like the weights (each seed its own), so a sync that skips the buffer is seen.
        self.register_buffer("scale", torch.rand(dim) + 0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(self.norm(x) * self.scale)  # type: ignore[no-any-return]


def plain_lm(seed: int = 0, dtype: torch.dtype = torch.float32, **shape: Any) -> nn.Module:
    torch.set_num_threads(1)
    torch.manual_seed(seed + 1000)  # different from the trainer's: a sync must change it
    return TinyLM(**shape).to(dtype)


def fsdp_lm(seed: int = 0, mixed: bool = False, **shape: Any) -> nn.Module:
    """One rank's model: joins the group from the rank's RankSpec, then shards with FSDP2.

    ``mixed`` shards only the blocks: the embedding, norm and head stay plain (replicated).
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(seed)
    model = TinyLM(**shape)
    for block in model.blocks:
        fully_shard(block)
    if not mixed:
        fully_shard(model)
    return model


def fsdp_lm_cuda(seed: int = 0, **shape: Any) -> nn.Module:
    """One rank of ranks sharing one GPU: gloo (NCCL refuses two ranks on one GPU) on a
    ``cuda`` mesh. CUDA is initialized (the model is built there) before the mesh exists,
    so DeviceMesh keeps device 0 instead of setting the device from ``LOCAL_RANK``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(seed)
    model = TinyLM(**shape).to("cuda")
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def perturb_shards(model: nn.Module, seed: int) -> None:
    """Each rank writes new random bits into its own shard (a stand-in for training that
    needs no collective): a sync must assemble every rank's part."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    gen = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    with torch.no_grad():
        for t in model.parameters():
            if not isinstance(t, DTensor):
                continue  # replicated: every rank must keep the same bits
            local = t.to_local()
            local.copy_(torch.randn(local.shape, generator=gen).to(local.dtype).to(local.device))


def local_shards_cpu(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.Tensor]]:
    """Every parameter and buffer as this rank holds it: (global offset, local part) on the
    CPU, with no collective (``full_tensor()`` of a CUDA DTensor over gloo kills the ranks
    in torch 2.11; weightsync's own gather goes through ``all_gather_into_tensor``)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = {}
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if isinstance(t, DTensor):
                _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
                out[name] = (tuple(offset), t.to_local().detach().cpu())
            else:
                out[name] = ((0,) * t.dim(), t.detach().cpu())
    return out


def full_state_cpu(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.cpu() for n, t in full_state(model).items()}


def state_cpu(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.cpu() for n, t in state(model).items()}


def train(model: nn.Module, steps: int, seed: int) -> float:
    """A few Adam steps on the same random batch on every rank (FSDP reduces the grads)."""
    opt = getattr(model, "_test_opt", None)
    if opt is None:
        opt = model._test_opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # type: ignore[assignment]
    gen = torch.Generator().manual_seed(seed)
    loss = torch.zeros(())
    for _ in range(steps):
        tokens = torch.randint(0, model.embed.num_embeddings, (4, 6), generator=gen)  # type: ignore[union-attr]
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer as a full tensor (``full_tensor()``: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        out = {}
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
        return out


def kinds(model: nn.Module) -> dict[str, str]:
    from torch.distributed.tensor import DTensor

    return {n: "dtensor" if isinstance(p, DTensor) else "plain" for n, p in model.named_parameters()}


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def tied(model: nn.Module) -> bool:
    return model.head.weight is model.embed.weight  # type: ignore[union-attr]


def rss_reset() -> int:
    """Hand free heap memory back (so a new allocation must grow the process), reset its peak
    resident size (Linux ``clear_refs``); returns the current size."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def rss_peak() -> int:
    """Peak resident bytes since :func:`rss_reset`."""
    return _status("VmHWM")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def add_buffer(model: nn.Module) -> None:
    model.register_buffer("extra", torch.ones(3))


def drop_buffer(model: nn.Module) -> None:
    del model._buffers["extra"]


def cast(model: nn.Module, dtype: torch.dtype) -> None:
    model.to(dtype)


def skew_scale(model: nn.Module) -> bool:
    """Make this rank's replica of the plain ``scale`` buffer differ (kept for
    :func:`unskew_scale`); True when it is a plain tensor (every rank holds it whole)."""
    from torch.distributed.tensor import DTensor

    scale = model.scale
    model._skew_saved = scale.detach().clone()  # type: ignore[assignment]
    with torch.no_grad():
        scale.add_(0.25)
    return not isinstance(scale, DTensor)


def unskew_scale(model: nn.Module) -> None:
    with torch.no_grad():
        model.scale.copy_(model._skew_saved)  # type: ignore[operator]


def shrink_shard(model: nn.Module, name: str, rows: int = 1) -> tuple[int, ...]:
    """Replace this rank's shard of parameter ``name`` by its first ``rows`` rows under the
    same global shape (kept for :func:`restore_shard`); returns the new local shape."""
    from torch.distributed.tensor import DTensor

    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    old = getattr(module, attr)
    model._shrunk = (module, attr, old)  # type: ignore[assignment]
    local = old.to_local()[:rows].detach().clone()
    new = DTensor.from_local(
        local, old.device_mesh, old.placements, run_check=False, shape=old.shape, stride=old.stride()
    )
    setattr(module, attr, nn.Parameter(new, requires_grad=old.requires_grad))
    return tuple(local.shape)


def restore_shard(model: nn.Module) -> None:
    module, attr, old = model._shrunk  # type: ignore[misc]
    setattr(module, attr, old)


def nudge_own(model: nn.Module, seed: int) -> None:
    """Run on every rank: about 2% of the elements each rank owns move (its rows of a sharded
    tensor; a replicated or plain tensor the same way on every rank), a sparse update."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            split = isinstance(t, DTensor) and not t.placements[0].is_replicate()
            local = t.to_local() if isinstance(t, DTensor) else t
            gen = torch.Generator().manual_seed(seed * 1000 + (dist.get_rank() if split else 0))
            flat = local.view(-1)
            picked = torch.rand(flat.numel(), generator=gen) < 0.02
            flat[picked] += torch.randn(int(picked.sum()), generator=gen).to(flat.dtype)


def loading_lm(seed: int = 0, **shape: Any) -> nn.Module:
    """:func:`plain_lm` that also loads the way engines do: ``load_weights`` by name."""
    model = plain_lm(seed, **shape)
    return loads_by_name(model, dict([*model.named_parameters(), *model.named_buffers()]))
