"""torch.compile per block (the kernels are opaque custom calls; the glue around them fuses)."""

from __future__ import annotations

import torch
from torch import nn


def apply_compile(model: nn.Module) -> None:
    for name, block in list(model.layers.items()):
        model.layers[name] = torch.compile(block, fullgraph=False)
