"""Helpers for the vLLM tests: the tiny Llama checkpoint and trainer model come from the
example (one definition); here are a model the handshake must refuse, the trainer's tensors
in vLLM's fused layout, reference prompt log-probs, and the functions that run inside the
vLLM worker processes to read back what the engine holds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from examples.vllm_rlhf import PROMPTS, llama_config, trainer_model, write_checkpoint

__all__ = ["PROMPTS", "llama_config", "trainer_model", "write_checkpoint"]


def other_model(seed: int = 2) -> nn.Module:
    """A different model (one more layer, a wider MLP): the handshake must refuse it."""
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(num_hidden_layers=3, intermediate_size=320))


def fused_bf16(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's tensors cast to bf16, in vLLM's Llama layout (qkv_proj, gate_up_proj)."""
    return fused({n: t.detach() for n, t in model.state_dict().items()}, torch.bfloat16)


def fused(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A Hugging Face Llama state (parameters by name) cast to ``dtype``, in vLLM's Llama
    layout (qkv_proj, gate_up_proj); names outside it (lm_head, rotary buffers) are left out."""
    hf = {n: t.to(dtype) for n, t in state.items()}
    out = {"model.embed_tokens.weight": hf["model.embed_tokens.weight"], "model.norm.weight": hf["model.norm.weight"]}
    layers = 1 + max(int(n.split(".")[2]) for n in hf if n.startswith("model.layers."))
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


def fsdp_trainer_model(path: str, seed: int = 1) -> nn.Module:
    """One rank of a sharded trainer of :func:`trainer_model`: joins the rank's gloo group,
    then shards every decoder layer and the rest (embedding, norm, tied head) with FSDP2."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    model = trainer_model(path, seed)
    for layer in model.model.layers:  # type: ignore[union-attr]
        fully_shard(layer)
    fully_shard(model)
    return model


def nudge_shards(model: nn.Module, seed: int) -> None:
    """Each rank adds small seeded noise to its own shards (training, without a collective):
    a sync must assemble every rank's part."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    gen = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    with torch.no_grad():
        for t in model.parameters():
            assert isinstance(t, DTensor), "every parameter is sharded"
            local = t.to_local()
            local.add_(torch.randn(local.shape, generator=gen).to(local.dtype) * 0.02)


def model_from(state: dict[str, torch.Tensor]) -> nn.Module:
    """A Hugging Face Llama holding ``state`` (a gathered trainer's parameters)."""
    import transformers

    model = transformers.LlamaForCausalLM(llama_config())
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not [n for n in unexpected if "rotary" not in n], (
        missing,
        unexpected,
    )
    return model


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


def fail_receive_once(worker: Any, tp_rank: int, tensors: int) -> None:
    """On TP rank ``tp_rank`` only: the next sync's receive fails once ``tensors`` tensors
    reached the rank's sink (the rest of the engine receives normally), as a load that
    fails on one rank would; the sink works again afterwards."""
    endpoint = worker._weightsync_ep()
    if endpoint.tp_rank != tp_rank:
        return
    sink = endpoint.weightsync_sink
    consume = sink.consume
    seen = 0

    def failing(items: list[tuple[str, torch.Tensor]]) -> None:
        nonlocal seen
        seen += len(items)
        if seen >= tensors:
            del sink.consume
            raise RuntimeError(f"TP rank {tp_rank}: load failed after {seen} tensors (injected by the test)")
        consume(items)

    sink.consume = failing


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
            if (
                name == "weight"
                and (param.ndim == 2 or param.numel() == 0)
                and callable(kernel)
                and kernel is not torch.nn.functional.linear
            ):
                width = module.input_size_per_partition if isinstance(module, LinearBase) else param.shape[1]
                eye = torch.eye(width, dtype=param.dtype)
                with torch.no_grad():
                    out[full] = kernel(eye, param, None).t().contiguous()
            else:
                out[full] = param.detach().cpu().clone()
    return out


def tp_shard(
    full: dict[str, torch.Tensor], rank: int, tp: int, heads: int, kv_heads: int, vocab_rows: int
) -> dict[str, torch.Tensor]:
    """What TP rank ``rank`` of ``tp`` holds of the fused layout ``full`` (vLLM's Llama):
    column-parallel weights split by output rows (q/k/v by heads, gate/up each in half),
    row-parallel ones by input columns, the vocabulary padded to ``vocab_rows`` then split."""

    def rows(t: torch.Tensor, parts: int = tp) -> torch.Tensor:
        n = t.shape[0] // parts
        return t[rank * n : (rank + 1) * n]

    def cols(t: torch.Tensor) -> torch.Tensor:
        n = t.shape[1] // tp
        return t[:, rank * n : (rank + 1) * n]

    out = {}
    for name, t in full.items():
        if name.endswith("qkv_proj.weight"):
            head = t.shape[1] // heads  # hidden == heads * head_dim in these models
            q, k, v = t.split([heads * head, kv_heads * head, kv_heads * head])
            out[name] = torch.cat([rows(q), rows(k), rows(v)])
        elif name.endswith("gate_up_proj.weight"):
            gate, up = t.chunk(2)
            out[name] = torch.cat([rows(gate), rows(up)])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = cols(t)
        elif name == "model.embed_tokens.weight":
            padded = torch.zeros((vocab_rows, t.shape[1]), dtype=t.dtype)
            padded[: t.shape[0]] = t
            out[name] = rows(padded)
        else:
            out[name] = t
    return out


# --- LoRA: a PEFT trainer of the checkpoint, and next-token log-probs ---------------------

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_llama(path: str, seed: int = 1, r: int = 8, alpha: float = 16.0) -> nn.Module:
    """The checkpoint's model in fp32 (its bf16 weights exactly, the engine's base) with a
    LoRA adapter on every linear layer of the decoder; lora_B starts random from ``seed``
    (PEFT starts it at zero), so the adapter changes the model before any training."""
    import peft
    import transformers

    base = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=LORA_TARGETS, lora_dropout=0.0)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def prompt_prefixes(path: str) -> list[list[int]]:
    """Every prefix of each prompt, as token ids: the next-token log-probs after each are
    the prompt's log-probs (and, after the whole prompt, those of what would follow it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    out = []
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        out += [ids[:k] for k in range(1, len(ids) + 1)]
    return out


def next_token_logprobs(model: nn.Module, prefixes: list[list[int]]) -> list[torch.Tensor]:
    """Per prefix, log p(every token | prefix), with the model's weights (its adapter's too)
    cast to bf16 and computed in fp32."""
    import copy

    ref = copy.deepcopy(model).to(torch.bfloat16).to(torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(ref(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1) for ids in prefixes]


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's adapter as PEFT saves it, copied."""
    import peft

    return {n: t.clone() for n, t in peft.get_peft_model_state_dict(model, save_embedding_layers=False).items()}


