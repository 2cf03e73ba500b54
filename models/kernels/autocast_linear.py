"""A linear layer under CUDA autocast whose float32 weight gets its gradient written in float32 by cuBLAS.

Under bf16 autocast with float32 weights (the trainer's single-GPU / DDP setting), nn.Linear casts the weight to bf16
for the product, and autograd casts the bf16 weight gradient back to float32 in a kernel of its own: at the 1.3B
shape a 17M-element cast per layer and step, 0.068 ms each (docs/ssd_sessions.md, session 17). torch.mm's out_dtype
writes the float32 gradient directly from the bf16 operands: one kernel fewer per layer, and the gradient is no longer
rounded to bf16 before the optimizer adds it. Everything else is what autocast's F.linear does: the product in the
autocast dtype, the input and the cast weight kept for the backward, the input gradient in the input's dtype.
With training.grad_dtype bfloat16 (the weight's grad_dtype, gradient_dtype below) the product writes the gradient in
bf16 instead: autocast's rounding, without its cast kernel.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from models.kernels.weight_copies import compute_weight

__all__ = [
    "autocast_linear",
    "gradient_dtype",
    "weight_grad",
    "mm_float32",
    "add_mm_float32_",
    "adds_into_float32",
    "float32_weight_grad_applies",
]


def mm_float32(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """a @ b [M, N] in float32: on CUDA with 16-bit operands cuBLAS accumulates and writes float32 directly (mm's
    out_dtype: no rounding to 16 bits, no cast kernel); elsewhere the product in the operands' dtype, then cast."""
    if a_MK.is_cuda and a_MK.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a_MK, b_KN, out_dtype=torch.float32)
    return (a_MK @ b_KN).float()


def add_mm_float32_(out_MN: torch.Tensor, a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """out (float32 [M, N]) += a @ b, the product in float32 as mm_float32's, without a float32 [M, N] temporary where
    cuBLAS adds into `out` itself (addmm with beta 1 and out_dtype float32, where this torch takes a float32 input
    with 16-bit factors); elsewhere mm_float32's product added in. The fused loss's chunks sum lm_head's weight
    gradient this way."""
    if a_MK.is_cuda and a_MK.dtype in (torch.bfloat16, torch.float16) and adds_into_float32(out_MN.device):
        return torch.addmm(out_MN, a_MK, b_KN, out_dtype=torch.float32, out=out_MN)
    return out_MN.add_(mm_float32(a_MK, b_KN))


@functools.cache
def adds_into_float32(device: torch.device) -> bool:
    """Whether this torch's CUDA addmm adds 16-bit factors' product into a float32 input (out_dtype float32): newer
    versions do, older ones want the input in the factors' dtype. Asked once per device, on a 2 x 2 product (one
    host sync, outside any CUDA-graph capture: the trainer's graph warms its step up eagerly first)."""
    try:
        acc = torch.ones(2, 2, device=device)
        ones16 = torch.ones(2, 2, device=device, dtype=torch.bfloat16)
        torch.addmm(acc, ones16, ones16, out_dtype=torch.float32, out=acc)  # 1 + 2 everywhere
        return bool((acc == 3).all())
    except (RuntimeError, TypeError, NotImplementedError):  # an older torch: no such overload, or not this dtype
        return False


def gradient_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype `weight`'s gradient is stored in: torch's per-tensor grad_dtype (training.grad_dtype sets bfloat16 on
    float32 linear weights, components/gradient_dtype.py), else the weight's own dtype. A product that writes its
    weight gradient in this dtype needs no cast kernel after it."""
    return getattr(weight, "grad_dtype", None) or weight.dtype


# A weight gradient of more rows than this, and not a multiple of it, runs as blocks of this many rows, then the
# rest, each product into its rows of one buffer: cuBLAS picks its kernel by shape, and at the 1.3B's in_proj (8,512
# rows) the whole product ran 805.7 us where 8,192 rows + the rest ran 760.5 (H100, session 69,
# benchmarks/bench_products.py), and end to end the 1.3B ran +0.44% / +0.59% faster in two alternating rounds.
# Every element is still one float32 sum of the same terms, rounded once. None: one product.
WEIGHT_GRAD_ROW_BLOCK: int | None = 8192


def _row_blocks(rows: int) -> list[tuple[int, int]] | None:
    block = WEIGHT_GRAD_ROW_BLOCK
    if not block or rows <= block or rows % block == 0:
        return None
    return [(start, min(start + block, rows)) for start in range(0, rows, block)]


def weight_grad(dy_MO: torch.Tensor, x_MI: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight gradient dy^T x [O, I] in `dtype`, the weight's gradient_dtype. For float32, float32
    from cuBLAS (mm_float32); for the operands' own 16-bit dtype the product as it comes (torch autocast's rounding).
    On CUDA a tall one runs in row blocks (WEIGHT_GRAD_ROW_BLOCK). Used by autocast_linear, norm_linear (in_proj) and
    the fused mixer's out_proj (split_conv1d_scan.py); the fused loss sums lm_head's in chunks (add_mm_float32_)."""
    sixteen_bit = dy_MO.dtype in (torch.bfloat16, torch.float16)
    blockable = dy_MO.is_cuda and sixteen_bit and dtype in (torch.float32, dy_MO.dtype)
    blocks = _row_blocks(dy_MO.shape[1]) if blockable else None
    if blocks is not None:
        out = torch.empty(dy_MO.shape[1], x_MI.shape[1], device=dy_MO.device, dtype=dtype)
        float32_out = {"out_dtype": torch.float32} if dtype == torch.float32 else {}  # cuBLAS writes float32 itself
        for start, stop in blocks:
            torch.mm(dy_MO[:, start:stop].t(), x_MI, out=out[start:stop], **float32_out)
        return out
    if dtype == torch.float32:
        return mm_float32(dy_MO.t(), x_MI)
    return (dy_MO.t() @ x_MI).to(dtype)


def float32_weight_grad_applies(x: torch.Tensor, weight: torch.Tensor, bias) -> bool:
    """CUDA autocast to a 16-bit dtype, a plain float32 weight (not a DTensor: FSDP2 / TP shards keep nn.Linear), no
    bias (Mamba-2's in_proj has none)."""
    return (
        x.is_cuda
        and bias is None
        and type(weight) is torch.nn.Parameter
        and weight.dtype == torch.float32
        and torch.is_autocast_enabled("cuda")
        and torch.get_autocast_dtype("cuda") in (torch.bfloat16, torch.float16)
    )


class _AutocastLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, dtype):
        x16, w16 = x.to(dtype), compute_weight(weight, dtype)  # the weight's current copy, else a cast
        ctx.save_for_backward(x16, w16)
        ctx.x_dtype, ctx.w_grad_dtype = x.dtype, gradient_dtype(weight)
        return F.linear(x16, w16)

    @staticmethod
    def backward(ctx, dy):
        x16, w16 = ctx.saved_tensors
        dy16 = dy.to(w16.dtype)
        dx = (dy16 @ w16).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = weight_grad(dy16.reshape(-1, dy16.shape[-1]), x16.reshape(-1, x16.shape[-1]), ctx.w_grad_dtype)
        return dx, dw, None


def autocast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) as autocast runs it; the float32 weight's gradient from cuBLAS in float32 where
    that applies (see the module docstring), F.linear itself everywhere else (the CPU, FSDP2's bf16 parameters, TP)."""
    if float32_weight_grad_applies(x, weight, bias):
        return _AutocastLinear.apply(x, weight, torch.get_autocast_dtype("cuda"))
    return F.linear(x, weight, bias)
