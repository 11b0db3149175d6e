"""The worker's side of one tensor in a delta sync: write a payload's values into a tensor.

:func:`apply_delta` writes the new bit patterns of the changed elements into a tensor
holding the base (the bytes of the last sync): in place, one write per changed element,
nothing allocated the size of the tensor. A payload that does not fit its tensor (indices
out of range, a mask whose bits do not count its values) is refused naming the tensor,
never written outside it. A held tensor that is not contiguous, or not of the wire dtype,
is patched through a contiguous copy of the wire dtype (what a dense sync's unpack would
have copied into it anyway).
"""

from __future__ import annotations

import torch

from weightsync.core.delta import cuda_kernels
from weightsync.core.delta.cpu_diff import bits_np
from weightsync.core.delta.cpu_kernels import kernels
from weightsync.core.delta.encoding import Kind, bits_of, index_dtype, layout
from weightsync.core.wire.errors import ManifestError
from weightsync.core.wire.manifest import TensorSpec


def payload_values(spec: TensorSpec, kind: Kind, count: int, payload: torch.Tensor) -> torch.Tensor:
    """The new bit patterns inside ``payload`` (a view), one per changed element."""
    lay = layout(spec, kind, count)
    if payload.numel() != lay.nbytes:
        raise ManifestError(
            f"delta payload of {spec.name!r}: {payload.numel()} bytes, its header says {lay.nbytes} ({kind.name}, "
            f"{count} element(s)); the two sides are out of step (set up again)"
        )
    itemsize = spec.torch_dtype.itemsize
    raw = payload[lay.values_offset : lay.values_offset + count * itemsize]
    bits = bits_of(torch.empty(0, dtype=spec.torch_dtype, device=payload.device)).dtype
    values = raw.view(bits)
    return values.view(-1, 2) if itemsize == 16 else values


def apply_delta(dest: torch.Tensor, spec: TensorSpec, kind: Kind, count: int, payload: torch.Tensor) -> None:
    """Write ``payload``'s changed elements into ``dest``, which holds ``spec``'s base bytes."""
    if kind is Kind.UNCHANGED:
        return
    if kind is Kind.DENSE:
        dest.copy_(payload.view(spec.torch_dtype).view(spec.shape))
        return
    if not dest.is_contiguous() or dest.dtype != spec.torch_dtype:
        held = dest.detach().to(spec.torch_dtype).contiguous()
        apply_delta(held, spec, kind, count, payload)
        dest.copy_(held)
        return
    values = payload_values(spec, kind, count, payload)
    positions = payload[: layout(spec, kind, count).positions_nbytes]
    target = bits_of(dest.detach())
    if kind is Kind.INDICES and _scatter_on_device(dest, spec, positions, values):
        return
    loops = kernels() if dest.device.type == "cpu" and spec.torch_dtype.itemsize < 16 else None
    if kind is Kind.INDICES:
        idx = positions.view(index_dtype(spec.numel))
        if loops is not None:
            bad = int(loops.scatter(bits_np(dest.detach()), idx.numpy(), bits_np(values), 0))
            if bad:
                raise ManifestError(
                    f"delta payload of {spec.name!r}: {bad} index(es) outside its {spec.numel} elements"
                )
            return
        idx = idx.long()
        if count and (int(idx.min()) < 0 or int(idx.max()) >= spec.numel):
            raise ManifestError(f"delta payload of {spec.name!r}: indices outside its {spec.numel} elements")
        target.index_copy_(0, idx, values)
        return
    if loops is not None:
        found = int(loops.scatter_masked(bits_np(dest.detach()), positions.numpy(), bits_np(values)))
    else:
        idx = mask_indices(positions, spec.numel)
        found = int((positions.numel() * 8 - spec.numel) and _stray_bits(positions, spec.numel)) + idx.numel()
        if found == count:
            target.index_copy_(0, idx, values)
    if found != count:
        raise ManifestError(
            f"delta payload of {spec.name!r}: its mask marks {found} element(s), its header says {count}; "
            "the two sides are out of step (set up again)"
        )


#: Indices outside their tensor found by the GPU scatter, per tensor name, read once by
#: :func:`check_scatters` (a sync of a GPU worker reads no count per tensor).
_pending: list[tuple[str, int, torch.Tensor]] = []


def _scatter_on_device(dest: torch.Tensor, spec: TensorSpec, positions: torch.Tensor, values: torch.Tensor) -> bool:
    """The GPU kernel's scatter, when it takes ``dest``; its check waits for :func:`check_scatters`."""
    found = cuda_kernels.kernels(dest.device) if dest.is_cuda else None
    if found is None or not cuda_kernels.fits(dest) or index_dtype(spec.numel) != torch.int32:
        return False
    bad = torch.zeros(1, dtype=torch.int64, device=dest.device)
    found.scatter(positions.view(torch.int32), values, bits_of(dest.detach()), bad)
    _pending.append((spec.name, spec.numel, bad))
    return True


def forget_scatters() -> None:
    """Drop what an earlier sync that failed midway left unchecked (its worker is dirty)."""
    _pending.clear()


def check_scatters() -> None:
    """Refuse, naming the tensors, payloads whose indices fell outside them (GPU scatters
    since the last call; nothing was written there). Called once a sync's payloads landed."""
    if not _pending:
        return
    held = list(_pending)
    _pending.clear()
    counts = torch.cat([b for _, _, b in held]).tolist()
    bad = [f"{name!r} ({n} outside its {numel} elements)" for (name, numel, _), n in zip(held, counts) if n]
    if bad:
        raise ManifestError(f"delta payloads with indices outside their tensors: {', '.join(bad)}")


def mask_indices(mask: torch.Tensor, numel: int) -> torch.Tensor:
    """The flat indices (int64, ascending) of the set bits of a payload's bitmask."""
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    bits = (mask.unsqueeze(1) >> shifts) & 1
    return bits.view(-1)[:numel].nonzero().view(-1)


def _stray_bits(mask: torch.Tensor, numel: int) -> int:
    """Bits set past the last element (in the mask's last byte)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    bits = (mask[-1:].unsqueeze(1) >> shifts) & 1
    return int(bits.view(-1)[numel - (mask.numel() - 1) * 8 :].sum())
