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

from weightsync.core.delta.cpu_diff import bits_np
from weightsync.core.delta.cpu_kernels import kernels
from weightsync.core.delta.encoding import Kind, Layout, bits_dtype, bits_of, index_dtype, layout
from weightsync.core.delta.gpu_scatter import scatter_on_device, unbatched
from weightsync.core.wire.errors import ManifestError
from weightsync.core.wire.manifest import TensorSpec


def payload_values(spec: TensorSpec, kind: Kind, count: int, payload: torch.Tensor) -> torch.Tensor:
    """The new bit patterns inside ``payload`` (a view), one per changed element."""
    return _values(spec, layout(spec, kind, count), payload)


def _values(spec: TensorSpec, lay: Layout, payload: torch.Tensor) -> torch.Tensor:
    if payload.numel() != lay.nbytes:
        raise ManifestError(
            f"delta payload of {spec.name!r}: {payload.numel()} bytes, its header says {lay.nbytes} "
            f"({lay.kind.name}, {lay.count} element(s)); the two sides are out of step (set up again)"
        )
    itemsize = spec.torch_dtype.itemsize
    values = payload[lay.values_offset : lay.values_offset + lay.count * itemsize].view(bits_dtype(spec.torch_dtype))
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
        with unbatched():  # read back at once: its scatter cannot wait for a batch
            apply_delta(held, spec, kind, count, payload)
        dest.copy_(held)
        return
    lay = layout(spec, kind, count)
    values = _values(spec, lay, payload)
    positions = payload[: lay.positions_nbytes]
    if kind is Kind.INDICES and dest.is_cuda and scatter_on_device(dest, spec, positions, values):
        return
    target = bits_of(dest.detach())
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
