"""SwiGLU feed-forward layer ('-' in a hybrid layer pattern): y = w2(silu(w1 x) * w3 x).

A "mixer": MLP(args, layer_id, n_layers), forward(x_BSD, seq_idx=None) -> y_BSD (seq_idx is unused: the MLP
is per token). Also the shared expert of MoE layers (hidden_dim given explicitly).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.args import ModelArgs


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def mlp_hidden_dim(args: ModelArgs) -> int:
    """mlp_hidden_dim, or 8/3 * d_model (the SwiGLU size with a 4x MLP's parameter count) rounded up to 64."""
    return args.mlp_hidden_dim or round_up(int(8 * args.d_model / 3), 64)


def swiglu_init_(full: torch.Tensor, weight: str, n_layers: int, generator, owner: str) -> None:
    """Normal(0, 0.02) for w1 / w3; w2, the residual branch's output, scaled by 1/sqrt(2 * n_layers) (GPT-2)."""
    if weight not in ("w1", "w2", "w3"):
        raise KeyError(f"{owner}.init_param: unknown parameter {weight!r}")
    std = 0.02 / math.sqrt(2 * n_layers) if weight == "w2" else 0.02
    nn.init.normal_(full, mean=0.0, std=std, generator=generator)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, n_layers: int, hidden_dim: int | None = None):
        super().__init__()
        self.n_layers = n_layers
        hidden = hidden_dim or mlp_hidden_dim(args)
        self.w1 = nn.Linear(args.d_model, hidden, bias=False)  # gate
        self.w3 = nn.Linear(args.d_model, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, args.d_model, bias=False)  # down

    @torch.no_grad()
    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full (unsharded) tensor of parameter `name` (relative to this module) in place."""
        if not name.endswith(".weight"):
            raise KeyError(f"MLP.init_param: unknown parameter {name!r}")
        swiglu_init_(full, name.removesuffix(".weight"), self.n_layers, generator, "MLP")

    def forward(self, x_BSD: torch.Tensor, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_BSD)) * self.w3(x_BSD))
