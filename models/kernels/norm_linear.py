"""A block's residual add + RMSNorm and the linear layer after it (a Mamba-2 mixer's in_proj) as one autograd
Function that keeps no copy of the norm's output: model.recompute_in_proj_input.

Unfused, the norm keeps its new residual s (float32) and 1 / rms for its backward, and in_proj keeps its input, the
normed rows (bf16), for its weight gradient: 2 bytes x d_model per token and layer (64 MiB at the 1.3B's 4 x 4096, 3
GiB over its 48 layers). Here the backward runs in this order: in_proj's input gradient (dnormed = dout W), the
norm's backward (add_rmsnorm_triton's kernel, which reads s anyway and with WRITE_Y writes the normed rows again, s
rstd w rounded as the forward rounded them), then in_proj's weight gradient from those rows (float32 from cuBLAS, as
autocast_linear writes it). The cost is that one write per layer and step; the outputs and every gradient are bit for
bit the unfused pair's (tests/test_norm_linear.py), since s is the float32 sum the forward normed.

Where it applies (norm_linear_applies): CUDA tensors on our kernels, bf16 / fp16 autocast with a plain float32
linear weight without bias (autocast_linear's float32-gradient path: one GPU, DDP), and a float32 residual stream
(the recomputed rows equal the forward's only when s was not rounded). Imports triton at import time: import lazily.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.kernels._utils import no_autocast
from models.kernels.add_rmsnorm_triton import (
    as_rows,
    check_shapes,
    norm_backward,
    norm_forward,
    residual_dtype,
    unpack_row_scaled,
)
from models.kernels.autocast_linear import gradient_dtype, weight_grad
from models.kernels.weight_copies import compute_weight

__all__ = ["add_rmsnorm_linear_triton"]


class _AddRMSNormLinear(torch.autograd.Function):
    """(x, residual) -> (linear(rmsnorm(x + residual)) [..., out] in the compute dtype, new residual s)."""

    @staticmethod
    def forward(ctx, x, residual, norm_w, eps, residual_in_fp32, lin_w, compute_dtype, x_ss, x_n, x_eps):
        shape = x.shape
        res2 = None if residual is None else as_rows(residual)
        res_dtype = residual_dtype(x, residual, residual_in_fp32)
        normed, s, rstd, x_rstd = norm_forward(
            as_rows(x), res2, norm_w, eps, res_dtype, compute_dtype, x_ss, x_n, x_eps
        )
        w16 = compute_weight(lin_w, compute_dtype)  # the optimizer's current copy, else a cast
        out = F.linear(normed, w16)
        del normed  # not kept: the norm's backward writes it again
        ctx.save_for_backward(s, norm_w, rstd, x_rstd, w16)
        ctx.has_res, ctx.x_dtype, ctx.shape = residual is not None, x.dtype, shape
        ctx.lin_grad_dtype = gradient_dtype(lin_w)
        ctx.set_materialize_grads(False)
        return out.view(*shape[:-1], out.shape[-1]), s.view(shape)

    @staticmethod
    def backward(ctx, dout, dres_out):
        s, norm_w, rstd, x_rstd, w16 = ctx.saved_tensors
        M, D = s.shape
        needs = ctx.needs_input_grad
        dres2 = None if dres_out is None else as_rows(dres_out)
        if dout is None:  # the linear layer's output unused: only the residual's gradient flows
            dout2 = None
            dnormed = torch.zeros(M, D, device=s.device, dtype=w16.dtype)
        else:
            dout2 = dout.reshape(M, -1).to(w16.dtype)
            dnormed = dout2 @ w16  # the normed rows' gradient, in the compute dtype as autocast_linear gives it
        normed = torch.empty(M, D, device=s.device, dtype=w16.dtype) if dout2 is not None and needs[5] else None
        dx, dres, dnorm_w = norm_backward(dnormed, dres2, s, norm_w, rstd, x_rstd, ctx.x_dtype, ctx.has_res, normed)
        del dnormed
        dlin_w = None if normed is None else weight_grad(dout2, normed, ctx.lin_grad_dtype)
        dres = None if dres is None else dres.view(ctx.shape)
        return dx.view(ctx.shape), dres, dnorm_w, None, None, dlin_w, None, None, None, None


def add_rmsnorm_linear_triton(x, residual, norm_weight, eps, residual_in_fp32, lin_weight, compute_dtype):
    """(linear(normed) without bias [..., lin_weight.shape[0]] in compute_dtype, new residual): add_rmsnorm_triton
    followed by autocast_linear, with the normed rows recomputed by the norm's backward (module docstring). x may be
    a row_scale.RowScaled, as for add_rmsnorm_triton."""
    x, x_ss, x_n, x_eps = unpack_row_scaled(x)
    check_shapes(x, residual, norm_weight)
    if lin_weight.dim() != 2 or lin_weight.shape[1] != x.shape[-1]:
        raise ValueError(f"lin_weight must be [out, {x.shape[-1]}], got {tuple(lin_weight.shape)}")
    with no_autocast(x.device):
        return _AddRMSNormLinear.apply(
            x, residual, norm_weight.contiguous(), float(eps), residual_in_fp32, lin_weight, compute_dtype,
            x_ss, x_n, x_eps,
        )  # fmt: skip
