"""A residual block: fused add + RMSNorm, then a mixer; returns (hidden, residual) separately.

Keeping hidden and residual apart (as mamba_ssm does) lets the next block fuse the residual add with its
norm. Every layer letter of a hybrid pattern is such a block around a different mixer:
M Mamba-2, * attention, - SwiGLU MLP, E MoE.
"""

from __future__ import annotations

import torch
from torch import nn

from models.args import ModelArgs
from models.norms import RMSNorm


def build_mixer(letter: str, args: ModelArgs, layer_id: int) -> nn.Module:
    if letter == "M":
        from models.mamba2.mixer import Mamba2Mixer

        return Mamba2Mixer(args, layer_id, args.n_layers)
    if letter == "*":
        from models.hybrid.attention import Attention

        return Attention(args, layer_id, args.n_layers)
    if letter == "-":
        from models.hybrid.mlp import MLP

        return MLP(args, layer_id, args.n_layers)
    if letter == "E":
        from models.hybrid.moe import MoE

        return MoE(args, layer_id, args.n_layers)
    raise ValueError(f"unknown layer letter {letter!r} in model.layer_pattern; use M, *, -, E and |")


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, letter: str = "M"):
        super().__init__()
        self.letter = letter
        self.residual_in_fp32 = args.residual_in_fp32
        self.norm = RMSNorm(args.d_model, eps=args.norm_eps)
        self.mixer = build_mixer(letter, args, layer_id)

    def forward(self, hidden_BSD: torch.Tensor, residual_BSD: torch.Tensor | None,
                seq_idx: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        normed_BSD, residual_BSD = self.norm.add_and_norm(hidden_BSD, residual_BSD, self.residual_in_fp32)
        return self.mixer(normed_BSD, seq_idx=seq_idx), residual_BSD
