"""Depthwise causal conv1d (+ silu) in Triton, forward and backward, on channel-last data with documents (seq_idx).

causal_conv1d_ref's contract (conv_reference.py), for widths W <= 4:
    out[b, d, t] = act(bias[d] + sum_k weight[d, k] x[b, d, t - (W-1) + k] [seq[t - (W-1) + k] == seq[t]])
x is [B, D, L] with its channels contiguous (stride(1) == 1: the mixer's view of zxbcdt, any token stride); the
output is [B, D, L] over a dense [B, L, D] buffer, the same layout.

Why our own (docs/performance.md, session 11): in the 1.3B step causal_conv1d's channel-last kernels with seq_idx
took 0.154 ms per forward and 0.367 ms per backward and layer on an H100, against 0.108 / 0.228 ms without
documents in mamba-ssm's own loop: 32 ms of a 411 ms step, where reading x and writing out once takes ~0.1 ms.
These kernels read each input once from memory (the W - 1 rows of halo a tile shares with its neighbour come from
cache), cost the same with documents, and take a handful of launch arguments.

Backward, for g_t = dout_t act'(pre_t) (pre: the conv before the activation, recomputed here):
    dx[s] = sum_j weight[W-1-j] g[s+j] [seq[s] == seq[s+j]]
    dweight[d, k] = sum_t g_t x[t - (W-1) + k] [seq[t - (W-1) + k] == seq[t]],    dbias[d] = sum_t g_t
Each program walks RANGE_L positions of one block of channels and sums its dweight / dbias in float32 registers;
the host adds the programs' partial sums (deterministic: no atomics). The g at s + j (j > 0) are recomputed from x
rather than exchanged between programs: a few more multiply-adds per element, no second pass over memory.
Entry points: causal_conv1d_triton (autograd; ops.causal_conv1d under model.kernels "auto" / "triton" on CUDA) and
the bare halves conv_forward_triton / conv_backward_triton (the fused mixer, split_conv1d_scan.py).
Imports triton at import time: import this module lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["causal_conv1d_triton", "conv_forward_triton", "conv_backward_triton", "MAX_WIDTH"]

MAX_WIDTH = 4  # causal_conv1d's widths are 2 to 4; the backward's weight gradient is held as [4, BLOCK_D]


@triton.jit
def _pre_activation(x_b, w_ptr, bias, seq_b, offs_t, offs_d, mask_d, L, s_x_l, s_w_d, s_w_k,
                    HAS_SEQ: tl.constexpr, W: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    """bias + sum_k w[k] x[t - (W-1) + k] (taps before the row or in another document count 0), float32
    [BLOCK_L, BLOCK_D], for positions offs_t (those >= L give finite values; callers mask them)."""
    pre = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32) + bias[None, :]
    if HAS_SEQ:
        seq_t = tl.load(seq_b + offs_t, mask=offs_t < L, other=-1)
    for k in tl.static_range(W):
        u = offs_t - (W - 1) + k
        ok = (u >= 0) & (u < L)
        if HAS_SEQ:
            ok = ok & (tl.load(seq_b + u, mask=ok, other=-2) == seq_t)
        xu = tl.load(x_b + u[:, None] * s_x_l + offs_d[None, :], mask=ok[:, None] & mask_d[None, :], other=0.0)
        wk = tl.load(w_ptr + offs_d * s_w_d + k * s_w_k, mask=mask_d, other=0.0).to(tl.float32)
        pre += xu.to(tl.float32) * wk[None, :]
    return pre


@triton.jit
def conv_fwd_kernel(x_ptr, w_ptr, bias_ptr, seq_ptr, out_ptr, L, D, s_x_b, s_x_l, s_o_b, s_o_l, s_w_d, s_w_k,
                    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr, W: tl.constexpr,
                    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    pid_l = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_t = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    pre = _pre_activation(x_ptr + b * s_x_b, w_ptr, bias, seq_ptr + b * L, offs_t, offs_d, mask_d, L, s_x_l, s_w_d,
                          s_w_k, HAS_SEQ, W, BLOCK_L, BLOCK_D)  # fmt: skip
    if SILU:
        pre = pre * tl.sigmoid(pre)
    out = out_ptr + b * s_o_b + offs_t[:, None] * s_o_l + offs_d[None, :]
    tl.store(out, pre.to(out_ptr.dtype.element_ty), mask=(offs_t < L)[:, None] & mask_d[None, :])


@triton.jit
def _grad_pre(x_b, w_ptr, bias, seq_b, dout_b, offs_t, offs_d, mask_d, L, s_x_l, s_y_l, s_w_d, s_w_k,
              HAS_SEQ: tl.constexpr, SILU: tl.constexpr, W: tl.constexpr, BLOCK_L: tl.constexpr,
              BLOCK_D: tl.constexpr):  # fmt: skip
    """g_t = dout_t act'(pre_t) in float32, 0 for positions t >= L."""
    g = tl.load(
        dout_b + offs_t[:, None] * s_y_l + offs_d[None, :], mask=(offs_t < L)[:, None] & mask_d[None, :], other=0.0
    ).to(tl.float32)
    if SILU:
        pre = _pre_activation(x_b, w_ptr, bias, seq_b, offs_t, offs_d, mask_d, L, s_x_l, s_w_d, s_w_k, HAS_SEQ, W,
                              BLOCK_L, BLOCK_D)  # fmt: skip
        sig = tl.sigmoid(pre)
        g = g * sig * (1.0 + pre * (1.0 - sig))
    return g


