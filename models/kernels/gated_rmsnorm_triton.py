"""Gated, grouped RMSNorm in Triton, forward and backward without autograd: the fused mixer's norm halves.

rmsnorm_gated_ref's semantics (mamba_ssm's rmsnorm_fn, no bias): norm_before_gate=False: out = rmsnorm(y * silu(z))
* w; True: out = rmsnorm(y) * w * silu(z); the mean square per group of group_size channels, all in float32, out in
y's dtype. The contract is cuda.gated_rmsnorm_forward / gated_rmsnorm_backward's (split_conv1d_scan.py calls them):
rows [M, D] with a contiguous last dim and any row stride (z and dz are slices of zxbcdt / dzxbcdt), rstd float32
[groups * M] at group * M + row (mamba_ssm's layout; only our forward and backward read it).

Why our own: the backward runs once per layer and step over the SSD output, and mamba_ssm's (one program per SM, one
row at a time) moves its ~805 MB at 2.1 TB/s at the 1.3B shape (0.380 ms, H100). Ours runs one program per SM too,
each taking every programs-th row with the next rows' loads in flight (cp.async into shared memory: the loop software
pipelined by Triton, _utils.rows_in_flight) while it works on the current one, and summing its rows' weight gradient
in float32 registers into one [programs, D] buffer: 0.292 ms (2.75 TB/s) at the 1.3B shape, 0.155 ms (2.6 TB/s) at
the 370M (mamba_ssm's 0.219), where a plain copy of the same strided rows takes 0.278 / 0.142 ms (bench_norm.py). The
forward is one program per (row, group), as fast as mamba_ssm's. A handful of launch arguments and no autotuner: the
370M step is host-bound.
Imports triton at import time: import this module lazily (cuda.kernel_halves does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels._utils import no_autocast, rows_in_flight, sm_count, warps_for_row
from models.kernels.add_rmsnorm_triton import row_rstd_of_parts
from models.kernels.column_sums import column_sums
from models.kernels.fast_launch import cdiv, fast_launch, next_power_of_2
from models.kernels.fast_math import fast_on_this_backend, sigmoid
from models.kernels.pdl import pdl_prologue

__all__ = ["gated_rmsnorm_fwd", "gated_rmsnorm_bwd", "rmsnorm_gated_triton", "rmsnorm_gated_blocks_triton"]

# Launch shapes (bench_norm.py --tune times others): backward programs per SM (1 beat 2, 4 and 8 on an H100: 0.292
# against 0.302+ ms at the 1.3B shape), elements of a row per thread (num_warps follows from the block, at most 16;
# 4, 8 and 16 within 1% in time), rows in flight per program (the loop's software-pipelining stages; None: from the
# row's bytes, _utils.rows_in_flight); the forward's elements per thread. In joules (H200, session 38, 1.3B shape,
# with the fast sigmoid): backward 16 elements per thread 132.7 mJ per call against 135.4 with 8 (137.4 before the
# fast sigmoid), 139.4 with 32 at 2 or 4 programs per SM; forward 8, 16, 32 within 1% (67.3, 67.5, 66.6; 68.4 before).
_BWD_PROGRAMS_PER_SM = 1
_BWD_ELEMS_PER_THREAD = 16
_BWD_STAGES: int | None = None
_FWD_ELEMS_PER_THREAD = 8
_FAST_SIGMOID = True  # the gate's sigmoid from the approximate MUFU instructions on the GPU (fast_math.py)


def _fast() -> bool:
    return _FAST_SIGMOID and fast_on_this_backend()


@triton.jit
def _y_cols(cols, stride_yk, Y_COLS: tl.constexpr):
    """Where columns `cols` of a row of y lie from the row's start: y dense in its columns ([M, D] rows), or with
    Y_COLS > 0 in column blocks of Y_COLS, block k at k * stride_yk ([K, M, D / K]: context parallel's all-to-all
    delivers a token's channels as one block per rank, and the norm reads them there instead of after a copy)."""
    # One return: Triton's compiler visits the statement after a constexpr `if` that returned, and two returns of
    # different types (int64 here, int32 there) fail to compile (the interpreter, running Python, cannot see it).
    if Y_COLS > 0:
        offs = (cols // Y_COLS).to(tl.int64) * stride_yk + cols % Y_COLS  # int64: a block may start past 2^31
    else:
        offs = cols
    return offs


@fast_launch
@triton.jit
def _gated_rmsnorm_fwd_kernel(Y, Z, W, OUT, RSTD, stride_y, stride_yk, stride_z, M, N, eps,
                              NORM_BEFORE_GATE: tl.constexpr, Y_COLS: tl.constexpr, BLOCK: tl.constexpr,
                              FAST: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """One (row, group): the group's N channels of y and z in, out and 1 / rms out."""
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    cols = group * N + offs
    y = tl.load(Y + row * stride_y + _y_cols(cols, stride_yk, Y_COLS), mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    gate = z * sigmoid(z, FAST)  # the backward's recomputed output needs the same sigmoid: fast_math's
    x = y if NORM_BEFORE_GATE else y * gate
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + group * M + row, rstd)
    out = x * rstd * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if NORM_BEFORE_GATE:
        out *= gate
    tl.store(OUT + row * (N * tl.num_programs(1)) + cols, out.to(OUT.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def _gated_rmsnorm_bwd_kernel(DOUT, Y, Z, W, RSTD, DY, DZ, OUT, DW_PART, stride_dout, stride_y, stride_yk, stride_dyk,
                              stride_z, stride_dz, M, N, SS, J, eps, NORM_BEFORE_GATE: tl.constexpr,
                              RECOMPUTE: tl.constexpr, STAGES: tl.constexpr, Y_COLS: tl.constexpr, BLOCK: tl.constexpr,
                              FAST: tl.constexpr, SCALED: tl.constexpr = False, BLOCK_J: tl.constexpr = 1,
                              PDL: tl.constexpr = False):  # fmt: skip
    """Rows pid, pid + programs, ... of one group: with x the normalised input (y * silu(z), or y) and
    x_hat = x * rstd, dx = rstd (w g - x_hat mean(x_hat w g)) where g is out's gradient before the gate (dout, or
    dout * silu(z)); dy and dz from dx (or g) through the gate; this program's sum of g * x_hat to DW_PART.
    SCALED (the forward left its division by the rms to the next norm: row_scale.py; norm after the gate, one
    group): DOUT holds u = dout * rstd, rstd comes from the rows' sums of squares SS, dx = w u - x_hat mean(x_hat w
    u) (the same dx), the weight gradient's terms are u * x (x = y silu(z), the same sum) and the recomputed output
    is x * w (out / rstd: out_proj's input in that forward)."""
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    pid = tl.program_id(0)
    group = tl.program_id(1)
    D = N * tl.num_programs(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    cols = group * N + offs
    y_cols = _y_cols(cols, stride_yk, Y_COLS)
    # dy in y's layout: dense [M, D], or dense [K, M, Y_COLS] blocks (stride_dyk = M * Y_COLS)
    dy_cols = _y_cols(cols, stride_dyk, Y_COLS)
    dy_row = Y_COLS if Y_COLS > 0 else D
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    programs = tl.num_programs(0)
    first, step = pid.to(tl.int64), programs.to(tl.int64)  # row offsets in int64: M * stride may pass 2^31
    for i in tl.range(0, tl.cdiv(M - pid, programs), num_stages=STAGES):
        row = first + i * step
        g = tl.load(DOUT + row * stride_dout + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + row * stride_y + y_cols, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            rstd = row_rstd_of_parts(SS, row, J, N, eps, BLOCK_J)
        else:
            rstd = tl.load(RSTD + group * M + row)
        sig = sigmoid(z, FAST)
        gate = z * sig
        # What stays live across the row's sum is kept small (x_hat, w g and, gate first, the two factors that turn
        # the sum's result into dy and dz): 16 float32 values per thread and array at the 1.3B width.
        if NORM_BEFORE_GATE:
            x_hat = y * rstd
            normed = x_hat * w
            if RECOMPUTE:
                tl.store(OUT + row * D + cols, (normed * gate).to(OUT.dtype.element_ty), mask=mask)
            dz = g * normed * sig * (1.0 + z * (1.0 - sig))  # d silu(z) / dz = sig (1 + z (1 - sig))
            tl.store(DZ + row * stride_dz + cols, dz.to(DZ.dtype.element_ty), mask=mask)
            g *= gate
        else:
            xg = y * gate
            x_hat = xg * rstd
            if RECOMPUTE:
                tl.store(OUT + row * D + cols, ((xg if SCALED else x_hat) * w).to(OUT.dtype.element_ty), mask=mask)
            y_dgate = y * sig * (1.0 + z * (1.0 - sig))
        if SCALED:
            dw += g * xg
        else:
            dw += g * x_hat
        wg = w * g
        dx = wg - x_hat * (tl.sum(x_hat * wg, axis=0) / N)
        if not SCALED:
            dx = dx * rstd
        if NORM_BEFORE_GATE:
            tl.store(DY + row * dy_row + dy_cols, dx.to(DY.dtype.element_ty), mask=mask)
        else:
            tl.store(DZ + row * stride_dz + cols, (dx * y_dgate).to(DZ.dtype.element_ty), mask=mask)
            tl.store(DY + row * dy_row + dy_cols, (dx * gate).to(DY.dtype.element_ty), mask=mask)
    tl.store(DW_PART + pid * D + cols, dw, mask=mask)


def _launch_shape(M: int, D: int, group_size: int, elem_size: int, device: torch.device) -> tuple[int, int, int, int]:
    """(groups, block, warps for the backward, backward programs along the rows) after the checks."""
    if group_size <= 0 or D % group_size:
        raise ValueError(f"group_size={group_size} must divide the normalized dim {D}")
    block = next_power_of_2(group_size)
    if block > 65536 // elem_size:
        raise ValueError(f"gated RMSNorm: a group of {group_size} channels does not fit one program (64 KB)")
    groups = D // group_size
    warps = warps_for_row(block, _BWD_ELEMS_PER_THREAD)
    programs = max(1, min(M, cdiv(_BWD_PROGRAMS_PER_SM * sm_count(device), groups)))
    return groups, block, warps, programs


def _check_rows(name: str, t: torch.Tensor, M: int, D: int) -> None:
    if t.shape != (M, D) or t.stride(-1) != 1:
        raise ValueError(f"{name} must be [{M}, {D}] with a contiguous last dim, got {tuple(t.shape)} {t.stride()}")


def _check_weight(weight_D: torch.Tensor, D: int) -> None:
    if weight_D.shape != (D,) or weight_D.stride(0) != 1:
        raise ValueError(f"weight must be a contiguous [{D}], got {tuple(weight_D.shape)} {weight_D.stride()}")


def _y_layout(y: torch.Tensor) -> tuple[int, int, int, int, int]:
    """(M, D, row stride, block stride, columns per block or 0) of y: rows [M, D], or [K, M, D / K] column blocks
    (block k holds columns k * D / K ..., each block's rows any stride, its last dim contiguous)."""
    if y.dim() == 3:
        K, M, d = y.shape
        if y.stride(-1) != 1:
            raise ValueError(f"y blocks must have a contiguous last dim, got {tuple(y.shape)} {y.stride()}")
        return M, K * d, y.stride(1), y.stride(0), d
    if y.dim() != 2:
        raise ValueError(f"y must be rows [M, D] or column blocks [K, M, D / K], got {tuple(y.shape)}")
    M, D = y.shape
    _check_rows("y", y, M, D)
    return M, D, y.stride(0), 0, 0


def gated_rmsnorm_fwd(y_MD, weight_D, z_MD, eps: float, group_size: int, norm_before_gate: bool):
    """Gated, grouped RMSNorm of rows [M, D] (last dim contiguous, rows any stride): (out [M, D] in y's dtype,
    rstd [groups * M] float32, group-major). y may also come as column blocks [K, M, D / K] (_y_layout)."""
    M, D, stride_y, stride_yk, y_cols = _y_layout(y_MD)
    _check_rows("z", z_MD, M, D)
    _check_weight(weight_D, D)
    groups, block, _, _ = _launch_shape(M, D, group_size, y_MD.element_size(), y_MD.device)
    out = torch.empty(M, D, device=y_MD.device, dtype=y_MD.dtype)
    rstd = torch.empty(groups * M, device=y_MD.device, dtype=torch.float32)
    _gated_rmsnorm_fwd_kernel[(M, groups)](
        y_MD, z_MD, weight_D, out, rstd, stride_y, stride_yk, z_MD.stride(0), M, group_size, eps,
        NORM_BEFORE_GATE=norm_before_gate, Y_COLS=y_cols, BLOCK=block, FAST=_fast(),
        num_warps=warps_for_row(block, _FWD_ELEMS_PER_THREAD),
    )  # fmt: skip
    return out, rstd


def gated_rmsnorm_bwd(
    dout_MD, y_MD, weight_D, z_MD, rstd, eps, group_size, norm_before_gate, dz_MD, recompute, sumsq_parts=None
):
    """Gradients of gated_rmsnorm_fwd: (dy in y's dtype and layout (dense [M, D], or dense [K, M, D / K] blocks for
    blocked y), dweight [D] in weight's dtype, the normed output recomputed [M, D] or None). dz goes into dz_MD (rows
    any stride, last dim contiguous). eps is not read: rstd is the forward's. With sumsq_parts ([M, J] float32, the
    rows' sums of (y silu(z))^2 in parts: chunk_scan.gate_store) the forward was the row-scaled one (row_scale.py;
    rstd None, eps read, norm after the gate, one group): dout_MD then holds the gradient of out_proj's input times
    rstd, and the recomputed output is y silu(z) w (the kernel's SCALED)."""
    scaled = sumsq_parts is not None
    if scaled and (norm_before_gate or group_size != y_MD.shape[-1] or rstd is not None):
        raise ValueError("gated_rmsnorm_bwd with sumsq_parts: norm after the gate, one group, and no rstd")
    M, D, stride_y, stride_yk, y_cols = _y_layout(y_MD)
    for name, t in (("dout", dout_MD), ("z", z_MD), ("dz", dz_MD)):
        _check_rows(name, t, M, D)
    _check_weight(weight_D, D)
    groups, block, warps, programs = _launch_shape(M, D, group_size, y_MD.element_size(), y_MD.device)
    if not scaled and rstd.numel() != groups * M:
        raise ValueError(f"rstd must hold groups * M = {groups * M} values, got {rstd.numel()}")
    dy_shape = (D // y_cols, M, y_cols) if y_cols else (M, D)
    dy = torch.empty(dy_shape, device=y_MD.device, dtype=y_MD.dtype)
    out = torch.empty(M, D, device=y_MD.device, dtype=y_MD.dtype) if recompute else None
    dw_part = torch.empty(programs, D, device=y_MD.device, dtype=torch.float32)
    in_bytes = block * (dout_MD.element_size() + y_MD.element_size() + z_MD.element_size())
    stages = rows_in_flight(in_bytes, _BWD_STAGES)
    _gated_rmsnorm_bwd_kernel[(programs, groups)](
        dout_MD, y_MD, z_MD, weight_D, sumsq_parts if scaled else rstd, dy, dz_MD, out if recompute else dy, dw_part,
        dout_MD.stride(0), stride_y, stride_yk, M * y_cols, z_MD.stride(0), dz_MD.stride(0), M, group_size,
        sumsq_parts if scaled else dw_part, sumsq_parts.shape[1] if scaled else 1, float(eps),
        NORM_BEFORE_GATE=norm_before_gate, RECOMPUTE=recompute, STAGES=stages, Y_COLS=y_cols, BLOCK=block,
        FAST=_fast(), SCALED=scaled, BLOCK_J=next_power_of_2(sumsq_parts.shape[1]) if scaled else 1, num_warps=warps,
    )  # fmt: skip
    return dy, column_sums(dw_part).to(weight_D.dtype), out


class _RMSNormGated(torch.autograd.Function):
    """The halves above as one autograd op (the unfused mixer's norm: context parallel, use_fused_path false) on x
    [..., D], or with `blocks` on x as column blocks [K, M, D / K] (context parallel's all-to-all output, read where
    it lies; z [M, D]), whose gradient then comes back in that layout (the inverse all-to-all's send order). The
    backward writes dz into a fresh buffer and does not recompute the output."""

    @staticmethod
    def forward(ctx, x, weight, z, eps, group_size, norm_before_gate, blocks):
        D = z.shape[-1]
        x_rows = x if blocks else x.reshape(-1, D)
        z_MD = z.reshape(-1, D)
        if x_rows.stride(-1) != 1:
            x_rows = x_rows.contiguous()
        if z_MD.stride(-1) != 1:
            z_MD = z_MD.contiguous()
        out, rstd = gated_rmsnorm_fwd(x_rows, weight, z_MD, eps, group_size, norm_before_gate)
        ctx.save_for_backward(x_rows, weight, z_MD, rstd)
        ctx.args, ctx.shapes = (eps, group_size, norm_before_gate), (x.shape, z.shape)
        return out.view(z.shape)

    @staticmethod
    def backward(ctx, dout):
        x_rows, weight, z_MD, rstd = ctx.saved_tensors
        eps, group_size, norm_before_gate = ctx.args
        x_shape, z_shape = ctx.shapes
        dout_MD = dout.reshape(z_MD.shape)
        if dout_MD.stride(-1) != 1:
            dout_MD = dout_MD.contiguous()
        dz = torch.empty_like(z_MD, memory_format=torch.contiguous_format)
        dx, dw, _ = gated_rmsnorm_bwd(dout_MD, x_rows, weight, z_MD, rstd, eps, group_size, norm_before_gate, dz, False)
        return dx.view(x_shape), dw, dz.view(z_shape), None, None, None, None


def rmsnorm_gated_triton(x, weight, z, eps=1e-5, group_size=None, norm_before_gate=False):
    """rmsnorm_gated_ref's contract (z given) with autograd, through our kernels: [..., D] -> [..., D] in x's dtype."""
    if z is None or z.shape != x.shape:
        got = None if z is None else tuple(z.shape)
        raise ValueError(f"rmsnorm_gated_triton needs z of x's shape {tuple(x.shape)}, got {got}")
    with no_autocast(x.device):
        return _RMSNormGated.apply(
            x, weight.contiguous(), z, float(eps), group_size or x.shape[-1], norm_before_gate, False
        )


def rmsnorm_gated_blocks_triton(y_KMd, weight, z_MD, eps=1e-5, group_size=None, norm_before_gate=False):
    """rmsnorm_gated_triton of the rows [M, D] whose columns y holds as K blocks [K, M, D / K] (block k: columns
    k * D / K ... (k + 1) * D / K - 1), without assembling them: -> [M, D] in y's dtype."""
    K, M, d = y_KMd.shape
    if z_MD.shape != (M, K * d):
        raise ValueError(f"rmsnorm_gated_blocks_triton needs z [{M}, {K * d}] for y blocks {tuple(y_KMd.shape)}")
    with no_autocast(y_KMd.device):
        return _RMSNormGated.apply(y_KMd, weight.contiguous(), z_MD, float(eps), group_size or K * d,
                                   norm_before_gate, True)  # fmt: skip
