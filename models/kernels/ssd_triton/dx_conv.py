"""The conv's backward for x's channels as dx's epilogue (model.ssd_fuse_conv_backward), and the rows it leaves.

The fused mixer (split_conv1d_scan.py) runs conv -> SSD. Unfused, its backward stores dx (the SSD's gradient of the
conv's output, x's channels) and the conv's backward (conv_triton.py) reads it back with the conv's input,
recomputes the pre-activation and walks the positions (latency-bound: 185 of its 197 us a layer at the 1.3B are
x's channels, docs/performance.md session 63). Fused, each dx program (chunk_scan_bwd.py) finishes the conv's
backward for its rows while dx is still in its registers:

    g_t     = dx_t act'(pre_t),  pre_t = bias + sum_k w_k xin_{t-3+k} [same document]     (float32)
    dw_k   += sum_t g_t xin_{t-3+k} [same document],  db += sum_t g_t                   (per-program partial sums)
    dxin_s  = sum_j w_{3-j} g_{s+j} [same document]

Triton has no row shift of a register tile, so g is stored (in x's dtype, where dx would have gone: the rounding
the unfused path gives dx) and read back at rows s .. s+3 after a block barrier. The last three rows of a program's
block need g from the next block, which another program computes: conv_edges_kernel finishes them after the dx
kernel. dxin is rounded once either way. For x's channels only (B's and C's gradients come later, from dB and
bc_finish; the conv's own kernel does those 2 G N channels).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from models.kernels.conv_triton import _channel_params, _ids, _same, _stream_dx
from models.kernels.fast_launch import cdiv, fast_launch
from models.kernels.fast_math import sigmoid

__all__ = ["DxConv", "dx_conv_buffers", "conv_head_grad", "conv_head_dxin", "conv_edges", "conv_edges_kernel"]


class DxConv(NamedTuple):
    """What dx's epilogue needs of the conv (x's channels: H * P of them, channel-last views with channel stride 1).
    xin: the conv's input [B, L, H*P]; weight [H*P, W] (W <= 4); bias [H*P] or None; dxin: the conv input's gradient
    [B, L, H*P] (written); dw_part [R, H*P, 4] and db_part [R, H*P] float32: one row per dx program block
    (R = B * NC * cdiv(Q, dx_k)); silu: the conv's activation."""

    xin: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    dxin: torch.Tensor
    dw_part: torch.Tensor
    db_part: torch.Tensor
    silu: bool


def dx_conv_buffers(xin, weight, bias, dxin, silu: bool, Q: int, dx_k: int) -> DxConv:
    """DxConv with its partial-sum buffers allocated for chunk size Q and dx's block of rows dx_k."""
    b, L, d = xin.shape
    rows = b * cdiv(L, Q) * cdiv(Q, dx_k)
    dw_part = torch.empty(rows, d, 4, device=xin.device, dtype=torch.float32)
    db_part = torch.empty(rows, d, device=xin.device, dtype=torch.float32)
    return DxConv(xin, weight, bias, dxin, dw_part, db_part, silu)


@triton.jit
def _tap_rows(base, t_k, offs_p, mask_p, L, s_l):
    """Rows t_k (0 outside [0, L)) of a channel-last [L, D] view: [BLOCK_K, BLOCK_P] in its dtype."""
    ok = (t_k >= 0) & (t_k < L)
    return tl.load(base + t_k[:, None] * s_l + offs_p[None, :], mask=ok[:, None] & mask_p[None, :], other=0.0)


