"""What the bench runs inside the actors (through ``actor.call.remote(fn, ...)``).

Each function takes the actor's model first. Memory counters, the raw one-copy limit, and
the baselines' in-process halves: the object store's state dict, per-tensor CUDA IPC
handles, and the raw gloo broadcast.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch


def memory_reset(model: torch.nn.Module) -> int:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return int(torch.cuda.memory_allocated(device))
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets the peak resident size (VmHWM)
    return status_kb("VmRSS") * 1024


def memory_peak(model: torch.nn.Module) -> int:
    device = next(model.parameters()).device
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return status_kb("VmHWM") * 1024


def status_kb(key: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith(key))


def raw_copy_seconds(model: torch.nn.Module, nbytes: int, repeats: int) -> float:
    """One copy of a single ``nbytes`` buffer on the model's device: the one-copy limit."""
    device = next(model.parameters()).device
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()  # two model-sized buffers would stay reserved in the cache
    return statistics.median(times[1:])


def state_cpu(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from weightsync.core.sinks import module_tensors

    return {name: t.detach().cpu() for name, t in module_tensors(model)}


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> int:
    from weightsync.core.sinks import module_tensors

    held = dict(module_tensors(model))
    with torch.no_grad():
        for name, tensor in state.items():
            held[name].copy_(tensor, non_blocking=True)
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()
    return len(state)


def export_per_tensor(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """Naive CUDA IPC: a fresh export of every tensor, every sync."""
    from torch.multiprocessing.reductions import reduce_tensor

    from weightsync.core.sinks import module_tensors

    torch.cuda.synchronize()
    return [(name, reduce_tensor(t.detach())[1]) for name, t in module_tensors(model)]


def import_per_tensor(model: torch.nn.Module, handles: list[tuple[str, Any]]) -> int:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from weightsync.core.sinks import module_tensors

    held = dict(module_tensors(model))
    with torch.no_grad():
        for name, args in handles:
            args = list(args)
            args[6] = torch.cuda.current_device()
            held[name].copy_(rebuild_cuda_tensor(*args))
    torch.cuda.synchronize()
    return len(handles)


#: Per actor process: the raw-broadcast baseline's communicator, store and buffer.
_RAW: dict[str, Any] = {}


def gloo_join(model: torch.nn.Module, host: str, port: int, rank: int, world: int, timeout_s: float) -> None:
    from weightsync.mechanisms.gloo import GlooCommunicator

    _RAW["comm"] = GlooCommunicator(host, port, rank, world, "bench-raw", timeout_s, bind_host=host)


def gloo_open_store(model: torch.nn.Module, host: str, world: int, timeout_s: float) -> int:
    from weightsync.mechanisms.gloo import open_store

    _RAW["store"] = open_store(host, 0, world, timeout_s)
    return int(_RAW["store"].port)


def gloo_join_root(model: torch.nn.Module, host: str, world: int, timeout_s: float) -> None:
    from weightsync.mechanisms.gloo import GlooCommunicator

    _RAW["comm"] = GlooCommunicator(host, 0, 0, world, "bench-raw", timeout_s, bind_host=host, store=_RAW["store"])


def gloo_broadcast(model: torch.nn.Module, per_tensor: bool, nbytes: int, timeout_s: float) -> None:
    """Root and receivers alike: one buffer of ``nbytes``, or every tensor in turn.

    The buffer's pages are written once before it is sent: the kernel sends a buffer never
    written from its one shared zero page, faster than any real bytes (a 941 MB broadcast
    to 2 receivers on the 2-core machine: 405 ms against 493 ms), which made a limit no
    sync of real weights could reach."""
    from weightsync.core.sinks import module_tensors

    comm = _RAW["comm"]
    deadline = time.monotonic() + timeout_s
    if per_tensor:
        for _, tensor in module_tensors(model):
            comm.broadcast(tensor.detach(), 0).wait(deadline)
    else:
        buf = _RAW.get("buf")
        if buf is None or buf.numel() != nbytes:
            buf = _RAW["buf"] = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        comm.broadcast(buf, 0).wait(deadline)


def gloo_close(model: torch.nn.Module) -> None:
    comm = _RAW.pop("comm", None)
    if comm is not None:
        comm.close()
    _RAW.clear()


def nothing(model: torch.nn.Module, *_: Any) -> None:
    return None


def polling(model: torch.nn.Module, seconds: float) -> None:
    """Return after ``seconds``, polling the clock with the short sleeps a sync's waits use:
    a call as long as a copy, from a process that stays awake as a syncing party does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        time.sleep(20e-6)
