"""Delta encoding and applying on one GPU, timed against one raw device copy (no Ray, no vLLM).

The trainer's side and a worker's side of a delta sync, in one process: the size's policy
in bf16 on the GPU (the 8B-shaped ``16gb`` by default: 16.6 GB, 194 tensors), the trainer's
base (the bytes last sent) and a worker's copy, each a second and a third copy of the model.
Per round, about ``--changed`` of the elements move (a masked perturbation: new bf16 bits),
then, each timed with CUDA events and the device synchronized:

* raw copy: every tensor copied once (each in turn into a scratch as large as the largest),
  the bytes' floor for one pass;
* encode: ``Differ.diff_all`` (compare against the base, gather the changed elements, update
  the base): the trainer's work before anything moves;
* apply: every payload written into the worker's copy (what each worker does), and the
  worker's copy checked bit for bit against the model (not timed).

Prints each round and the medians as multiples of the raw copy (targets: encode within 2
raw copies, apply within 1)::

    python3 scripts/delta_gpu.py                       # 16gb, 3% changed, 5 rounds
    python3 scripts/delta_gpu.py --size 1gb --changed 0.01 --rounds 3
    python3 scripts/delta_gpu.py --torch-ops           # torch's ops instead of the kernels
    python3 scripts/delta_gpu.py --rounds 2 --profile  # and the kernels' times of one more round
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from weightsync.core.delta import cuda_kernels
from weightsync.core.delta.apply import apply_delta
from weightsync.core.delta.diff import Differ, TensorDiff
from weightsync.core.delta.encoding import Kind
from weightsync.core.delta.gpu_scatter import batched_scatters, check_scatters
from weightsync.core.wire.manifest import TensorSpec
from weightsync.tools.models import SIZES, PolicyConfig, build_policy


def timed(run: Callable[[], object]) -> tuple[float, float]:
    """Seconds ``run`` takes on the device, between two synchronizations, and seconds until
    its call returned on the host."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began = time.perf_counter()
    start.record()
    run()
    returned = time.perf_counter() - began
    end.record()
    torch.cuda.synchronize()
    return max(start.elapsed_time(end) / 1e3, 0.0) or time.perf_counter() - began, returned


def perturb(tensors: list[torch.Tensor], fraction: float, seed: int) -> None:
    """About ``fraction`` of every tensor's elements get new bits (two bf16 units in the last place)."""
    gen = torch.Generator(device=tensors[0].device).manual_seed(seed)
    for t in tensors:
        flat = t.view(-1)
        mask = torch.rand(flat.numel(), generator=gen, device=t.device) < fraction
        flat[mask] = flat[mask] + flat[mask].abs().clamp_min(1e-3) * 2**-6
        del mask


def one_round(
    differ: Differ,
    specs: list[TensorSpec],
    tensors: list[torch.Tensor],
    base: list[torch.Tensor],
    worker: list[torch.Tensor],
) -> tuple[float, float, float, int]:
    """Encode ``tensors`` against ``base``, apply the payloads to ``worker``, check it; (encode
    seconds, seconds until the encode's host call returned, apply seconds, bytes the
    payloads and dense tensors hold)."""
    diffs: list[TensorDiff] = []
    encode_s, encode_host = timed(lambda: diffs.extend(differ.diff_all(specs, tensors, base)))

    def apply() -> None:  # as a worker's module sink lands them: scatters launched together
        with batched_scatters():
            for index, (spec, got) in enumerate(zip(specs, diffs)):
                if got.kind is Kind.DENSE:
                    worker[index].copy_(base[index])
                elif got.payload is not None:
                    apply_delta(worker[index], spec, got.kind, got.count, got.payload)
        check_scatters()

    apply_s, _ = timed(apply)
    sent = sum(
        d.payload.numel() if d.payload is not None else (s.nbytes if d.kind is Kind.DENSE else 0)
        for d, s in zip(diffs, specs)
    )
    assert all(torch.equal(w, t) for w, t in zip(worker, tensors)), "the worker's copy differs from the model"
    return encode_s, encode_host, apply_s, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="16gb", choices=list(SIZES))
    parser.add_argument("--changed", type=float, default=0.03, help="fraction of the elements changed per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--torch-ops", action="store_true", help="time torch's ops instead of the CuPy kernels")
    parser.add_argument(
        "--profile", action="store_true", help="after the rounds, one more under torch.profiler: its kernels' times"
    )
    args = parser.parse_args()
    if args.torch_ops:
        cuda_kernels.kernels = lambda device: None  # type: ignore[assignment]
    device = torch.device("cuda", 0)
    print(
        f"{torch.cuda.get_device_name(device)}; kernels: {'CuPy kernels' if cuda_kernels.kernels(device) else 'torch ops'}",
        flush=True,
    )
    model = build_policy(PolicyConfig(**{**SIZES[args.size].__dict__, "dtype": "bfloat16"}), "cuda")
    tensors = [p.detach() for p in model.parameters()]
    specs = [TensorSpec(f"t{i}", tuple(t.shape), "bfloat16") for i, t in enumerate(tensors)]
    base = [t.clone() for t in tensors]
    worker = [t.clone() for t in tensors]
    nbytes = sum(s.nbytes for s in specs)
    print(f"{args.size}: {len(specs)} tensors, {nbytes / 1e9:.2f} GB of bf16", flush=True)
    differ = Differ()
    scratch = torch.empty(max(t.numel() for t in tensors), dtype=torch.bfloat16, device=device)
    rows: list[tuple[float, float, float, float]] = []
    for round_ in range(args.rounds + 1):  # the first round warms up (compiles, allocates)
        copy_s, _ = timed(lambda: [scratch[: t.numel()].copy_(t.view(-1)) for t in tensors])
        perturb(tensors, args.changed, round_)
        encode_s, host_s, apply_s, sent = one_round(differ, specs, tensors, base, worker)
        if round_:
            rows.append((copy_s, encode_s, apply_s, sent / nbytes))
            print(
                f"round {round_}: raw copy {copy_s * 1e3:.2f} ms, encode {encode_s * 1e3:.2f} ms "
                f"({encode_s / copy_s:.2f} copies; its host call returned at {host_s * 1e3:.2f} ms), "
                f"apply {apply_s * 1e3:.2f} ms ({apply_s / copy_s:.2f} copies), "
                f"payloads {sent / nbytes:.1%} of the bytes",
                flush=True,
            )
    copy_m, encode_m, apply_m, share = (statistics.median(c) for c in zip(*rows))
    print(
        f"median of {len(rows)}: raw copy {copy_m * 1e3:.2f} ms; encode {encode_m * 1e3:.2f} ms = "
        f"{encode_m / copy_m:.2f} raw copies (target 2); apply {apply_m * 1e3:.2f} ms = {apply_m / copy_m:.2f} "
        f"raw copies (target 1); payloads {share:.1%} of {nbytes / 1e9:.2f} GB at {args.changed:.1%} changed",
        flush=True,
    )
    if args.profile:
        perturb(tensors, args.changed, args.rounds + 1)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            one_round(differ, specs, tensors, base, worker)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)


if __name__ == "__main__":
    main()
