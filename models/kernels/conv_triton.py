"""Depthwise causal conv1d (+ silu) in Triton, forward and backward, on channel-last data with documents (seq_idx).

causal_conv1d_ref's contract (conv_reference.py), for widths W <= 4:
    out[b, d, t] = act(bias[d] + sum_k weight[d, k] x[b, d, t - (W-1) + k] [seq[t - (W-1) + k] == seq[t]])
x is [B, D, L] with its channels contiguous (stride(1) == 1: the mixer's view of zxbcdt, any token stride); the
output is [B, D, L] over a dense [B, L, D] buffer, the same layout.

What it is for (docs/performance.md, sessions 11 and 17): the CUDA conv where causal_conv1d is not installed
(ops.causal_conv1d prefers causal_conv1d's kernels), and the fused mixer's forward conv with documents (faster than
causal_conv1d's there: split_conv1d_scan.py). It was written to remove what documents cost causal_conv1d's
channel-last kernels in the 1.3B step (0.154 / 0.367 ms forward / backward per layer with seq_idx, 0.108 / 0.228
without); on an H100 its forward with documents is faster (1.3B 0.127 vs 0.157 ms since session 17's tiles),
without them slower (0.122 vs 0.114), and its backward 1.35-1.6x slower (1.3B 0.491 ms): Triton has no register
shifts, so each of the four g a position's dx needs is recomputed from x, where causal_conv1d's threads own
consecutive positions and pass the halo through shared memory (computing each g once and shifting it through
tl.gather or a scratch tile was slower still: session 17).

Backward, for g_t = dout_t act'(pre_t) (pre: the conv before the activation, recomputed here):
    dx[s] = sum_j weight[W-1-j] g[s+j] [seq[s] == seq[s+j]]
    dweight[d, k] = sum_t g_t x[t - (W-1) + k] [seq[t - (W-1) + k] == seq[t]],    dbias[d] = sum_t g_t
Each program walks RANGE_L positions of one block of channels, loads the seven rows t - 3 ... t + 3 of a tile once,
and sums its dweight / dbias element-wise in float32, reduced over rows once at the end; the host adds the programs'
partial sums (deterministic: no atomics). Entry points: causal_conv1d_triton (autograd; ops.causal_conv1d on CUDA
without causal_conv1d, under model.kernels "auto" / "triton") and the bare halves conv_forward_triton /
conv_backward_triton (timed by benchmarks/bench_conv.py).
Imports triton at import time: import this module lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels.fast_launch import cdiv, fast_launch

__all__ = ["causal_conv1d_triton", "conv_forward_triton", "conv_backward_triton", "MAX_WIDTH"]

MAX_WIDTH = 4  # causal_conv1d's widths are 2 to 4; the kernels run a narrower conv as width 4 with leading 0 taps


@triton.jit
def _weight(w_ptr, offs_d, mask_d, s_w_d, s_w_k, k: tl.constexpr, W: tl.constexpr):
    """Tap k of 4 (offset k - 3 from the output position) as float32 [BLOCK_D]: weight[:, k - (4 - W)], 0 for k < 4 - W
    (a width below 4 is a width-4 conv whose first taps are 0)."""
    if k < 4 - W:
        return tl.zeros(offs_d.shape, dtype=tl.float32)
    return tl.load(w_ptr + offs_d * s_w_d + (k - (4 - W)) * s_w_k, mask=mask_d, other=0.0).to(tl.float32)


@triton.jit
def _channel_params(w_ptr, bias_ptr, offs_d, mask_d, s_w_d, s_w_k, HAS_BIAS: tl.constexpr, W: tl.constexpr,
                    BLOCK_D: tl.constexpr):  # fmt: skip
    """(bias, w0, w1, w2, w3) of the program's channels, float32 [BLOCK_D] each (bias 0 without one)."""
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias += tl.load(bias_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    w0 = _weight(w_ptr, offs_d, mask_d, s_w_d, s_w_k, 0, W)
    w1 = _weight(w_ptr, offs_d, mask_d, s_w_d, s_w_k, 1, W)
    w2 = _weight(w_ptr, offs_d, mask_d, s_w_d, s_w_k, 2, W)
    w3 = _weight(w_ptr, offs_d, mask_d, s_w_d, s_w_k, 3, W)
    return bias, w0, w1, w2, w3


@triton.jit
def _rows(base, offs_t, offs_d, mask_d, L, s_l):
    """Rows offs_t (0 outside [0, L)) of a channel-last [L, D] tensor as float32 [BLOCK_L, BLOCK_D]."""
    ok = (offs_t >= 0) & (offs_t < L)
    return tl.load(base + offs_t[:, None] * s_l + offs_d[None, :], mask=ok[:, None] & mask_d[None, :], other=0.0).to(
        tl.float32
    )


@triton.jit
def _ids(seq_b, offs_t, L, HAS_SEQ: tl.constexpr):
    """Document ids of positions offs_t (-2 outside [0, L), where the data are 0 anyway); 0 without documents."""
    if HAS_SEQ:
        return tl.load(seq_b + offs_t, mask=(offs_t >= 0) & (offs_t < L), other=-2)
    return tl.zeros(offs_t.shape, dtype=tl.int32)


@triton.jit
def _same(x, s_src, s_dst, HAS_SEQ: tl.constexpr):
    """x where the tap's document is the output's, else 0."""
    if HAS_SEQ:
        return tl.where((s_src == s_dst)[:, None], x, 0.0)
    return x


@triton.jit
def _pre(bias, w0, w1, w2, w3, xa, xb, xc, xd, sa, sb, sc, sd, HAS_SEQ: tl.constexpr):
    """bias + w0 x[t-3] + w1 x[t-2] + w2 x[t-1] + w3 x[t] over the taps in t's document (sd: t's ids)."""
    pre = bias[None, :] + w3[None, :] * xd
    pre += w2[None, :] * _same(xc, sc, sd, HAS_SEQ)
    pre += w1[None, :] * _same(xb, sb, sd, HAS_SEQ)
    pre += w0[None, :] * _same(xa, sa, sd, HAS_SEQ)
    return pre


@fast_launch
@triton.jit
def conv_fwd_kernel(x_ptr, w_ptr, bias_ptr, seq_ptr, out_ptr, L, D, s_x_b, s_x_l, s_o_b, s_o_l, s_w_d, s_w_k,
                    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr, W: tl.constexpr,
                    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    pid_l = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    t = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    bias, w0, w1, w2, w3 = _channel_params(w_ptr, bias_ptr, offs_d, mask_d, s_w_d, s_w_k, HAS_BIAS, W, BLOCK_D)
    x_b = x_ptr + b * s_x_b
    seq_b = seq_ptr + b * L
    pre = _pre(
        bias, w0, w1, w2, w3,
        _rows(x_b, t - 3, offs_d, mask_d, L, s_x_l), _rows(x_b, t - 2, offs_d, mask_d, L, s_x_l),
        _rows(x_b, t - 1, offs_d, mask_d, L, s_x_l), _rows(x_b, t, offs_d, mask_d, L, s_x_l),
        _ids(seq_b, t - 3, L, HAS_SEQ), _ids(seq_b, t - 2, L, HAS_SEQ), _ids(seq_b, t - 1, L, HAS_SEQ),
        _ids(seq_b, t, L, HAS_SEQ), HAS_SEQ,
    )  # fmt: skip
    if SILU:
        pre = pre * tl.sigmoid(pre)
    out = out_ptr + b * s_o_b + t[:, None] * s_o_l + offs_d[None, :]
    tl.store(out, pre.to(out_ptr.dtype.element_ty), mask=(t < L)[:, None] & mask_d[None, :])


@triton.jit
def _grad(dout_b, t, offs_d, mask_d, L, s_y_l, pre, SILU: tl.constexpr):
    """g = dout act'(pre), float32; 0 for positions t >= L."""
    g = _rows(dout_b, t, offs_d, mask_d, L, s_y_l)
    if SILU:
        sig = tl.sigmoid(pre)
        g = g * sig * (1.0 + pre * (1.0 - sig))
    return g


@fast_launch
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
    bias, w0, w1, w2, w3 = _channel_params(w_ptr, bias_ptr, offs_d, mask_d, s_w_d, s_w_k, HAS_BIAS, W, BLOCK_D)
    x_b = x_ptr + b * s_x_b
    seq_b = seq_ptr + b * L
    dout_b = dout_ptr + b * s_y_b
    # Element-wise partial sums over the program's positions, reduced over rows once at the end.
    dw0 = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
    dw1 = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
    dw2 = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
    dw3 = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
    db = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
    for l0 in range(pid_r * RANGE_L, tl.minimum(pid_r * RANGE_L + RANGE_L, L), BLOCK_L):
        t = l0 + tl.arange(0, BLOCK_L)
        # The seven rows t - 3 ... t + 3 that the pre-activations of t ... t + 3 read, each loaded once.
        xm3 = _rows(x_b, t - 3, offs_d, mask_d, L, s_x_l)
        xm2 = _rows(x_b, t - 2, offs_d, mask_d, L, s_x_l)
        xm1 = _rows(x_b, t - 1, offs_d, mask_d, L, s_x_l)
        x0 = _rows(x_b, t, offs_d, mask_d, L, s_x_l)
        xp1 = _rows(x_b, t + 1, offs_d, mask_d, L, s_x_l)
        xp2 = _rows(x_b, t + 2, offs_d, mask_d, L, s_x_l)
        xp3 = _rows(x_b, t + 3, offs_d, mask_d, L, s_x_l)
        sm3 = _ids(seq_b, t - 3, L, HAS_SEQ)
        sm2 = _ids(seq_b, t - 2, L, HAS_SEQ)
        sm1 = _ids(seq_b, t - 1, L, HAS_SEQ)
        s0 = _ids(seq_b, t, L, HAS_SEQ)
        sp1 = _ids(seq_b, t + 1, L, HAS_SEQ)
        sp2 = _ids(seq_b, t + 2, L, HAS_SEQ)
        sp3 = _ids(seq_b, t + 3, L, HAS_SEQ)
        # g at t: the weight and bias gradients, and dx's own tap.
        g = _grad(dout_b, t, offs_d, mask_d, L, s_y_l,
                  _pre(bias, w0, w1, w2, w3, xm3, xm2, xm1, x0, sm3, sm2, sm1, s0, HAS_SEQ), SILU)  # fmt: skip
        db += g
        dw0 += g * _same(xm3, sm3, s0, HAS_SEQ)
        dw1 += g * _same(xm2, sm2, s0, HAS_SEQ)
        dw2 += g * _same(xm1, sm1, s0, HAS_SEQ)
        dw3 += g * x0
        dx = g * w3[None, :]
        # g at t + 1 ... t + 3, each where it is in t's document, times the tap that reached it from t.
        g = _grad(dout_b, t + 1, offs_d, mask_d, L, s_y_l,
                  _pre(bias, w0, w1, w2, w3, xm2, xm1, x0, xp1, sm2, sm1, s0, sp1, HAS_SEQ), SILU)  # fmt: skip
        dx += _same(g, sp1, s0, HAS_SEQ) * w2[None, :]
        g = _grad(dout_b, t + 2, offs_d, mask_d, L, s_y_l,
                  _pre(bias, w0, w1, w2, w3, xm1, x0, xp1, xp2, sm1, s0, sp1, sp2, HAS_SEQ), SILU)  # fmt: skip
        dx += _same(g, sp2, s0, HAS_SEQ) * w1[None, :]
        g = _grad(dout_b, t + 3, offs_d, mask_d, L, s_y_l,
                  _pre(bias, w0, w1, w2, w3, x0, xp1, xp2, xp3, s0, sp1, sp2, sp3, HAS_SEQ), SILU)  # fmt: skip
        dx += _same(g, sp3, s0, HAS_SEQ) * w0[None, :]
        dx_out = dx_ptr + b * s_dx_b + t[:, None] * s_dx_l + offs_d[None, :]
        tl.store(dx_out, dx.to(dx_ptr.dtype.element_ty), mask=(t < L)[:, None] & mask_d[None, :])
    # This program's partial sums: [B * N_RANGES, 4, D] (tap k of 4, as _weight numbers them) and [B * N_RANGES, D].
    part = b * N_RANGES + pid_r
    dw_base = dw_part_ptr + part * 4 * D + offs_d
    tl.store(dw_base, tl.sum(dw0, axis=0), mask=mask_d)
    tl.store(dw_base + D, tl.sum(dw1, axis=0), mask=mask_d)
    tl.store(dw_base + 2 * D, tl.sum(dw2, axis=0), mask=mask_d)
    tl.store(dw_base + 3 * D, tl.sum(dw3, axis=0), mask=mask_d)
    tl.store(db_part_ptr + part * D + offs_d, tl.sum(db, axis=0), mask=mask_d)


def _channel_last(x_BDL: torch.Tensor) -> torch.Tensor:
    """The same [B, D, L] with its channels contiguous (a copy only when they are not)."""
    return x_BDL if x_BDL.stride(1) == 1 else x_BDL.transpose(1, 2).contiguous().transpose(1, 2)


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


# Tiles (positions x channels) and warps; benchmarks/bench_conv.py --tune times the alternatives. Forward: 128
# channels x 32 positions (H100, session 17, with documents: 1.3B 0.127 ms against 0.142 with 64 x 64, 370M 0.070
# against 0.080).
_FWD_BLOCK_D = 128
_FWD_BLOCK_L = 32
_FWD_WARPS = 4
# Backward: 32 channels x 16 positions (127 registers per thread on sm_90 against 255 at 64 x 16; H100, session 17,
# with documents: 1.3B 0.491 ms against 0.590, 370M 0.281 against 0.323; causal_conv1d's 0.364 / 0.208). A version
# computing each g once and shifting it between rows (tl.gather, or a scratch tile) ran 0.97-1.48 ms: not kept.
_BWD_BLOCK_D = 32
_BWD_BLOCK_L = 16
_BWD_WARPS = 4
_BWD_RANGE_L = 512  # positions per backward program (its weight-gradient partial sums)


def conv_forward_triton(x_BDL, weight_DW, bias_D, seq_idx_BL, silu: bool) -> torch.Tensor:
    """[B, D, L] (channels contiguous) -> [B, D, L] in x's dtype over a dense [B, L, D] buffer; no autograd."""
    _check(x_BDL, weight_DW, seq_idx_BL)
    b, d, L = x_BDL.shape
    out_BLD = torch.empty(b, L, d, device=x_BDL.device, dtype=x_BDL.dtype)
    conv_fwd_kernel[(cdiv(L, _FWD_BLOCK_L), cdiv(d, _FWD_BLOCK_D), b)](
        x_BDL, weight_DW, bias_D if bias_D is not None else weight_DW, seq_idx_BL if seq_idx_BL is not None else x_BDL,
        out_BLD, L, d, x_BDL.stride(0), x_BDL.stride(2), out_BLD.stride(0), out_BLD.stride(1),
        weight_DW.stride(0), weight_DW.stride(1),
        HAS_BIAS=bias_D is not None, HAS_SEQ=seq_idx_BL is not None, SILU=silu, W=weight_DW.shape[1],
        BLOCK_L=_FWD_BLOCK_L, BLOCK_D=_FWD_BLOCK_D, num_warps=_FWD_WARPS,
    )  # fmt: skip
    return out_BLD.transpose(1, 2)


def conv_backward_triton(x_BDL, weight_DW, bias_D, dout_BDL, seq_idx_BL, silu: bool, dx_BDL=None):
    """Gradients of conv_forward_triton: (dx [B, D, L] (written into dx_BDL when given: channels contiguous),
    dweight [D, W] float32, dbias [D] float32 or None)."""
    _check(x_BDL, weight_DW, seq_idx_BL)
    b, d, L = x_BDL.shape
    dout_BDL = _channel_last(dout_BDL)
    if dx_BDL is None:
        dx_BDL = torch.empty(b, L, d, device=x_BDL.device, dtype=x_BDL.dtype).transpose(1, 2)
    elif dx_BDL.stride(1) != 1:
        raise ValueError(f"dx must be channel-last like x, got strides {dx_BDL.stride()}")
    n_ranges = cdiv(L, _BWD_RANGE_L)
    dw_part = torch.empty(b * n_ranges, 4, d, device=x_BDL.device, dtype=torch.float32)
    db_part = torch.empty(b * n_ranges, d, device=x_BDL.device, dtype=torch.float32)
    conv_bwd_kernel[(n_ranges, cdiv(d, _BWD_BLOCK_D), b)](
        x_BDL, weight_DW, bias_D if bias_D is not None else weight_DW, seq_idx_BL if seq_idx_BL is not None else x_BDL,
        dout_BDL, dx_BDL, dw_part, db_part, L, d, n_ranges, x_BDL.stride(0), x_BDL.stride(2),
        dout_BDL.stride(0), dout_BDL.stride(2), dx_BDL.stride(0), dx_BDL.stride(2),
        weight_DW.stride(0), weight_DW.stride(1),
        HAS_BIAS=bias_D is not None, HAS_SEQ=seq_idx_BL is not None, SILU=silu, W=weight_DW.shape[1],
        RANGE_L=_BWD_RANGE_L, BLOCK_L=_BWD_BLOCK_L, BLOCK_D=_BWD_BLOCK_D, num_warps=_BWD_WARPS,
    )  # fmt: skip
    W = weight_DW.shape[1]
    dw = dw_part.sum(0)[4 - W :].t()  # taps 4 - W ... 3 are the weight's columns
    db = db_part.sum(0) if bias_D is not None else None
    return dx_BDL, dw, db


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
