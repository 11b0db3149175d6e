"""A stand-in for an inference engine's Llama, loading weights the way engines do.

vLLM cannot be installed here. Its model classes keep q/k/v in one fused ``qkv_proj`` and
gate/up in one ``gate_up_proj``, and their ``load_weights(iterable of (name, tensor))``
maps each checkpoint name (Hugging Face layout) onto a slice of a fused parameter, skips
``lm_head`` when embeddings are tied, and copies. This module does the same, so the
load_weights sink is tested against that convention, not against a plain name lookup.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

# (fused parameter, checkpoint name part, shard) as engines list them.
STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class FusedAttention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q_size, self.kv_size = heads * self.head_dim, kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def shard(self, which: str) -> slice:
        start = {"q": 0, "k": self.q_size, "v": self.q_size + self.kv_size}[which]
        return slice(start, start + (self.q_size if which == "q" else self.kv_size))


class FusedMlp(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.inner = inner
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)


class Layer(nn.Module):
    def __init__(self, hidden: int, inner: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(hidden))
        self.self_attn = FusedAttention(hidden, heads, kv_heads)
        self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))
        self.mlp = FusedMlp(hidden, inner)


class EngineLlama(nn.Module):
    """Parameter layout of an engine's Llama (fused projections, tied head)."""

    def __init__(self, vocab: int, hidden: int, inner: int, layers: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Layer(hidden, inner, heads, kv_heads) for _ in range(layers))
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        self.loaded: list[str] = []

    @classmethod
    def like(cls, config: object) -> EngineLlama:
        c = config
        return cls(
            c.vocab_size,  # type: ignore[attr-defined]
            c.hidden_size,  # type: ignore[attr-defined]
            c.intermediate_size,  # type: ignore[attr-defined]
            c.num_hidden_layers,  # type: ignore[attr-defined]
            c.num_attention_heads,  # type: ignore[attr-defined]
            c.num_key_value_heads,  # type: ignore[attr-defined]
        )

    def _target(self, name: str) -> tuple[torch.Tensor, slice | None]:
        """The parameter (and row slice of it) that checkpoint tensor ``name`` loads into."""
        name = name.removeprefix("model.")
        for fused, part, shard in STACKED:
            if f".{part}." in name:
                owner = self.get_submodule(name.replace(f".{part}.weight", ""))
                param = getattr(owner, fused).weight
                if isinstance(shard, str):
                    return param, owner.shard(shard)  # type: ignore[operator]
                rows = owner.inner  # type: ignore[assignment]
                return param, slice(shard * rows, (shard + 1) * rows)  # type: ignore[operator]
        if name.endswith("layernorm.weight") or name == "norm.weight":
            path = name.removesuffix(".weight")
            module_path, _, attr = path.rpartition(".")
            owner = self.get_submodule(module_path) if module_path else self
            return getattr(owner, attr), None
        return self.get_parameter(name), None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name == "lm_head.weight":  # tied to the embedding: engines skip it
                    continue
                param, rows = self._target(name)
                (param if rows is None else param[rows]).copy_(tensor)
                loaded.add(name)
                self.loaded.append(name)
        return loaded

    def as_checkpoint(self) -> dict[str, torch.Tensor]:
        """This model's weights under Hugging Face names (fused tensors split back)."""
        out = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": self.norm}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}"
            attn, mlp = layer.self_attn, layer.mlp
            for part, shard in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
                out[f"{p}.self_attn.{part}.weight"] = attn.qkv_proj.weight[attn.shard(shard)]
            out[f"{p}.self_attn.o_proj.weight"] = attn.o_proj.weight
            out[f"{p}.mlp.gate_proj.weight"] = mlp.gate_up_proj.weight[: mlp.inner]
            out[f"{p}.mlp.up_proj.weight"] = mlp.gate_up_proj.weight[mlp.inner :]
            out[f"{p}.mlp.down_proj.weight"] = mlp.down_proj.weight
            out[f"{p}.input_layernorm.weight"] = layer.input_layernorm
            out[f"{p}.post_attention_layernorm.weight"] = layer.post_attention_layernorm
        return {k: v.detach().clone() for k, v in out.items()}
