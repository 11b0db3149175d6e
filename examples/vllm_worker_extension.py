"""weightsync inside vLLM: a worker extension and an engine actor that forwards to it.

vLLM runs the model in its own worker processes and lets a user add methods to them with
``worker_extension_cls``; ``LLM.collective_rpc(method, args=...)`` calls such a method on
every worker. So:

* :class:`WeightSyncExtension` is mixed into each vLLM worker. It is a
  :class:`~weightsync.actors.WorkerMixin` whose sink is the model's own ``load_weights``
  (vLLM's convention: an iterable of ``(name, tensor)`` in Hugging Face names; the model
  fuses q/k/v and gate/up and shards as it loads).
* :class:`EngineActor` is the Ray actor the RLHF loop holds. It owns the ``LLM`` and
  forwards the coordinator's calls to the workers (``forward_worker_protocol``), so it
  drops into ``WeightSync`` like any worker::

      engine = EngineActor.options(num_gpus=1).remote("Qwen/Qwen2.5-0.5B")   # your model
      ws = WeightSync(trainer, {"vllm": engine})      # broadcast across GPUs, ipc on one
      ray.get(engine.sleep_generation.remote())       # pause generation (see below)
      ws.sync(version)
      ray.get(engine.wake_generation.remote())

What the engine must do around a sync: not generate while weights are being written (a
worker is RECEIVING from the start of its receive call to its commit). Ray runs one call at
a time on this actor, so a generate() call and a sync never overlap here; an engine with
its own request loop must pause it. Prefix caches built from the old weights should be
reset after the sync (``llm.reset_prefix_cache()``).

Limits: tensor parallel size 1 (with TP > 1 every rank would be its own weightsync worker;
``collective_rpc`` returns rank 0's answer only). The sink is ``load_weights``, so the
one-copy ``direct`` transport is not used: on a shared GPU weightsync picks ``ipc``.

vLLM itself is not installed on our machines, so this file is tested with a stand-in
engine that has the same shape (``tests/test_ecosystem.py``): an ``LLM``-like object with
``collective_rpc`` whose worker holds a fused-projection Llama with vLLM-style
``load_weights``. Nothing here imports vLLM until an ``EngineActor`` is created without an
``llm_factory``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from weightsync.actors import WorkerMixin, forward_worker_protocol
from weightsync.sinks import LoadWeightsSink


class WeightSyncExtension(WorkerMixin):
    """Mixed into every vLLM worker (``worker_extension_cls``). vLLM's worker provides
    ``self.model_runner.model`` and ``self.device``."""

    def weightsync_model(self) -> torch.nn.Module:
        return self.model_runner.model  # type: ignore[attr-defined, no-any-return]

    def weightsync_device(self) -> torch.device:
        return torch.device(getattr(self, "device", "cpu"))

    @property
    def weightsync_sink(self) -> LoadWeightsSink:
        sink = self.__dict__.get("_weightsync_sink")
        if sink is None:
            sink = LoadWeightsSink(self.weightsync_model().load_weights)  # type: ignore[operator]
            self.__dict__["_weightsync_sink"] = sink
        return sink


def _vllm_llm(model: str, **kwargs: Any) -> Any:
    from vllm import LLM  # imported only when a real engine is asked for

    return LLM(model=model, worker_extension_cls=f"{__name__}.WeightSyncExtension", **kwargs)


@forward_worker_protocol
class EngineActor:
    """Owns one vLLM engine; wrap with ``ray.remote`` (done below as ``RemoteEngine``).

    ``llm_factory`` builds the engine (default: ``vllm.LLM(model, worker_extension_cls=...)``).
    """

    def __init__(self, model: str = "", llm_factory: Callable[[], Any] | None = None, **llm_kwargs: Any) -> None:
        self.llm = llm_factory() if llm_factory is not None else _vllm_llm(model, **llm_kwargs)

    def forward_weightsync(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.llm.collective_rpc(method, args=args, kwargs=kwargs)[0]

    def generate(self, prompts: list[str], **sampling: Any) -> list[str]:
        from vllm import SamplingParams

        outputs = self.llm.generate(prompts, SamplingParams(**sampling))
        return [o.outputs[0].text for o in outputs]

    def pid(self) -> int:
        return os.getpid()


def main() -> int:
    """Sync a Hugging Face model into a vLLM engine on one GPU; needs vLLM and a GPU (checked first)."""
    import importlib.util

    import ray

    from weightsync import TrainerActor, WeightSync
    from weightsync.cluster import connect, missing_gpus

    if importlib.util.find_spec("vllm") is None:
        print("examples/vllm_worker_extension.py needs vLLM, which is not installed here: pip install vllm", flush=True)
        return 2
    connect()
    problem = missing_gpus(1, "examples/vllm_worker_extension.py")
    if problem:
        print(problem, flush=True)
        return 2
    name = os.environ.get("MODEL", "Qwen/Qwen2.5-0.5B-Instruct")

    def hf_model() -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)

    trainer = TrainerActor.options(num_gpus=0.5).remote(hf_model, device="cuda")
    engine = ray.remote(EngineActor).options(num_gpus=0.5).remote(name, gpu_memory_utilization=0.3)
    with WeightSync(trainer, {"vllm": engine}) as ws:
        print(ws.sync(1).summary())
        print(ray.get(engine.generate.remote(["The capital of France is"], max_tokens=8), timeout=600))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