def train_adapter(model: nn.Module, step: int) -> float:
    """A few SGD steps towards one sentence (only the adapter has gradients)."""
    from transformers import AutoTokenizer

    from examples.vllm_rlhf import TARGET, train_towards

    tok = AutoTokenizer.from_pretrained(model.base_model.model.name_or_path)  # type: ignore[union-attr]
    return train_towards(model, tok(TARGET)["input_ids"], steps=3, lr=0.3 + 0.1 * step)


def fail_adapter_receive_once(worker: Any) -> None:
    """The next sync's receive fails on this rank once its first tensors reached the sink
    (as a transfer that breaks midway would); the sink works again afterwards."""
    sink = worker._weightsync_ep()._ws_receiver.sink
    consume = sink.consume

    def failing(items: list[tuple[str, torch.Tensor]]) -> None:
        consume(items)
        del sink.consume
        raise RuntimeError(f"the adapter's transfer broke after {len(items)} tensors (injected by the test)")

    sink.consume = failing


def gated_trainer_class() -> type:
    """A TrainerHost whose ``ws_send`` waits, while a gate is set, until the gate's file
    exists: a test holds a sync in flight (the workers receiving) for as long as it needs."""
    import os
    import time

    from weightsync.glue.actors import TrainerHost

    class GatedTrainerHost(TrainerHost):
        gate: str | None = None

        def set_gate(self, path: str | None) -> None:
            self.gate = path

        def ws_send(self, call: Any) -> Any:
            deadline = time.monotonic() + 300
            while self.gate is not None and not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.01)
            return super().ws_send(call)

    return GatedTrainerHost