@triton.jit
def conv_head_grad(dx, xin_b, seq_b, cw_ptr, cb_ptr, ch0, t_k, valid_k, offs_p, mask_p, L, s_xin_l, s_cw_d, s_cw_k,
                   g_ptrs, part_row, dw_ptr, db_ptr, D, HAS_SEQ: tl.constexpr, HAS_BIAS: tl.constexpr,
                   SILU: tl.constexpr, W: tl.constexpr, FAST: tl.constexpr, BLOCK_P: tl.constexpr):  # fmt: skip
    """One head's g = dx act'(pre) (dx: its float32 [BLOCK_K, BLOCK_P] tile, rows t_k, channels ch0 + offs_p of
    x's), stored at g_ptrs (rows valid_k), and its weight- and bias-gradient sums over the block's rows stored in row
    part_row of dw_part ([R, D, 4]) and db_part ([R, D])."""
    offs_d = ch0 + offs_p
    bias, w0, w1, w2, w3 = _channel_params(cw_ptr, cb_ptr, offs_d, mask_p, s_cw_d, s_cw_k, HAS_BIAS, W, BLOCK_P)
    xin_h = xin_b + ch0
    sd = _ids(seq_b, t_k, L, HAS_SEQ)
    # pre tap by tap (one tap tile live at a time: the epilogue runs beside dx's two accumulators), the taps read
    # again for the weight gradient below (from L1)
    pre = bias[None, :] + w3[None, :] * _tap_rows(xin_h, t_k, offs_p, mask_p, L, s_xin_l).to(tl.float32)
    pre += w2[None, :] * _tap(xin_h, seq_b, sd, t_k, 1, offs_p, mask_p, L, s_xin_l, HAS_SEQ)
    pre += w1[None, :] * _tap(xin_h, seq_b, sd, t_k, 2, offs_p, mask_p, L, s_xin_l, HAS_SEQ)
    pre += w0[None, :] * _tap(xin_h, seq_b, sd, t_k, 3, offs_p, mask_p, L, s_xin_l, HAS_SEQ)
    g = dx
    if SILU:
        sig = sigmoid(pre, FAST)
        g = g * sig * (1.0 + pre * (1.0 - sig))
    keep = valid_k[:, None] & mask_p[None, :]
    g = tl.where(keep, g, 0.0)
    tl.store(g_ptrs, g.to(g_ptrs.dtype.element_ty), mask=keep)
    dw = dw_ptr + (part_row * D + offs_d) * 4
    tl.store(dw + 3, tl.sum(g * _tap_rows(xin_h, t_k, offs_p, mask_p, L, s_xin_l).to(tl.float32), axis=0), mask=mask_p)
    tl.store(dw + 2, tl.sum(g * _tap(xin_h, seq_b, sd, t_k, 1, offs_p, mask_p, L, s_xin_l, HAS_SEQ), axis=0),
             mask=mask_p)  # fmt: skip
    tl.store(dw + 1, tl.sum(g * _tap(xin_h, seq_b, sd, t_k, 2, offs_p, mask_p, L, s_xin_l, HAS_SEQ), axis=0),
             mask=mask_p)  # fmt: skip
    tl.store(dw, tl.sum(g * _tap(xin_h, seq_b, sd, t_k, 3, offs_p, mask_p, L, s_xin_l, HAS_SEQ), axis=0), mask=mask_p)
    tl.store(db_ptr + part_row * D + offs_d, tl.sum(g, axis=0), mask=mask_p)


@triton.jit
def _tap(xin_h, seq_b, sd, t_k, back: tl.constexpr, offs_p, mask_p, L, s_xin_l, HAS_SEQ: tl.constexpr):
    """xin at rows t_k - back in float32, 0 where that row is in another document than t_k's (ids sd) or outside."""
    return _same(_tap_rows(xin_h, t_k - back, offs_p, mask_p, L, s_xin_l).to(tl.float32), _ids(seq_b, t_k - back, L,
                 HAS_SEQ), sd, HAS_SEQ)  # fmt: skip