@triton.jit
def conv_bwd_kernel(x_ptr, w_ptr, bias_ptr, seq_ptr, dout_ptr, dx_ptr, dw_part_ptr, db_part_ptr, L, D, N_RANGES,
                    s_x_b, s_x_l, s_y_b, s_y_l, s_dx_b, s_dx_l, s_w_d, s_w_k,
                    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr, W: tl.constexpr,
                    RANGE_L: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    x_b = x_ptr + b * s_x_b
    seq_b = seq_ptr + b * L
    dout_b = dout_ptr + b * s_y_b
    offs_k = tl.arange(0, 4)
    dw = tl.zeros((4, BLOCK_D), dtype=tl.float32)  # [k, d]: row k is dweight[:, k]
    db = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for l0 in range(pid_r * RANGE_L, tl.minimum(pid_r * RANGE_L + RANGE_L, L), BLOCK_L):
        offs_t = l0 + tl.arange(0, BLOCK_L)
        in_t = offs_t < L
        g0 = _grad_pre(x_b, w_ptr, bias, seq_b, dout_b, offs_t, offs_d, mask_d, L, s_x_l, s_y_l, s_w_d, s_w_k,
                       HAS_SEQ, SILU, W, BLOCK_L, BLOCK_D)  # fmt: skip
        db += tl.sum(g0, axis=0)
        if HAS_SEQ:
            seq_t = tl.load(seq_b + offs_t, mask=in_t, other=-1)
        # dweight: g_t times the taps the forward used (same masks).
        for k in tl.static_range(W):
            u = offs_t - (W - 1) + k
            ok = (u >= 0) & in_t
            if HAS_SEQ:
                ok = ok & (tl.load(seq_b + u, mask=ok, other=-2) == seq_t)
            xu = tl.load(x_b + u[:, None] * s_x_l + offs_d[None, :], mask=ok[:, None] & mask_d[None, :], other=0.0)
            dw += tl.where(offs_k[:, None] == k, tl.sum(g0 * xu.to(tl.float32), axis=0)[None, :], 0.0)
        # dx[s] = sum_j w[W-1-j] g[s+j] over the later positions of s's document.
        w_last = tl.load(w_ptr + offs_d * s_w_d + (W - 1) * s_w_k, mask=mask_d, other=0.0).to(tl.float32)
        dx = g0 * w_last[None, :]
        for j in tl.static_range(1, W):
            gj = _grad_pre(x_b, w_ptr, bias, seq_b, dout_b, offs_t + j, offs_d, mask_d, L, s_x_l, s_y_l, s_w_d,
                           s_w_k, HAS_SEQ, SILU, W, BLOCK_L, BLOCK_D)  # fmt: skip
            if HAS_SEQ:
                same = tl.load(seq_b + offs_t + j, mask=offs_t + j < L, other=-2) == seq_t
                gj = tl.where(same[:, None], gj, 0.0)
            wj = tl.load(w_ptr + offs_d * s_w_d + (W - 1 - j) * s_w_k, mask=mask_d, other=0.0).to(tl.float32)
            dx += gj * wj[None, :]
        dx_out = dx_ptr + b * s_dx_b + offs_t[:, None] * s_dx_l + offs_d[None, :]
        tl.store(dx_out, dx.to(dx_ptr.dtype.element_ty), mask=in_t[:, None] & mask_d[None, :])
    part = b * N_RANGES + pid_r  # partial sums of this program: [B * N_RANGES, 4, D] and [B * N_RANGES, D]
    tl.store(dw_part_ptr + (part * 4 + offs_k[:, None]) * D + offs_d[None, :], dw, mask=mask_d[None, :])
    tl.store(db_part_ptr + part * D + offs_d, db, mask=mask_d)


def _check(x_BDL: torch.Tensor, weight_DW: torch.Tensor, seq_idx_BL):
    b, d, L = x_BDL.shape
    if x_BDL.stride(1) != 1:
        raise ValueError(
            f"conv_triton wants channel-last x ([B, D, L] with stride(1) == 1), got strides {x_BDL.stride()}"
        )
    if weight_DW.shape[0] != d or not 1 <= weight_DW.shape[1] <= MAX_WIDTH:
        raise ValueError(f"weight must be [{d}, W] with W <= {MAX_WIDTH}, got {tuple(weight_DW.shape)}")
    if seq_idx_BL is not None and (seq_idx_BL.shape != (b, L) or seq_idx_BL.dtype != torch.int32):
        raise ValueError(f"seq_idx must be int32 [{b}, {L}], got {seq_idx_BL.dtype} {tuple(seq_idx_BL.shape)}")


_BLOCK_D = 128
_FWD_BLOCK_L = 64
_BWD_BLOCK_L = 32
_BWD_RANGE_L = 512


def conv_forward_triton(x_BDL, weight_DW, bias_D, seq_idx_BL, silu: bool) -> torch.Tensor:
    """[B, D, L] (channels contiguous) -> [B, D, L] in x's dtype over a dense [B, L, D] buffer; no autograd."""
    _check(x_BDL, weight_DW, seq_idx_BL)
    b, d, L = x_BDL.shape
    out_BLD = torch.empty(b, L, d, device=x_BDL.device, dtype=x_BDL.dtype)
    conv_fwd_kernel[(triton.cdiv(L, _FWD_BLOCK_L), triton.cdiv(d, _BLOCK_D), b)](
        x_BDL, weight_DW, bias_D if bias_D is not None else weight_DW, seq_idx_BL if seq_idx_BL is not None else x_BDL,
        out_BLD, L, d, x_BDL.stride(0), x_BDL.stride(2), out_BLD.stride(0), out_BLD.stride(1),
        weight_DW.stride(0), weight_DW.stride(1),
        HAS_BIAS=bias_D is not None, HAS_SEQ=seq_idx_BL is not None, SILU=silu, W=weight_DW.shape[1],
        BLOCK_L=_FWD_BLOCK_L, BLOCK_D=_BLOCK_D, num_warps=4,
    )  # fmt: skip
    return out_BLD.transpose(1, 2)


def conv_backward_triton(x_BDL, weight_DW, bias_D, dout_BDL, seq_idx_BL, silu: bool, dx_BDL=None):
    """Gradients of conv_forward_triton: (dx [B, D, L] (written into dx_BDL when given: channels contiguous),
    dweight [D, W] float32, dbias [D] float32 or None)."""
    _check(x_BDL, weight_DW, seq_idx_BL)
    b, d, L = x_BDL.shape
    if dout_BDL.stride(1) != 1:
        dout_BDL = dout_BDL.transpose(1, 2).contiguous().transpose(1, 2)
    if dx_BDL is None:
        dx_BDL = torch.empty(b, L, d, device=x_BDL.device, dtype=x_BDL.dtype).transpose(1, 2)
    elif dx_BDL.stride(1) != 1:
        raise ValueError(f"dx must be channel-last like x, got strides {dx_BDL.stride()}")
    n_ranges = triton.cdiv(L, _BWD_RANGE_L)
    dw_part = torch.empty(b * n_ranges, 4, d, device=x_BDL.device, dtype=torch.float32)
    db_part = torch.empty(b * n_ranges, d, device=x_BDL.device, dtype=torch.float32)
    conv_bwd_kernel[(n_ranges, triton.cdiv(d, _BLOCK_D), b)](
        x_BDL, weight_DW, bias_D if bias_D is not None else weight_DW, seq_idx_BL if seq_idx_BL is not None else x_BDL,
        dout_BDL, dx_BDL, dw_part, db_part, L, d, n_ranges, x_BDL.stride(0), x_BDL.stride(2),
        dout_BDL.stride(0), dout_BDL.stride(2), dx_BDL.stride(0), dx_BDL.stride(2),
        weight_DW.stride(0), weight_DW.stride(1),
        HAS_BIAS=bias_D is not None, HAS_SEQ=seq_idx_BL is not None, SILU=silu, W=weight_DW.shape[1],
        RANGE_L=_BWD_RANGE_L, BLOCK_L=_BWD_BLOCK_L, BLOCK_D=_BLOCK_D, num_warps=4,
    )  # fmt: skip
    W = weight_DW.shape[1]
    dw = dw_part.sum(0)[:W].t()
    db = db_part.sum(0) if bias_D is not None else None
    return dx_BDL, dw, db


def _channel_last(x_BDL: torch.Tensor) -> torch.Tensor:
    return x_BDL if x_BDL.stride(1) == 1 else x_BDL.transpose(1, 2).contiguous().transpose(1, 2)


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BDL, weight_DW, bias_D, seq_idx_BL, silu: bool):
        x_BDL = _channel_last(x_BDL)
        ctx.save_for_backward(x_BDL, weight_DW, bias_D, seq_idx_BL)
        ctx.silu = silu
        return conv_forward_triton(x_BDL, weight_DW, bias_D, seq_idx_BL, silu)

    @staticmethod
    def backward(ctx, dout_BDL):
        x_BDL, weight_DW, bias_D, seq_idx_BL = ctx.saved_tensors
        dx, dw, db = conv_backward_triton(x_BDL, weight_DW, bias_D, dout_BDL, seq_idx_BL, ctx.silu)
        return dx, dw.to(weight_DW.dtype), None if db is None else db.to(bias_D.dtype), None, None


def causal_conv1d_triton(x_BDL, weight_DW, bias_D=None, seq_idx_BL=None, activation=None) -> torch.Tensor:
    """causal_conv1d_ref's function with autograd: [B, D, L] -> [B, D, L] in x's dtype (channels contiguous)."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    seq = None if seq_idx_BL is None else seq_idx_BL.to(torch.int32).contiguous()
    return _CausalConv1d.apply(x_BDL, weight_DW, bias_D, seq, activation is not None)
