"""A small decoder-only transformer in plain torch, for the demo, the bench and tests.

Realistic layer shapes (embedding, attention projections, MLP, norms, tied output head)
at sizes from about 1 MB to 16 GB, so transfers see many tensors of varied sizes. Nothing
is downloaded: weights start random, and :func:`train_step` trains on synthetic tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class PolicyConfig:
    vocab: int = 4096
    dim: int = 384
    layers: int = 4
    heads: int = 6
    ffn: int = 1024
    dtype: str = "float32"
    seed: int = 0

    @property
    def approx_bytes(self) -> int:
        per_layer = 4 * self.dim * self.dim + 3 * self.dim * self.ffn + 2 * self.dim
        itemsize = torch.finfo(getattr(torch, self.dtype)).bits // 8
        return (self.vocab * self.dim + self.layers * per_layer + self.dim) * itemsize


#: Named sizes (fp32 unless noted): about 1 MB, 40 MB (the demo default), 115 MB, 270 MB,
#: 0.94 GB (bf16) and an 8B-shaped 16.6 GB (bf16: 194 tensors with q/k/v and gate/up fused,
#: a 1.05 GB embedding).
SIZES: dict[str, PolicyConfig] = {
    "1mb": PolicyConfig(vocab=256, dim=96, layers=2, heads=4, ffn=256),
    "30mb": PolicyConfig(vocab=4096, dim=384, layers=4, heads=6, ffn=1024),
    "100mb": PolicyConfig(vocab=8192, dim=576, layers=6, heads=8, ffn=1536),
    "256mb": PolicyConfig(vocab=16384, dim=1024, layers=4, heads=16, ffn=2816),
    "1gb": PolicyConfig(vocab=32000, dim=2048, layers=8, heads=16, ffn=5504, dtype="bfloat16"),
    "16gb": PolicyConfig(vocab=128256, dim=4096, layers=32, heads=32, ffn=14336, dtype="bfloat16"),
}


class Block(nn.Module):
    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.attn_norm = nn.RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = nn.RMSNorm(cfg.dim)
        self.gate_up = nn.Linear(cfg.dim, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, d))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class TinyPolicy(nn.Module):
    """Token embedding, ``layers`` blocks, final norm, output head tied to the embedding."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Built without its own random init (build_policy writes every weight): on the meta
        # device, nn.Embedding's normal_ init goes through torch._refs and imports torch._dynamo,
        # 0.8 s of every actor's start.
        self.embed = nn.Embedding(cfg.vocab, cfg.dim, _weight=torch.empty(cfg.vocab, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_policy(cfg: PolicyConfig, device: str | torch.device = "cpu") -> TinyPolicy:
    """A policy with seeded random weights (workers built with another seed start different)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)  # on the device: fast at 16 GB
    # Cast on the meta device, then materialize: the model's memory is allocated once, in
    # its own dtype (a 16 GB bf16 model never passes through 32 GB of fp32).
    with torch.device("meta"):
        model = TinyPolicy(cfg).to(getattr(torch, cfg.dtype))
    model = model.to_empty(device=device)
    model.head.weight = model.embed.weight  # to_empty gives each module its own tensor
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) * 0.02)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the fp32 draws above stay cached otherwise
    return model


class PolicyFactory:
    """A picklable zero-argument model factory (what actors are built from)."""

    def __init__(self, size: str = "30mb", seed: int = 0, device: str = "cpu", dtype: str | None = None) -> None:
        if size not in SIZES:
            raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
        held = SIZES[size].__dict__
        self.cfg = PolicyConfig(**{**held, "seed": seed, "dtype": dtype or held["dtype"]})
        self.device = device

    def __call__(self) -> TinyPolicy:
        return build_policy(self.cfg, self.device)


def synthetic_batch(
    cfg: PolicyConfig, step: int, batch: int = 8, length: int = 64, device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Token sequences with a learnable pattern (each token predicts the next arithmetically).

    The demo trains on one fixed batch (``step`` only varies it every 1000 steps), so a
    few steps visibly lower the loss, and the weights change at every step.
    """
    gen = torch.Generator().manual_seed(1000 + step // 1000)
    start = torch.randint(0, cfg.vocab, (batch, 1), generator=gen)
    stride = torch.randint(1, 7, (batch, 1), generator=gen)
    return ((start + stride * torch.arange(length + 1)) % cfg.vocab).to(device)


def train_step(model: TinyPolicy, step: int, lr: float = 3e-3) -> float:
    """One AdamW step on a synthetic batch; returns the loss. Runs inside the trainer actor."""
    opt = getattr(model, "_weightsync_demo_opt", None)
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        model._weightsync_demo_opt = opt  # type: ignore[assignment]
    device = next(model.parameters()).device
    tokens = synthetic_batch(model.cfg, step, device=device)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, model.cfg.vocab), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.item())
