"""RMSNorm modules whose math lives in models.kernels.ops (fused Triton kernels on CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from models.kernels import ops


class RMSNorm(nn.Module):
    """Plain RMSNorm (weight only). `add_and_norm` is the fused residual add that blocks use."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.backend = "auto"

    def add_and_norm(self, hidden, residual, residual_in_fp32: bool):
        """(hidden, residual) -> (rmsnorm(hidden + residual), hidden + residual); residual None means zero."""
        return ops.add_rmsnorm(
            hidden, residual, self.weight, eps=self.eps, residual_in_fp32=residual_in_fp32, backend=self.backend
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_and_norm(x, None, residual_in_fp32=False)[0]


class GatedRMSNorm(nn.Module):
    """mamba_ssm's RMSNormGated: rmsnorm(x * silu(z)) per group (or rmsnorm(x) * silu(z))."""

    def __init__(self, dim: int, eps: float = 1e-5, group_size: int | None = None, norm_before_gate: bool = False):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))
        self.backend = "auto"

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        return ops.rmsnorm_gated(
            x,
            self.weight,
            z=z,
            eps=self.eps,
            group_size=self.group_size,
            norm_before_gate=self.norm_before_gate,
            backend=self.backend,
        )