@triton.jit
def conv_head_dxin(g_b, dxin_b, seq_b, cw_ptr, ch0, t_k, done_k, offs_p, mask_p, L, s_g_l, s_dxin_l, s_cw_d, s_cw_k,
                   HAS_SEQ: tl.constexpr, W: tl.constexpr, BLOCK_P: tl.constexpr):  # fmt: skip
    """dxin at rows t_k where done_k (rows whose g at t .. t+3 the program stored itself; after its barrier) for
    channels ch0 + offs_p: w3 g[t] + w2 g[t+1] + w1 g[t+2] + w0 g[t+3], each in t's document."""
    offs_d = ch0 + offs_p
    _, w0, w1, w2, w3 = _channel_params(cw_ptr, cw_ptr, offs_d, mask_p, s_cw_d, s_cw_k, False, W, BLOCK_P)
    m = done_k[:, None] & mask_p[None, :]
    g_h = g_b + ch0 + offs_p[None, :]
    g0 = tl.load(g_h + t_k[:, None] * s_g_l, mask=m, other=0.0).to(tl.float32)
    g1 = tl.load(g_h + (t_k + 1)[:, None] * s_g_l, mask=m & (t_k + 1 < L)[:, None], other=0.0).to(tl.float32)
    g2 = tl.load(g_h + (t_k + 2)[:, None] * s_g_l, mask=m & (t_k + 2 < L)[:, None], other=0.0).to(tl.float32)
    g3 = tl.load(g_h + (t_k + 3)[:, None] * s_g_l, mask=m & (t_k + 3 < L)[:, None], other=0.0).to(tl.float32)
    s0 = _ids(seq_b, t_k, L, HAS_SEQ)
    s1 = _ids(seq_b, t_k + 1, L, HAS_SEQ)
    s2 = _ids(seq_b, t_k + 2, L, HAS_SEQ)
    s3 = _ids(seq_b, t_k + 3, L, HAS_SEQ)
    dxin = _stream_dx(g0, g1, g2, g3, s0, s1, s2, s3, w0, w1, w2, w3, HAS_SEQ)
    tl.store(dxin_b + t_k[:, None] * s_dxin_l + offs_d[None, :], dxin.to(dxin_b.dtype.element_ty), mask=m)


@fast_launch
@triton.jit
def conv_edges_kernel(g_ptr, dxin_ptr, cw_ptr, seq_ptr, L, Q, D, N_K, s_g_b, s_g_l, s_dxin_b, s_dxin_l, s_cw_d,
                      s_cw_k, HAS_SEQ: tl.constexpr, W: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_D: tl.constexpr):  # fmt: skip
    """dxin at the last three rows of each dx block (rows of chunk c from k * BLOCK_K, ending at the block's, the
    chunk's or the sequence's end), whose g at t+1 .. t+3 the next block's program stored. Grid: (B * NC * N_K,
    cdiv(D, BLOCK_D)); g: [B, L, D] (x's channels of the SSD's gradient buffer, holding g after the dx kernel)."""
    pid = tl.program_id(0)
    k = pid % N_K
    c = (pid // N_K) % tl.cdiv(L, Q)
    b = (pid // (N_K * tl.cdiv(L, Q))).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    start = c * Q + k * BLOCK_K
    end = tl.minimum(tl.minimum(start + BLOCK_K, c * Q + Q), L)
    t = end - 3 + tl.arange(0, 4)
    done = (tl.arange(0, 4) < 3) & (t >= start) & (t < end)
    conv_head_dxin(g_ptr + b * s_g_b, dxin_ptr + b * s_dxin_b, seq_ptr + b * L, cw_ptr, 0, t, done, offs_d, mask_d, L,
                   s_g_l, s_dxin_l, s_cw_d, s_cw_k, HAS_SEQ, W, BLOCK_D)  # fmt: skip


def conv_edges(g, conv: DxConv, seq, Q: int, dx_k: int) -> None:
    """Launch conv_edges_kernel after the dx kernel: g [B, L, D] (channel stride 1), conv as given to the dx kernel."""
    b, L, d = g.shape
    n_k = cdiv(Q, dx_k)
    block_d = 128
    conv_edges_kernel[(b * cdiv(L, Q) * n_k, cdiv(d, block_d))](
        g, conv.dxin, conv.weight, seq if seq is not None else g, L, Q, d, n_k, g.stride(0), g.stride(1),
        conv.dxin.stride(0), conv.dxin.stride(1), conv.weight.stride(0), conv.weight.stride(1),
        HAS_SEQ=seq is not None, W=conv.weight.shape[1], BLOCK_K=dx_k, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
