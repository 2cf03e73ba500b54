"""What every launcher of the SSD kernels shares: stand-ins for absent tensors and the dot precision per dtype."""

from __future__ import annotations

import torch

_DUMMIES: dict[torch.device, torch.Tensor] = {}


def dummy(device) -> torch.Tensor:
    """Stand-in pointer for an absent optional tensor (its kernel branch is compiled out, so it is never read or
    written): one per device, kept, since a layer's launches ask for ~12 of them and each allocation costs host time
    (the 370M step is host-bound, docs/performance.md). Not kept when first asked for inside a CUDA graph capture
    (it would live in the graph's memory pool)."""
    t = _DUMMIES.get(device)
    if t is None:
        t = torch.empty(1, device=device, dtype=torch.float32)
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            _DUMMIES[t.device] = t
            _DUMMIES[device] = t
    return t


def dot_precision(x: torch.Tensor) -> str:
    # float32 inputs: full-precision dots (tf32 keeps 10 mantissa bits; float32 runs are for checking, not speed);
    # bf16 / fp16 operands are exact products on the tensor cores anyway.
    return "ieee" if x.dtype == torch.float32 else "tf32"
