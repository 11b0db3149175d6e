"""Requests in flight on an ``AsyncLLM``: started, streamed to the end, collected by id, counted.

:class:`~weightsync.vllm.AsyncVLLMWorker` starts each request as an asyncio task on its
event loop; the task streams vLLM's outputs until the request ends. The tokens each stream
adds are counted as they arrive (``on_tokens``), which is how a staged sync knows how much
the engine generated while its transfer ran. Call order::

    ids = await requests.submit(llm, prompts, params, wait_first=True)  # each has its first output
    outs = await requests.collect(ids)                                  # their final outputs
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from weightsync import WeightSyncError


class Requests:
    """The requests one actor started, by id (each collected once)."""

    def __init__(self, name: str, timeout_s: float, on_tokens: Callable[[int], None]) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._on_tokens = on_tokens
        self._tasks: dict[str, asyncio.Task[Any]] = {}

    async def submit(
        self, llm: Any, prompts: Any, params: Any, wait_first: bool, error: type[Exception], adapter: Any = None
    ) -> list[str]:
        """Start one request per prompt (with LoRA adapter ``adapter``; None: the base model);
        with ``wait_first``, return once every one has its first output (so each is in
        flight), else at once. ``error`` is raised, naming the actor, when the first outputs
        do not come within ``timeout_s`` (the requests end)."""
        ids, firsts = [], []
        for prompt in [prompts] if isinstance(prompts, str) else list(prompts):
            request_id = f"weightsync-{uuid.uuid4().hex}"
            first = asyncio.Event()
            self._tasks[request_id] = asyncio.create_task(self._run(llm, prompt, params, request_id, first, adapter))
            ids.append(request_id)
            firsts.append(first)
        if wait_first:
            try:
                # set at the first output, or when the request ends without one
                await asyncio.wait_for(asyncio.gather(*(first.wait() for first in firsts)), self.timeout_s)
            except asyncio.TimeoutError:
                # The caller gets no ids to collect or cancel them by: they end here.
                for request_id in ids:
                    self._tasks.pop(request_id).cancel()
                raise error(
                    f"{self.name}: {len(ids)} request(s) had no first output within timeout_s={self.timeout_s:.0f}s "
                    "(a sync holding generation that long?); they were cancelled"
                ) from None
        return ids

    async def _run(
        self, llm: Any, prompt: Any, params: Any, request_id: str, first: asyncio.Event, adapter: Any
    ) -> Any:
        final = None
        # Tokens so far, per completion: outputs are cumulative unless the request asked for
        # deltas (vLLM's RequestOutputKind.DELTA), which are counted as they come.
        seen: dict[int, int] = {}
        deltas = getattr(getattr(params, "output_kind", None), "name", "") == "DELTA"
        try:
            async for out in llm.generate(prompt, params, request_id, lora_request=adapter):
                final = out
                first.set()
                added = 0
                for completion in out.outputs:
                    now = len(completion.token_ids)
                    added += now if deltas else now - seen.get(completion.index, 0)
                    seen[completion.index] = now
                self._on_tokens(added)
        finally:
            first.set()
        return final

    async def collect(self, request_ids: Sequence[str]) -> list[Any]:
        """The final ``RequestOutput`` of each request :meth:`submit` started, in order."""
        unknown = [i for i in request_ids if i not in self._tasks]
        if unknown:
            raise WeightSyncError(f"{self.name}: no submitted request has id(s) {unknown}; collect each once")
        tasks = [self._tasks.pop(i) for i in request_ids]
        return list(await asyncio.wait_for(asyncio.gather(*tasks), self.timeout_s))

    def cancel(self) -> None:
        for task in self._tasks.values():
            task.cancel()
