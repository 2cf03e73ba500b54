"""A block's output whose rows still carry their gated norm's 1 / rms: `RowScaled(values, sumsq_parts, n, eps)` stands
for values * rsqrt(sumsq_parts.sum(-1) / n + eps) per row (model.fuse_gate_into_scan; split_conv1d_scan.py).

Why: the Mamba-2 mixer's gated RMSNorm, out = rmsnorm(y silu(z)) w, is a row scale times y silu(z) w, and out_proj
is linear, so out_proj(out) = rstd * out_proj(y silu(z) w) row by row. The chunk scan then writes v = y silu(z) w
and the rows' sums of (y silu(z))^2 in parts beside y (chunk_scan.gate_store), out_proj takes v, and the next
block's add + RMSNorm multiplies each row by its rstd as it reads it: the norm's forward pass over y and z (and its
launch) is gone (H100, 1.3B shapes: chunk scan + norm 339 us against 299 us for the scan with the gate, session 51).

The contract: `sumsq_parts` is not differentiable; every consumer applies the scale exactly as
`materialize()` does (the add + RMSNorm kernels, or materialize() itself where a plain tensor is needed: a pipeline
stage's output, another norm backend). The gradient that reaches `values` is then the gradient of the scaled rows
times rstd, and the mixer's backward, which knows what it returned, takes it as that (split_conv1d_scan.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["RowScaled", "row_rstd", "materialize"]


class RowScaled(NamedTuple):
    values: torch.Tensor  # [..., D]: the rows before their scale
    sumsq_parts: torch.Tensor  # [rows, J] float32: each row's sum of squares in J parts (not differentiable)
    n: int  # the norm's width: rstd = rsqrt(sum / n + eps)
    eps: float

    def materialize(self) -> torch.Tensor:
        """values * rstd per row, in values' dtype (the gradient flows to values only)."""
        rstd = row_rstd(self.sumsq_parts, self.n, self.eps)
        rows = self.values.reshape(-1, self.values.shape[-1])
        return (rows.float() * rstd[:, None]).to(self.values.dtype).view(self.values.shape)


def row_rstd(sumsq_parts: torch.Tensor, n: int, eps: float) -> torch.Tensor:
    """[rows] float32: rsqrt(sum of the row's parts / n + eps) (the kernels' row_rstd_of_parts, in PyTorch)."""
    return torch.rsqrt(sumsq_parts.detach().sum(-1) / n + eps)


def materialize(hidden) -> torch.Tensor:
    """A plain tensor for a block's output: RowScaled's scaled rows, any tensor as it is."""
    return hidden.materialize() if isinstance(hidden, RowScaled) else hidden
