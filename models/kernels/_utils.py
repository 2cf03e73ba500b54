"""Small helpers shared by the references."""

from __future__ import annotations

import contextlib

import torch

# Device types torch.autocast accepts; others (meta, used for shape inference) have no autocast to turn off.
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def no_autocast(device: torch.device):
    """Disable autocast inside a reference: the GPU kernels ignore it and compute in float32 themselves."""
    if device.type in _AUTOCAST_DEVICES:
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def can_inspect_values(t: torch.Tensor) -> bool:
    """Whether a data-dependent check may read t's values (not on meta tensors, not while tracing for compile)."""
    return t.device.type != "meta" and not torch.compiler.is_compiling()
