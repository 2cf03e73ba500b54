"""A residual block: fused add + RMSNorm, then a mixer; returns (hidden, residual) separately.

Keeping hidden and residual apart (as mamba_ssm does) lets the next block fuse the residual add with its
norm. With model.fuse_gate_into_scan a Mamba-2 mixer's hidden output may be a models.kernels.row_scale.RowScaled
(its rows' gated-norm scale still to apply), which the next block's norm (or norm_f, or a pipeline stage's packing)
applies as it reads it. Every layer letter of a hybrid pattern is such a block around a different mixer:
M Mamba-2, * attention, - SwiGLU MLP, E MoE.
"""

from __future__ import annotations

import torch
from torch import nn

from models.args import ModelArgs
from models.hybrid.attention import Attention
from models.hybrid.mlp import MLP
from models.hybrid.moe import MoE
from models.kernels import ops
from models.mamba2.mixer import Mamba2Mixer
from models.norms import RMSNorm


def build_mixer(letter: str, args: ModelArgs, layer_id: int) -> nn.Module:
    if letter == "M":
        return Mamba2Mixer(args, layer_id, args.n_layers)
    if letter == "*":
        return Attention(args, layer_id, args.n_layers)
    if letter == "-":
        return MLP(args, layer_id, args.n_layers)
    if letter == "E":
        return MoE(args, layer_id, args.n_layers)
    raise ValueError(f"unknown layer letter {letter!r} in model.layer_pattern; use M, *, -, E and |")


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, letter: str = "M"):
        super().__init__()
        self.letter = letter
        self.residual_in_fp32 = args.residual_in_fp32
        self.recompute_in_proj_input = args.recompute_in_proj_input and letter == "M"
        self.norm = RMSNorm(args.d_model, eps=args.norm_eps)
        self.mixer = build_mixer(letter, args, layer_id)

    def _norm_and_in_proj(self, hidden_BSD, residual_BSD) -> bool:
        """Whether this forward runs the norm and the Mamba mixer's in_proj as one Function that keeps no copy of the
        normed rows (model.recompute_in_proj_input, where ops.add_rmsnorm_linear_applies)."""
        return (
            self.recompute_in_proj_input
            and self.mixer.cp is None
            and ops.add_rmsnorm_linear_applies(
                hidden_BSD,
                residual_BSD,
                self.mixer.in_proj.weight,
                self.mixer.in_proj.bias,
                self.residual_in_fp32,
                backend=self.norm.backend,
            )
        )

    def forward(
        self, hidden_BSD: torch.Tensor, residual_BSD: torch.Tensor | None, seq_idx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._norm_and_in_proj(hidden_BSD, residual_BSD):
            zxbcdt, residual_BSD = ops.add_rmsnorm_linear(
                hidden_BSD, residual_BSD, self.norm.weight, self.norm.eps, self.residual_in_fp32,
                self.mixer.in_proj.weight,
            )  # fmt: skip
            return self.mixer.forward_from_in_proj(zxbcdt, seq_idx=seq_idx), residual_BSD
        normed_BSD, residual_BSD = self.norm.add_and_norm(hidden_BSD, residual_BSD, self.residual_in_fp32)
        if residual_BSD is hidden_BSD:
            # The first block (no residual yet, fp32) would return its own input as the residual. Under FSDP2
            # that input is a view (FSDP's pre-forward autograd function returns its inputs as views), and FSDP
            # warns at every such forward that an output is a view. A copy, freed at the next block's add.
            residual_BSD = residual_BSD.clone()
        return self.mixer(normed_BSD, seq_idx=seq_idx), residual_BSD

    # Recurrent decoding (models.inference). Mixers with state between tokens (Mamba-2, attention) have
    # prefill / step methods that read and write their entry of the cache; MLP and MoE are per token.
    @property
    def keeps_state(self) -> bool:
        return hasattr(self.mixer, "allocate_inference_cache")

    def prefill(self, hidden_BSD, residual_BSD, cache, seq_idx=None) -> tuple[torch.Tensor, torch.Tensor]:
        normed_BSD, residual_BSD = self.norm.add_and_norm(hidden_BSD, residual_BSD, self.residual_in_fp32)
        if self.keeps_state:
            return self.mixer.prefill(normed_BSD, cache, seq_idx=seq_idx), residual_BSD
        return self.mixer(normed_BSD, seq_idx=seq_idx), residual_BSD

    def step(self, hidden_B1D, residual_B1D, cache) -> tuple[torch.Tensor, torch.Tensor]:
        normed_B1D, residual_B1D = self.norm.add_and_norm(hidden_B1D, residual_B1D, self.residual_in_fp32)
        if self.keeps_state:
            return self.mixer.step(normed_B1D, cache), residual_B1D
        return self.mixer(normed_B1D), residual_B1D
