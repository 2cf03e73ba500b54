"""RMSNorm references with mamba_ssm's Triton semantics (gated / grouped, and fused add + RMSNorm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.kernels._utils import no_autocast

__all__ = ["rmsnorm_gated_ref", "add_rmsnorm_ref"]


def _compute_dtype(*ts: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def rmsnorm_gated_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor | None = None,
    eps: float = 1e-5,
    group_size: int | None = None,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """mamba_ssm RMSNormGated / rmsnorm_fn (no bias).

    norm_before_gate=False: rmsnorm(x * silu(z)) * weight; True: rmsnorm(x) * weight * silu(z).
    The mean square is taken per group of ``group_size`` channels (None = the whole last dim).
    Computed in float32 (float64 for float64 x), returned in x's dtype.
    """
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}] (x's last dim), got {tuple(weight.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    gs = dim if group_size is None else group_size
    if gs <= 0 or dim % gs:
        raise ValueError(f"group_size={group_size} must divide the normalized dim {dim}")
    cdt = _compute_dtype(x)
    with no_autocast(x.device):
        xf = x.to(cdt)
        gate = F.silu(z.to(cdt)) if z is not None else None
        if gate is not None and not norm_before_gate:
            xf = xf * gate
        xg = xf.unflatten(-1, (dim // gs, gs))
        y = (xg * torch.rsqrt(xg.square().mean(dim=-1, keepdim=True) + eps)).flatten(-2) * weight.to(cdt)
        if gate is not None and norm_before_gate:
            y = y * gate
    return y.to(x.dtype)


def add_rmsnorm_ref(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float = 1e-5,
    residual_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm, as mamba_ssm layer_norm_fn(..., prenorm=True, is_rms_norm=True).

    new_residual = x + residual (x alone when residual is None). Its dtype is residual's dtype when a
    residual is given, else float32 if residual_in_fp32, else x's dtype. The sum is formed in float32
    and the norm is taken of that unrounded sum (as the kernel does); normed comes back in x's dtype.
    """
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"weight must be [{dim}] (x's last dim), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    cdt = _compute_dtype(x, residual)
    if residual is not None:
        res_dtype = residual.dtype
    else:
        res_dtype = torch.float32 if residual_in_fp32 else x.dtype
    with no_autocast(x.device):
        s = x.to(cdt) if residual is None else x.to(cdt) + residual.to(cdt)
        normed = s * torch.rsqrt(s.square().mean(dim=-1, keepdim=True) + eps) * weight.to(cdt)
    return normed.to(x.dtype), s.to(res_dtype)
