"""A tiny Llama checkpoint for the vLLM tests, written at test time (nothing downloads).

The tokenizer is a word-level one built here from a fixed word list and saved next to the
weights, so vLLM starts from the directory alone. Also: the trainer's model (the same
architecture with other weights, fp32), and the trainer's tensors in vLLM's fused layout,
for bit-exact comparison with what the engine holds.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

WORDS = (
    "the a cat dog bird sat ran flew on under over mat tree house red blue green big small one two three four "
    "five six seven eight nine ten and then it is was"
).split()
SPECIAL = ["<unk>", "<s>", "</s>"]
PROMPTS = ["the cat sat on the mat", "one two three four", "a big red dog ran under the tree"]
# head_dim 32: vLLM's CPU attention has no kernel for head_dim 16.
CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)


def llama_config(**overrides: object) -> object:
    import transformers

    settings = {**CONFIG, "vocab_size": len(SPECIAL) + len(WORDS), "bos_token_id": 1, "eos_token_id": 2, **overrides}
    return transformers.LlamaConfig(**settings)


def write_checkpoint(path: Path, seed: int = 0, **overrides: object) -> Path:
    """Tokenizer and bf16 weights for a tiny Llama, saved with ``save_pretrained``."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config(**overrides))
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def trainer_model(path: str, seed: int = 1) -> nn.Module:
    """The checkpoint's model in fp32 with other weights (seeded noise on every tensor)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def other_model(seed: int = 2) -> nn.Module:
    """A different model (one more layer, a wider MLP): the handshake must refuse it."""
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(num_hidden_layers=3, intermediate_size=320))


def fused_bf16(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's tensors cast to bf16, in vLLM's Llama layout (qkv_proj, gate_up_proj)."""
    hf = {n: t.detach().to(torch.bfloat16) for n, t in model.state_dict().items()}
    out = {"model.embed_tokens.weight": hf["model.embed_tokens.weight"], "model.norm.weight": hf["model.norm.weight"]}
    layers = model.config.num_hidden_layers  # type: ignore[union-attr]
    for i in range(layers):
        p = f"model.layers.{i}"
        a, m = f"{p}.self_attn", f"{p}.mlp"
        out[f"{a}.qkv_proj.weight"] = torch.cat([hf[f"{a}.{x}_proj.weight"] for x in "qkv"])
        out[f"{a}.o_proj.weight"] = hf[f"{a}.o_proj.weight"]
        out[f"{m}.gate_up_proj.weight"] = torch.cat([hf[f"{m}.gate_proj.weight"], hf[f"{m}.up_proj.weight"]])
        out[f"{m}.down_proj.weight"] = hf[f"{m}.down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{norm}.weight"] = hf[f"{p}.{norm}.weight"]
    return out


def prompt_logprobs(model: nn.Module, token_ids: list[int]) -> list[float]:
    """log p(token_k | tokens_<k) for k >= 1, with the model's weights cast to bf16 and
    computed in fp32."""
    import copy

    ref = copy.deepcopy(model).to(torch.bfloat16).to(torch.float32).eval()
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([token_ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[k - 1, token_ids[k]]) for k in range(1, len(token_ids))]


# --- functions run inside the vLLM worker processes (through VLLMWorker.collective_rpc) ---


def engine_params(worker: object) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's model, as the engine computes with it.

    vLLM's CPU build hands each linear layer's weight (and the tied ``lm_head``'s) to a
    oneDNN kernel after loading; linear layers keep only an empty Parameter. So every
    weight with a CPU kernel is read back through the kernel itself: ``cpu_linear(I)`` for
    the identity ``I`` is ``W^T`` exactly (each output is one bf16 product with 1.0,
    accumulated in fp32 with zeros). That also catches a kernel built from stale weights.
    """
    from vllm.model_executor.layers.linear import LinearBase

    model = worker.model_runner.get_model()  # type: ignore[attr-defined]
    out: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            kernel = getattr(module, "cpu_linear", None)
            if name == "weight" and (param.ndim == 2 or param.numel() == 0) and callable(kernel) and kernel is not torch.nn.functional.linear:
                width = module.input_size_per_partition if isinstance(module, LinearBase) else param.shape[1]
                eye = torch.eye(width, dtype=param.dtype)
                with torch.no_grad():
                    out[full] = kernel(eye, param, None).t().contiguous()
            else:
                out[full] = param.detach().cpu().clone()
    return out
