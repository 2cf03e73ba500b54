"""Fused residual add + RMSNorm in Triton, forward and backward: model.kernels "auto" / "triton" on CUDA.

add_rmsnorm_ref's contract (mamba_ssm's layer_norm_fn with prenorm=True, is_rms_norm=True, no bias):
new_residual = x + residual, formed in float32 and stored in the residual's dtype (float32 with residual_in_fp32
when there is none yet, else x's); normed = new_residual * rstd * weight in x's dtype, taken of the unrounded sum.
One difference: under CUDA autocast a float32 x (the first block's input, the embedding's output) gets its normed
output in autocast's dtype, the rounding the product that consumes it would do (so no cast kernel before in_proj and
none of its input gradient back to float32: ~0.18 ms of a 1.3B step on an H100, docs/ssd_sessions.md session 51).

Why our own: the block's pre-norm runs once per layer each way, and mamba_ssm's kernel pair cost ~0.87 ms of host
time per layer and step (autograd Function, autotuner, ~25 launch arguments; H100, docs/performance.md) where the
370M step is host-bound. These kernels take a handful of arguments, no autotuner: one program per row forward, and
two programs per SM backward, each walking every programs-th row with the next rows' loads in flight and summing its
rows' weight gradient in float32.
Imports triton at import time: import this module lazily (ops.add_rmsnorm does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels._utils import no_autocast, rows_in_flight, sm_count, warps_for_row
from models.kernels.column_sums import column_sums
from models.kernels.fast_launch import fast_launch, next_power_of_2
from models.kernels.pdl import pdl_prologue
from models.kernels.row_scale import RowScaled

__all__ = ["add_rmsnorm_triton"]


@triton.jit
def row_rstd_of_parts(SS, row, J, n, eps, BLOCK_J: tl.constexpr):
    """rsqrt(sum of row `row`'s J parts of SS [rows, J] / n + eps), float32 (row_scale.row_rstd in Triton)."""
    parts = tl.arange(0, BLOCK_J)
    total = tl.sum(tl.load(SS + row * J + parts, mask=parts < J, other=0.0), axis=0)
    return 1.0 / tl.sqrt(total / n + eps)


@fast_launch
@triton.jit
def _add_rmsnorm_fwd_kernel(X, RES, W, Y, RES_OUT, RSTD, stride_x, stride_res, D, eps, X_SS, X_RSTD, J, x_n, x_eps,
                            HAS_RES: tl.constexpr, BLOCK: tl.constexpr, X_SCALED: tl.constexpr = False,
                            BLOCK_J: tl.constexpr = 1, PDL: tl.constexpr = False):  # fmt: skip
    """Row `row`: s = x (times the row's scale with X_SCALED: row_scale.py's RowScaled, its rstd also stored to
    X_RSTD for the backward) + residual; the new residual s and rmsnorm(s) w."""
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    s = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if X_SCALED:
        x_rstd = row_rstd_of_parts(X_SS, row, J, x_n, x_eps, BLOCK_J)
        tl.store(X_RSTD + row, x_rstd)
        s = s * x_rstd
    if HAS_RES:
        s += tl.load(RES + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(RES_OUT + row * D + cols, s.to(RES_OUT.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / D + eps)
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * D + cols, (s * rstd * w).to(Y.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _add_rmsnorm_bwd_kernel(DY, S, W, RSTD, DRES_OUT, DX, DRES, DW_PART, stride_dy, stride_dres_out, M, D, X_RSTD,
                            Y, HAS_DRES_OUT: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                            STAGES: tl.constexpr, X_SCALED: tl.constexpr = False, WRITE_Y: tl.constexpr = False,
                            PDL: tl.constexpr = False):  # fmt: skip
    """Rows pid, pid + programs, ...: dx = rstd (w dy - s_hat mean(s_hat w dy)) (+ the new residual's own gradient),
    written to DX (x's dtype; times x's row scale with X_SCALED) and DRES (the residual's); this program's sum of
    dy * s_hat to DW_PART. With WRITE_Y also the forward's normed output s_hat w to Y (bit for bit the forward's
    where S holds the float32 sum it normed: norm_linear.py). The rows' loads are software-pipelined (STAGES rows in
    flight), as in the gated norm's backward (gated_rmsnorm_triton.py)."""
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first, step = pid.to(tl.int64), programs.to(tl.int64)  # row offsets in int64: M * D may pass 2^31
    for i in tl.range(0, tl.cdiv(M - pid, programs), num_stages=STAGES):
        row = first + i * step
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        s_hat = tl.load(S + row * D + cols, mask=mask, other=0.0).to(tl.float32) * rstd
        if WRITE_Y:
            tl.store(Y + row * D + cols, (s_hat * w).to(Y.dtype.element_ty), mask=mask)
        wdy = w * dy
        dx = (wdy - s_hat * (tl.sum(s_hat * wdy, axis=0) / D)) * rstd
        if HAS_DRES_OUT:
            dx += tl.load(DRES_OUT + row * stride_dres_out + cols, mask=mask, other=0.0).to(tl.float32)
        if X_SCALED:
            tl.store(DX + row * D + cols, (dx * tl.load(X_RSTD + row)).to(DX.dtype.element_ty), mask=mask)
        else:
            tl.store(DX + row * D + cols, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_RES:
            tl.store(DRES + row * D + cols, dx.to(DRES.dtype.element_ty), mask=mask)
        dw += dy * s_hat
    tl.store(DW_PART + pid * D + cols, dw, mask=mask)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [M, D] with a contiguous last dim (a view where possible)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


# Backward launch shape: programs per SM, and rows in flight per program (None: from the row's bytes,
# _utils.rows_in_flight). H100, session 20, 1.3B shape: 2 programs per SM 0.203 ms, 1 program 0.225 (3 rows in
# flight; 2 rows 0.259, 4 rows 0.211, none 0.295); the previous loop (contiguous rows, 4 programs per SM, no
# pipelining) 0.245; mamba_ssm's 0.398.
_BWD_PROGRAMS_PER_SM = 2
_BWD_STAGES: int | None = None
# Elements of a row per thread, each way (the warps follow from the row's width, 1 to 16). Fewer threads per row
# spend fewer instructions on each row's addresses and sum at the same bytes (sm_90 SASS, 1.3B's rows of 2048: 26 -> 18
# instructions per element forward, 26 -> 19 in the backward's loop): H200, session 38, forward + backward 144.9 mJ
# per call at 16 each against 153.7-154.3 at 8 (0.242 ms either way); 32 each 148.0; 4 programs per SM 149-153.
_FWD_ELEMS_PER_THREAD = 16
_BWD_ELEMS_PER_THREAD = 16


def _backward_programs(M: int, device: torch.device) -> int:
    """Programs of the backward (each sums its rows' weight gradient), never more than rows."""
    return max(1, min(M, _BWD_PROGRAMS_PER_SM * sm_count(device)))


def norm_forward(x2, res2, weight, eps, res_dtype, out_dtype, x_ss=None, x_n=1, x_eps=0.0):
    """The forward kernel on rows: x2 [M, D] (and res2 [M, D] or None) -> (normed [M, D] in out_dtype, new residual
    s [M, D] in res_dtype, rstd [M] float32, x's row scale [M] float32 or None). x_ss: x's rows' sums of squares in
    parts (a RowScaled's), else None."""
    M, D = x2.shape
    y = torch.empty(M, D, device=x2.device, dtype=out_dtype)
    s = torch.empty(M, D, device=x2.device, dtype=res_dtype)
    rstd = torch.empty(M, device=x2.device, dtype=torch.float32)
    x_rstd = None if x_ss is None else torch.empty(M, device=x2.device, dtype=torch.float32)
    block = next_power_of_2(D)
    _add_rmsnorm_fwd_kernel[(M,)](
        x2, res2 if res2 is not None else x2, weight, y, s, rstd,
        x2.stride(0), res2.stride(0) if res2 is not None else 0, D, eps,
        x_ss if x_ss is not None else rstd, x_rstd if x_rstd is not None else rstd,
        x_ss.shape[1] if x_ss is not None else 1, x_n, x_eps,
        HAS_RES=res2 is not None, BLOCK=block, X_SCALED=x_ss is not None,
        BLOCK_J=next_power_of_2(x_ss.shape[1]) if x_ss is not None else 1,
        num_warps=warps_for_row(block, _FWD_ELEMS_PER_THREAD),
    )  # fmt: skip
    return y, s, rstd, x_rstd


def norm_backward(dy2, dres2, s, weight, rstd, x_rstd, x_dtype, has_res, y_out=None):
    """The backward kernel on rows: (dx [M, D] in x_dtype, the residual's gradient [M, D] in s's dtype or None,
    the weight's gradient in its dtype); dres2: the new residual's own gradient or None. y_out ([M, D]): where to
    write the forward's normed output again (norm_linear.py), else None."""
    M, D = s.shape
    dx = torch.empty(M, D, device=s.device, dtype=x_dtype)
    dres = torch.empty(M, D, device=s.device, dtype=s.dtype) if has_res else None
    programs = _backward_programs(M, s.device)
    dw_part = torch.empty(programs, D, device=s.device, dtype=torch.float32)
    block = next_power_of_2(D)
    row_bytes = D * (dy2.element_size() + s.element_size() + (dres2.element_size() if dres2 is not None else 0))
    stages = rows_in_flight(row_bytes, _BWD_STAGES)
    _add_rmsnorm_bwd_kernel[(programs,)](
        dy2, s, weight, rstd, dres2 if dres2 is not None else dy2, dx, dres if dres is not None else dx, dw_part,
        dy2.stride(0), dres2.stride(0) if dres2 is not None else 0, M, D, x_rstd if x_rstd is not None else rstd,
        y_out if y_out is not None else dx,
        HAS_DRES_OUT=dres2 is not None, HAS_RES=dres is not None, BLOCK=block, STAGES=stages,
        X_SCALED=x_rstd is not None, WRITE_Y=y_out is not None,
        num_warps=warps_for_row(block, _BWD_ELEMS_PER_THREAD),
    )  # fmt: skip
    return dx, dres, column_sums(dw_part).to(weight.dtype)


def residual_dtype(x, residual, residual_in_fp32: bool) -> torch.dtype:
    """The new residual's dtype: the residual's, else float32 with residual_in_fp32, else x's."""
    return residual.dtype if residual is not None else (torch.float32 if residual_in_fp32 else x.dtype)


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, residual_in_fp32, out_dtype, x_ss, x_n, x_eps):
        shape = x.shape
        res2 = None if residual is None else as_rows(residual)
        y, s, rstd, x_rstd = norm_forward(
            as_rows(x), res2, weight, eps, residual_dtype(x, residual, residual_in_fp32), out_dtype, x_ss, x_n, x_eps
        )
        ctx.save_for_backward(s, weight, rstd, x_rstd)
        ctx.has_res, ctx.x_dtype, ctx.shape = residual is not None, x.dtype, shape
        # An unused output (norm_f's new residual) then reaches backward as None, not as a zero tensor autograd fills
        # (a 128 MiB float32 fill and its read at the 1.3B shape, session 51's trace)
        ctx.set_materialize_grads(False)
        return y.view(shape), s.view(shape)

    @staticmethod
    def backward(ctx, dy, dres_out):
        s, weight, rstd, x_rstd = ctx.saved_tensors
        M, D = s.shape
        dy2 = as_rows(dy) if dy is not None else torch.zeros(M, D, device=s.device, dtype=ctx.x_dtype)
        dres2 = None if dres_out is None else as_rows(dres_out)
        dx, dres, dw = norm_backward(dy2, dres2, s, weight, rstd, x_rstd, ctx.x_dtype, ctx.has_res)
        dres = None if dres is None else dres.view(ctx.shape)
        return dx.view(ctx.shape), dres, dw, None, None, None, None, None, None


def unpack_row_scaled(x):
    """(values, sumsq parts or None, n, eps) of a RowScaled x (its parts checked), else (x, None, 1, 0.0)."""
    if not isinstance(x, RowScaled):
        return x, None, 1, 0.0
    x_ss = x.sumsq_parts
    if x_ss.dim() != 2 or x_ss.shape[0] != x.values.numel() // x.values.shape[-1] or x_ss.dtype != torch.float32:
        raise ValueError(f"RowScaled.sumsq_parts must be float32 [rows, J], got {x_ss.dtype} {tuple(x_ss.shape)}")
    return x.values, x_ss.contiguous(), int(x.n), float(x.eps)


def check_shapes(x, residual, weight) -> None:
    """weight [D], residual x's shape, a row that fits one program: before any kernel runs."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight must be [{D}] (x's last dim), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if next_power_of_2(D) > 65536 // x.element_size():
        raise ValueError(
            f"add_rmsnorm_triton: a row of {D} elements does not fit one program (64 KB); use model.kernels=reference"
        )


def add_rmsnorm_triton(x, residual, weight, eps=1e-5, residual_in_fp32=False):
    """(normed, new_residual): see the module docstring and models.kernels.norm_reference.add_rmsnorm_ref. x may be
    a row_scale.RowScaled (its rows scaled as they are read; the gradient returned for its values is the scaled
    rows' times the scale: row_scale.py's contract)."""
    x, x_ss, x_n, x_eps = unpack_row_scaled(x)
    check_shapes(x, residual, weight)
    out_dtype = x.dtype
    if x.dtype == torch.float32 and x.is_cuda and torch.is_autocast_enabled("cuda"):
        out_dtype = torch.get_autocast_dtype("cuda")  # (module docstring)
    with no_autocast(x.device):
        return _AddRMSNorm.apply(
            x, residual, weight.contiguous(), float(eps), residual_in_fp32, out_dtype, x_ss, x_n, x_eps
        )
