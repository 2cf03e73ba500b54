"""Depthwise causal conv1d (+ silu) in Triton, forward and backward, on channel-last data with documents (seq_idx).

causal_conv1d_ref's contract (conv_reference.py), for widths W <= 4:
    out[b, d, t] = act(bias[d] + sum_k weight[d, k] x[b, d, t - (W-1) + k] [seq[t - (W-1) + k] == seq[t]])
x is [B, D, L] with its channels contiguous (stride(1) == 1: the mixer's view of zxbcdt, any token stride); the
output is [B, D, L] over a dense [B, L, D] buffer, the same layout.

What it is for (docs/ssd_sessions.md, sessions 11, 17, 20 and 23): the CUDA conv where causal_conv1d is not installed
(ops.causal_conv1d prefers causal_conv1d's kernels), and the fused mixer's conv with documents, forward and
backward (split_conv1d_scan.py), where it is faster than causal_conv1d's channel-last kernels, which documents slow
down. H100, session 23, with documents: forward 1.3B 0.113 ms against 0.157, 370M 0.064 against 0.094; backward
1.3B 0.227 against 0.362, 370M 0.143 against 0.209. Without documents both directions are within a few percent of
causal_conv1d's (1.3B forward 0.109 against 0.114, backward 0.220-0.238 against 0.234), so causal_conv1d's stay
there.

Backward, for g_t = dout_t act'(pre_t) (pre: the conv before the activation, recomputed here):
    dx[s] = sum_j weight[W-1-j] g[s+j] [seq[s] == seq[s+j]]
    dweight[d, k] = sum_t g_t x[t - (W-1) + k] [seq[t - (W-1) + k] == seq[t]],    dbias[d] = sum_t g_t
Triton has no register shifts across a tile's rows, so the backward walks positions one at a time instead: each row
of a program's tile is a stream over consecutive positions that carries its last three x, g and ids from step to
step as loop-carried tiles (conv_bwd_kernel), so each x and dout row is loaded once and each g computed once. The
previous version, tiles of 16 positions that recomputed the four g each dx needs from seven shifted loads, ran
1.3B 0.491 ms; shifting g between rows with tl.gather or a scratch tile ran 0.97-1.48 (session 17). dweight / dbias
are summed element-wise in float32 per program and reduced once at the end; the host adds the programs' partial
sums (deterministic: no atomics). Entry points: causal_conv1d_triton (autograd; ops.causal_conv1d on CUDA without
causal_conv1d, under model.kernels "auto" / "triton") and the bare halves conv_forward_triton / conv_backward_triton
(split_conv1d_scan.py's kernel halves, benchmarks/bench_conv.py).
Imports triton at import time: import this module lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels.column_sums import column_sums
from models.kernels.fast_launch import cdiv, fast_launch
from models.kernels.fast_math import fast_on_this_backend, prefetch_l2, sigmoid
from models.kernels.pdl import pdl_prologue

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


@triton.jit
def _rows(base, offs_t, offs_d, mask_d, L, s_l):
    """Rows offs_t (0 outside [0, L)) of a channel-last [L, D] tensor as [len(offs_t), BLOCK_D] in its dtype."""
    ok = (offs_t >= 0) & (offs_t < L)
    return tl.load(base + offs_t[:, None] * s_l + offs_d[None, :], mask=ok[:, None] & mask_d[None, :], other=0.0)


@triton.jit
def _group_row(bias, w0, w1, w2, w3, xa, xb, xc, xd, sa, sb, sc, sd, out_b, t_G, offs_d, mask_d, L, s_o_l,
               MASKED: tl.constexpr, SILU: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """One output row of each group (positions t_G): the taps xa ... xd (x at t_G - 3 ... t_G), stored."""
    pre = _pre(bias, w0, w1, w2, w3, xa, xb, xc, xd, sa, sb, sc, sd, MASKED)
    if SILU:
        pre = pre * sigmoid(pre, FAST)
    out = out_b + t_G[:, None] * s_o_l + offs_d[None, :]
    tl.store(out, pre.to(out_b.dtype.element_ty), mask=(t_G < L)[:, None] & mask_d[None, :])


@triton.jit
def _group_rows(xm3, xm2, xm1, x0, x1, x2, x3, seq_b, out_b, t_G, offs_d, mask_d, L, s_o_l, bias, w0, w1, w2, w3,
                MASKED: tl.constexpr, SILU: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """The four output rows t_G + 0 ... 3 of each group from the seven x rows t_G - 3 ... t_G + 3 (as loaded),
    each converted once; the taps tested for their documents when MASKED."""
    xm3, xm2, xm1, x0 = xm3.to(tl.float32), xm2.to(tl.float32), xm1.to(tl.float32), x0.to(tl.float32)
    x1, x2, x3 = x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
    sm3 = _ids(seq_b, t_G - 3, L, MASKED)
    sm2 = _ids(seq_b, t_G - 2, L, MASKED)
    sm1 = _ids(seq_b, t_G - 1, L, MASKED)
    s0 = _ids(seq_b, t_G, L, MASKED)
    s1 = _ids(seq_b, t_G + 1, L, MASKED)
    s2 = _ids(seq_b, t_G + 2, L, MASKED)
    s3 = _ids(seq_b, t_G + 3, L, MASKED)
    _group_row(bias, w0, w1, w2, w3, xm3, xm2, xm1, x0, sm3, sm2, sm1, s0, out_b, t_G, offs_d, mask_d, L, s_o_l,
               MASKED, SILU, FAST)  # fmt: skip
    _group_row(bias, w0, w1, w2, w3, xm2, xm1, x0, x1, sm2, sm1, s0, s1, out_b, t_G + 1, offs_d, mask_d, L, s_o_l,
               MASKED, SILU, FAST)  # fmt: skip
    _group_row(bias, w0, w1, w2, w3, xm1, x0, x1, x2, sm1, s0, s1, s2, out_b, t_G + 2, offs_d, mask_d, L, s_o_l,
               MASKED, SILU, FAST)  # fmt: skip
    _group_row(bias, w0, w1, w2, w3, x0, x1, x2, x3, s0, s1, s2, s3, out_b, t_G + 3, offs_d, mask_d, L, s_o_l,
               MASKED, SILU, FAST)  # fmt: skip


@fast_launch
@triton.jit
def conv_fwd_kernel(x_ptr, w_ptr, bias_ptr, seq_ptr, out_ptr, L, D, s_x_b, s_x_l, s_o_b, s_o_l, s_w_d, s_w_k,
                    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr, W: tl.constexpr,
                    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, CHANNELS_FASTEST: tl.constexpr,
                    FAST: tl.constexpr, ONE_DOC_BRANCH: tl.constexpr, PDL: tl.constexpr = False,
                    WIDE: tl.constexpr = False):  # fmt: skip
    """BLOCK_L positions x BLOCK_D channels, as BLOCK_L / 4 groups of four consecutive positions: a group's four
    output rows come from seven x rows (t - 3 ... t + 3), each loaded and converted once. (Before session 38 each
    output row loaded its four taps: 4 loads and conversions per output element where this takes 1.75; sm_90 SASS
    with documents 928 -> 712 instructions per program, H200 68 -> 62-64 mJ and 0.097 -> 0.091 ms per call at the
    1.3B shape, docs/performance.md.)"""
    # CHANNELS_FASTEST: the programs running at once cover whole rows of x (every channel block of the same
    # positions), not one channel block of many positions (1.3B shape with documents: 0.118 against 0.127 ms, H100).
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    if WIDE:  # a batch row's offsets reach 2^31 (_wide_offsets): int64 strides make every row offset int64
        s_x_l, s_o_l = s_x_l.to(tl.int64), s_o_l.to(tl.int64)
    if CHANNELS_FASTEST:
        pid_d = tl.program_id(0)
        pid_l = tl.program_id(1)
    else:
        pid_l = tl.program_id(0)
        pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    bias, w0, w1, w2, w3 = _channel_params(w_ptr, bias_ptr, offs_d, mask_d, s_w_d, s_w_k, HAS_BIAS, W, BLOCK_D)
    x_b = x_ptr + b * s_x_b
    seq_b = seq_ptr + b * L
    out_b = out_ptr + b * s_o_b
    t_G = pid_l * BLOCK_L + 4 * tl.arange(0, BLOCK_L // 4)
    xm3, xm2 = _rows(x_b, t_G - 3, offs_d, mask_d, L, s_x_l), _rows(x_b, t_G - 2, offs_d, mask_d, L, s_x_l)
    xm1, x0 = _rows(x_b, t_G - 1, offs_d, mask_d, L, s_x_l), _rows(x_b, t_G, offs_d, mask_d, L, s_x_l)
    x1, x2 = _rows(x_b, t_G + 1, offs_d, mask_d, L, s_x_l), _rows(x_b, t_G + 2, offs_d, mask_d, L, s_x_l)
    x3 = _rows(x_b, t_G + 3, offs_d, mask_d, L, s_x_l)
    if HAS_SEQ and ONE_DOC_BRANCH:
        # Documents are runs of equal ids, so the window (positions start - 3 ... start + BLOCK_L - 1, clipped to
        # [0, L): x is 0 outside) lies in one document iff its two ends have the same id: two scalar loads, no
        # reduction, and then no per-tap document test.
        start = pid_l * BLOCK_L
        first = tl.load(seq_b + tl.maximum(start - 3, 0))
        last = tl.load(seq_b + tl.minimum(start + BLOCK_L, L) - 1)
        if first == last:
            _group_rows(xm3, xm2, xm1, x0, x1, x2, x3, seq_b, out_b, t_G, offs_d, mask_d, L, s_o_l, bias, w0, w1, w2,
                        w3, False, SILU, FAST)  # fmt: skip
        else:
            _group_rows(xm3, xm2, xm1, x0, x1, x2, x3, seq_b, out_b, t_G, offs_d, mask_d, L, s_o_l, bias, w0, w1, w2,
                        w3, True, SILU, FAST)  # fmt: skip
    else:
        _group_rows(xm3, xm2, xm1, x0, x1, x2, x3, seq_b, out_b, t_G, offs_d, mask_d, L, s_o_l, bias, w0, w1, w2, w3,
                    HAS_SEQ, SILU, FAST)  # fmt: skip


@triton.jit
def _stream_row(base, u_R, offs_d, mask_d, L, s_l, NONNEG: tl.constexpr = False):
    """Rows u_R of a channel-last [L, D] tensor: [ROWS, BLOCK_D] in its dtype, 0 outside [0, L) (NONNEG: u_R >= 0
    is known, only the end is tested)."""
    ok = (u_R < L) if NONNEG else (u_R >= 0) & (u_R < L)
    ptrs = base + u_R[:, None] * s_l + offs_d[None, :]  # int32 unless the kernel widened s_l (WIDE)
    return tl.load(ptrs, mask=ok[:, None] & mask_d[None, :], other=0.0)


@triton.jit
def _stream_rows(x_b, dout_b, seq_b, u_R, offs_d, mask_d, L, s_x_l, s_y_l, HAS_SEQ: tl.constexpr):
    """x and dout at positions u_R >= 0 ([ROWS, BLOCK_D] in their dtypes, 0 from L on) and their document ids."""
    x = _stream_row(x_b, u_R, offs_d, mask_d, L, s_x_l, True)
    dy = _stream_row(dout_b, u_R, offs_d, mask_d, L, s_y_l, True)
    return x, dy, _ids(seq_b, u_R, L, HAS_SEQ)


@triton.jit
def _stream_window(x_b, seq_b, start_R, offs_d, mask_d, L, s_x_l, HAS_SEQ: tl.constexpr):
    """The window before each stream's first position: x at start - 3, - 2, - 1 (float32) and their ids."""
    xm3 = _stream_row(x_b, start_R - 3, offs_d, mask_d, L, s_x_l).to(tl.float32)
    xm2 = _stream_row(x_b, start_R - 2, offs_d, mask_d, L, s_x_l).to(tl.float32)
    xm1 = _stream_row(x_b, start_R - 1, offs_d, mask_d, L, s_x_l).to(tl.float32)
    sm3 = _ids(seq_b, start_R - 3, L, HAS_SEQ)
    sm2 = _ids(seq_b, start_R - 2, L, HAS_SEQ)
    sm1 = _ids(seq_b, start_R - 1, L, HAS_SEQ)
    return xm3, xm2, xm1, sm3, sm2, sm1


@triton.jit
def _stream_grad(bias, w0, w1, w2, w3, xm3, xm2, xm1, x0, sm3, sm2, sm1, s0, dy, HAS_SEQ: tl.constexpr,
                 SILU: tl.constexpr, FAST: tl.constexpr):  # fmt: skip
    """g at the newest position u of each row (x0 = x[u], xm3 = x[u - 3]): dout act'(pre), float32."""
    pre = _pre(bias, w0, w1, w2, w3, xm3, xm2, xm1, x0, sm3, sm2, sm1, s0, HAS_SEQ)
    g = dy.to(tl.float32)
    if SILU:
        sig = sigmoid(pre, FAST)
        g = g * sig * (1.0 + pre * (1.0 - sig))
    return g


@triton.jit
def _stream_dx(gm3, gm2, gm1, g0, sm3, sm2, sm1, s0, w0, w1, w2, w3, HAS_SEQ: tl.constexpr):
    """dx at t = u - 3: w3 g[t] + w2 g[t+1] + w1 g[t+2] + w0 g[t+3], each g in t's document."""
    dx = gm3 * w3[None, :]
    dx += _same(gm2, sm2, sm3, HAS_SEQ) * w2[None, :]
    dx += _same(gm1, sm1, sm3, HAS_SEQ) * w1[None, :]
    dx += _same(g0, s0, sm3, HAS_SEQ) * w0[None, :]
    return dx


@fast_launch
@triton.jit
def conv_bwd_kernel(x_ptr, w_ptr, bias_ptr, seq_ptr, dout_ptr, dx_ptr, dw_part_ptr, db_part_ptr, L, D, N_PARTS, SEG,
                    s_x_b, s_x_l, s_y_b, s_y_l, s_dx_b, s_dx_l, s_w_d, s_w_k,
                    HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, SILU: tl.constexpr, W: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, UNROLL: tl.constexpr,
                    FAST: tl.constexpr, ONE_DOC_BRANCH: tl.constexpr, L2_AHEAD: tl.constexpr = 0,
                    STAGES: tl.constexpr = 1, PDL: tl.constexpr = False, WIDE: tl.constexpr = False):  # fmt: skip
    """Rows of a tile are ROWS streams, each walking SEG consecutive positions of its own (row r of program p starts
    at (p * ROWS + r) * SEG). A stream carries x, g and the ids of its last three positions from step to step, so
    each x and dout row is loaded once and each g computed once (the shift is a renaming of loop-carried tiles): per
    step it loads x[u] and dout[u], computes g[u], adds g[u]'s weight- and bias-gradient terms and stores
    dx[u - 3]. The first three steps only fill the window; three steps past the segment finish its last dx."""
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    if WIDE:  # as conv_fwd_kernel's
        s_x_l, s_y_l, s_dx_l = s_x_l.to(tl.int64), s_y_l.to(tl.int64), s_dx_l.to(tl.int64)
    pid_s = tl.program_id(0)
    pid_d = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    bias, w0, w1, w2, w3 = _channel_params(w_ptr, bias_ptr, offs_d, mask_d, s_w_d, s_w_k, HAS_BIAS, W, BLOCK_D)
    seq_b = seq_ptr + b * L
    start = pid_s * ROWS * SEG
    # The program's partial sums: [B * N_PARTS, D, 4] (tap k of 4, as _weight numbers them) and [B * N_PARTS, D].
    part = b * N_PARTS + pid_s
    x_b, dout_b, dx_b = x_ptr + b * s_x_b, dout_ptr + b * s_y_b, dx_ptr + b * s_dx_b
    dw_part, db_part = dw_part_ptr + part * 4 * D, db_part_ptr + part * D
    # fmt: off
    if HAS_SEQ and ONE_DOC_BRANCH:
        # The program reads positions start - 3 ... start + ROWS * SEG + 2 (clipped to [0, L)); documents are runs
        # of equal ids, so they lie in one document iff its two ends have the same id: then no document tests.
        first = tl.load(seq_b + tl.maximum(start - 3, 0))
        last = tl.load(seq_b + tl.minimum(start + ROWS * SEG + 3, L) - 1)
        if first == last:
            _streams(x_b, dout_b, seq_b, dx_b, dw_part, db_part, start, pid_d * BLOCK_D, offs_d, mask_d, L, D, SEG,
                     s_x_l, s_y_l, s_dx_l, bias, w0, w1, w2, w3, False, SILU, ROWS, BLOCK_D, PREFETCH, UNROLL, FAST,
                     L2_AHEAD, STAGES)
        else:
            _streams(x_b, dout_b, seq_b, dx_b, dw_part, db_part, start, pid_d * BLOCK_D, offs_d, mask_d, L, D, SEG,
                     s_x_l, s_y_l, s_dx_l, bias, w0, w1, w2, w3, True, SILU, ROWS, BLOCK_D, PREFETCH, UNROLL, FAST,
                     L2_AHEAD, STAGES)
    else:
        _streams(x_b, dout_b, seq_b, dx_b, dw_part, db_part, start, pid_d * BLOCK_D, offs_d, mask_d, L, D, SEG,
                 s_x_l, s_y_l, s_dx_l, bias, w0, w1, w2, w3, HAS_SEQ, SILU, ROWS, BLOCK_D, PREFETCH, UNROLL, FAST,
                 L2_AHEAD, STAGES)
    # fmt: on


@triton.jit
def _streams(x_b, dout_b, seq_b, dx_b, dw_part, db_part, start, d_start, offs_d, mask_d, L, D, SEG, s_x_l, s_y_l,
             s_dx_l, bias, w0, w1, w2, w3, HAS_SEQ: tl.constexpr, SILU: tl.constexpr, ROWS: tl.constexpr,
             BLOCK_D: tl.constexpr, PREFETCH: tl.constexpr, UNROLL: tl.constexpr, FAST: tl.constexpr,
             L2_AHEAD: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """conv_bwd_kernel's streams from the start of the program's first one: dx stored, the program's weight- and
    bias-gradient sums stored at dw_part ([4, D]) and db_part ([D])."""
    start_R = start + tl.arange(0, ROWS) * SEG
    # The window before the segment: x and ids at start - 3 ... start - 1 (g there is not needed).
    xm3, xm2, xm1, sm3, sm2, sm1 = _stream_window(x_b, seq_b, start_R, offs_d, mask_d, L, s_x_l, HAS_SEQ)
    dw0 = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    dw1 = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    dw2 = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    dw3 = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    db = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    # Three separate zero tiles: Triton carries a variable through the loop only where its value after the body is
    # another object than before it, so three names sharing one object would make the rotation below look like a
    # no-op for gm3 / gm2 (a wrong dx compiled; the interpreter would not show it).
    gm3 = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    gm2 = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    gm1 = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    # Loads in flight while a step computes: PREFETCH 0 loads each position's rows at its step and lets Triton's
    # software pipeliner issue them STAGES - 1 iterations ahead (cp.async into shared memory, no registers held);
    # PREFETCH 1 or 2 loads that many positions ahead into registers (the loop then runs unpipelined, STAGES 1).
    # Triton pipelines the loop only when no loaded value is carried through two iterations: with UNROLL 2 the
    # window's x[u - 3] is (one iteration's x0 -> xm1 -> the next's xm2 -> xm3), and the loop compiles without
    # cp.async; with UNROLL >= 3 the window comes from the previous iteration only (kernel_resources.py --loops,
    # tests/test_kernel_resources.py).
    if PREFETCH > 0:
        xa, dya, sa = _stream_rows(x_b, dout_b, seq_b, start_R, offs_d, mask_d, L, s_x_l, s_y_l, HAS_SEQ)
    if PREFETCH == 2:
        xb, dyb, sb = _stream_rows(x_b, dout_b, seq_b, start_R + 1, offs_d, mask_d, L, s_x_l, s_y_l, HAS_SEQ)
    # UNROLL steps per iteration of the loop, unrolled (tl.static_range): the window's rotation is then a renaming at
    # compile time; in a rolled loop it costs a register move per carried value and step (~35 of the step's ~250
    # instructions at the defaults; ptxas, sm_90). Steps past SEG + 3 (when UNROLL does not divide it) do nothing.
    for j0 in tl.range(0, SEG + 3, UNROLL, num_stages=STAGES):
        for jj in tl.static_range(UNROLL):
            j = j0 + jj
            u_R = start_R + j
            if L2_AHEAD > 0:  # each stream's x and dout lines L2_AHEAD positions on, asked into L2 (a hint)
                ahead = tl.minimum(u_R + L2_AHEAD, L - 1).to(tl.int64)
                prefetch_l2(x_b + ahead * s_x_l + d_start, FAST)
                prefetch_l2(dout_b + ahead * s_y_l + d_start, FAST)
            if PREFETCH == 0:  # loaded at their step; with STAGES > 1 Triton's pipeliner issues them ahead (cp.async)
                x0, dy, s0 = _stream_rows(x_b, dout_b, seq_b, u_R, offs_d, mask_d, L, s_x_l, s_y_l, HAS_SEQ)
            else:
                x0, dy, s0 = xa, dya, sa
            if PREFETCH == 2:
                xa, dya, sa = xb, dyb, sb
                xb, dyb, sb = _stream_rows(x_b, dout_b, seq_b, u_R + 2, offs_d, mask_d, L, s_x_l, s_y_l, HAS_SEQ)
            elif PREFETCH == 1:
                xa, dya, sa = _stream_rows(x_b, dout_b, seq_b, u_R + 1, offs_d, mask_d, L, s_x_l, s_y_l, HAS_SEQ)
            x0 = x0.to(tl.float32)
            g0 = _stream_grad(bias, w0, w1, w2, w3, xm3, xm2, xm1, x0, sm3, sm2, sm1, s0, dy, HAS_SEQ, SILU, FAST)
            # Steps past the segment compute g for the last dx only (their weight terms belong to the next stream),
            # and the first three store no dx (their t is the previous stream's): selects, not branches, in the loop.
            g_own = tl.where(j < SEG, g0, 0.0)
            db += g_own
            dw0 += g_own * _same(xm3, sm3, s0, HAS_SEQ)
            dw1 += g_own * _same(xm2, sm2, s0, HAS_SEQ)
            dw2 += g_own * _same(xm1, sm1, s0, HAS_SEQ)
            dw3 += g_own * x0
            t_R = u_R - 3
            dx = _stream_dx(gm3, gm2, gm1, g0, sm3, sm2, sm1, s0, w0, w1, w2, w3, HAS_SEQ)
            dx_ptrs = dx_b + t_R[:, None] * s_dx_l + offs_d[None, :]
            own_t = (t_R >= start_R) & (t_R < start_R + SEG) & (t_R < L)
            tl.store(dx_ptrs, dx.to(dx_b.dtype.element_ty), mask=own_t[:, None] & mask_d[None, :])
            xm3, xm2, xm1 = xm2, xm1, x0
            sm3, sm2, sm1 = sm2, sm1, s0
            gm3, gm2, gm1 = gm2, gm1, g0
    # [BLOCK_D, 4]: channel d's four taps side by side, the weight's own layout (its sum over parts needs no
    # transpose). join(join(t0, t2), join(t1, t3)) is [BLOCK_D, 2, 2] with [d, i, j] = tap 2 i + j.
    dw = tl.join(tl.join(tl.sum(dw0, axis=0), tl.sum(dw2, axis=0)), tl.join(tl.sum(dw1, axis=0), tl.sum(dw3, axis=0)))
    dw = tl.reshape(dw, (BLOCK_D, 4))
    tl.store(dw_part + offs_d[:, None] * 4 + tl.arange(0, 4)[None, :], dw, mask=mask_d[:, None])
    tl.store(db_part + offs_d, tl.sum(db, axis=0), mask=mask_d)


# Offsets within a batch row (position times row stride, plus channel) are int32 in both kernels: the backward's
# stream loop took 590 / 765 sm_90 instructions per four steps (one-document path / the other) with 64-bit ones and
# 552 / 730 with these, 544 / 717 with its loads testing only the row's end (positions there are >= 0), 149 and 147
# registers (Triton 3.6, session 60). Timed on an H100 in session 61 (bench_conv.py's run, old and new loops
# alternating): 185.4-186.1 us both without documents, 198.1-198.5 -> 196.9-197.1 with them; the 1.3B's step
# unchanged (49,873 / 49,973 against 49,943 / 49,968 tokens/s, losses bit for bit): the kernel waits on memory
# latency, not on issue. Kept for the offsets below. Where a row's offsets could
# reach 2^31 (e.g. L 256k at the 1.3B's row stride of 8512), the kernels take their row strides as int64 instead
# (WIDE); before session 60 the forward's int32 products would have wrapped there.
_OFFSET_LIMIT = 2**31


def _wide_offsets(L: int, d: int, *row_strides: int) -> bool:
    """Whether offsets of positions -3 ... L + 3 (the kernels' windows) of a [L, d] row can reach _OFFSET_LIMIT."""
    return (L + 4) * max(row_strides) + d >= _OFFSET_LIMIT


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


# Tiles (positions x channels) and warps; benchmarks/bench_conv.py --tune times the alternatives. Forward (positions a
# multiple of 4: groups of four): 128 channels x 32 positions (H100, session 17, with documents: 1.3B 0.127 ms against
# 0.142 with 64 x 64, 370M 0.070 against 0.080; H200, session 37, in joules: 68.5 mJ against 69.8-125.4 for six
# other tiles).
_FWD_BLOCK_D = 128
_FWD_BLOCK_L = 32
_FWD_WARPS = 4
_FWD_CHANNELS_FASTEST = True  # the grid's first axis walks channel blocks (see conv_fwd_kernel)
# With documents, a program whose window (positions start - 3 ... start + 31) lies in one document (its two end ids
# equal: two scalar loads; this relies on ids that do not decrease along a row, which the SSD kernels require too)
# runs the body without per-tap document tests (conv_fwd_kernel). sm_90 SASS, Triton 3.6, 1.3B tiles: 601
# instructions on that path and 734 on the other, against 712 (no documents: 576); with ~1000-token documents 96-97%
# of programs take the short path. Session 38's branch, whose test reduced the window's 35 ids across the program,
# drew less power but ran 15% longer. Session 43 (H200, bench_energy.py, 3 s windows, between three baselines within
# 0.1% of each other): 67.04 -> 64.73 mJ per call (-3.45%), 0.0956 -> 0.0919 ms.
_FWD_ONE_DOC_BRANCH = True
# A forward as streams (the backward's layout: each x row loaded once, the window carried; 64 registers) was slower
# (session 24, H100, 1.3B / 370M with documents: 0.129-0.160 / 0.080-0.096 ms against this tiled one's 0.113 /
# 0.064) and was removed.
# Backward: ROWS streams per program, BLOCK_D channels (conv_bwd_kernel). H100, session 23, 1.3B / 370M with
# documents: two steps per loop iteration and the fast sigmoid 0.227 / 0.143 ms, against 0.280 / 0.175 rolled with
# tl.sigmoid; rolled with the fast sigmoid 0.278 / 0.173; two steps with tl.sigmoid 0.251 / 0.156; four steps 0.268 /
# 0.153 (134 registers: three programs per SM instead of four); loading 3 or 4 positions ahead instead of 2 0.31-0.33
# (the loop is bound by its instructions, ~250 per step rolled, not by memory latency). Session 20, 1.3B with documents,
# 64 positions per stream: 0.277 ms; 2 streams at 2 warps or 256 channels x 2 streams, or one position prefetched
# instead of two, within 1%; 32 or 128 positions per stream 0.29; 8 streams at 4 warps (242 registers) 0.31.
# 64 positions per stream: a grid of 4.12 waves at the 1.3B (4 programs per SM at 128 registers); a split chosen
# to fill the last wave (54 positions, 4.9 waves; 370M 47) timed within the calls' noise of it (session 20, call 10).
# Session 49 (H100, time and joules under sustained load, 1.3B with documents, one-document branch on): 64 channels
# x 8 streams 222.3 us against 229.7 at 128 x 4 (256 x 2: 225.5; 2 streams at 2 warps 228.3; 32 or 128 positions
# per stream 249.0 / 237.3; one position loaded ahead 228.8; rolled 269.6). The H100 runs this kernel below its
# power limit (550-640 W), so in a step it costs its time: the 1.3B's step grew by about the time of a sleep or a
# copy put into it, not by their joules (docs/ssd_sessions.md, session 49). The weight- and bias-gradient sums
# finished inside the kernel by each channel block's last program (an atomic ticket) instead of the two PyTorch
# reductions below ran slower (225.5 us with a serial sum, 244 with 8 partial sums per load, which took the stream
# loop from 19 to 28 register moves, against 222.6 in one CUDA graph) and were not kept.
_BWD_BLOCK_D = 64
_BWD_ROWS = 8
_BWD_SEG = 64
_BWD_WARPS = 4
# The stream loop software-pipelined by Triton (since session 58): PREFETCH 0 (each position loaded at its step),
# STAGES 3 (cp.async two iterations ahead: 8 positions in flight per stream, 16.6 KB of shared memory), UNROLL 4
# (at 2 Triton does not pipeline the loop: conv_bwd_kernel's comment). Compiled (Triton 3.6, sm_90, documents):
# 149 registers (three programs per SM, against four at 128 for session 55's two positions in registers + L2 hints),
# 590 / 765 instructions per four steps (one-document path / the other) against 335 / 411 per two (544 / 717 and 147
# registers since session 60's int32 row offsets, _OFFSET_LIMIT's comment). H100, session 58
# (bench_conv.py's run, do_bench, documents, two calls), us: 1.3B 207.1-207.2 -> 198.6-199.0, 370M 130.9-134.7 ->
# 115.8-116.4; STAGES 2 (128 registers) 215.1 / 130.7; STAGES 4 195.0 / 119.8; STAGES 5 195.1 / 121.8; UNROLL 3 at
# STAGES 2 254.4 / 144.4; L2 hints on top (6 or 12 ahead) slower (217-222 / 128). Outputs unchanged (against
# causal_conv1d: dx 1.7e-5, dw 2.5e-7).
_BWD_PREFETCH = 0  # positions loaded ahead into registers (1 or 2, with STAGES 1); 0: at their step (pipelined)
_BWD_STAGES = 3  # the stream loop's software-pipelining stages (Triton's cp.async), with PREFETCH 0
_BWD_UNROLL = 4  # steps per iteration of the stream loop, unrolled (see conv_bwd_kernel)
# The same for the backward's programs (window start - 3 ... start + ROWS * SEG + 2, 75-83% of them in one document
# at ~1000-token documents): the stream loop 301 instructions per two steps on that path, 373 on the other, against
# 377 (Triton 3.6, 128 registers both ways). Session 43 (H200, bench_energy.py, 3 s windows) measured it equal
# in joules (124.8 against 124.8 mJ) and 5.6% slower (0.190 against 0.180 ms); on the H100 (session 49, the
# target's device, at 128 x 4) it is faster and cheaper: 0.229 against 0.234 ms, 124.9-127.7 against 131.9-132.8 mJ
# (bench_energy.py, two processes each, alternating). On since session 49.
_BWD_ONE_DOC_BRANCH = True
# Positions ahead at which each stream asks for its x and dout lines into L2 (prefetch.global.L2, one CCTL.E.PF2
# per line and step: 304 -> 335 instructions per two steps, 128 registers still; 0: none). The loop holds only
# PREFETCH positions of loads in flight (in registers); the hint starts the following lines' DRAM reads earlier
# without holding any. Session 55 (H100, 1.3B with documents, CUDA graphs of 20 calls, three rounds): none
# 211.7-212.6 us, 2 ahead 200.7-201.4, **3 198.8-199.0**, 4 198.8-199.6, 5 201.0-201.4, 6 203.5-203.8, 8 217.7-218.3,
# 16 261, 32 284 (lines asked for too early are evicted before their loads come); 370M 124.2-124.5 none, 124.5-124.8
# at 3. Outputs bit for bit the same. Off since session 58: the pipelined loop has its loads in flight already, and
# hints on top of it ran slower (above).
_BWD_L2_AHEAD = 0
# ptxas's register cap for the backward (None: its choice, 149 at the defaults: three 4-warp programs per SM; a cap
# of 128 spills 40 bytes there, Triton 3.6).
_BWD_MAXNREG = None
# The sigmoid of the silu from the approximate MUFU instructions (ex2 / rcp .approx.ftz), in both kernels, on the GPU
# (tl.sigmoid's PTX wraps each in range checks: ~18 of a rolled step's ~237 instructions); the interpreter (the CPU
# tests) runs the same formula with tl.exp2 and a division. Outputs against causal_conv1d's unchanged at bf16
# (relative differences out 1.5e-5, dx 1.7e-5, dw 2.5e-7, session 23).
_FAST_SIGMOID = True


def _fast() -> bool:
    return _FAST_SIGMOID and fast_on_this_backend()


def conv_forward_triton(x_BDL, weight_DW, bias_D, seq_idx_BL, silu: bool) -> torch.Tensor:
    """[B, D, L] (channels contiguous) -> [B, D, L] in x's dtype over a dense [B, L, D] buffer; no autograd."""
    _check(x_BDL, weight_DW, seq_idx_BL)
    b, d, L = x_BDL.shape
    if _FWD_BLOCK_L % 4:
        raise ValueError(
            f"conv_triton._FWD_BLOCK_L must be a multiple of 4 (groups of four positions), got {_FWD_BLOCK_L}"
        )
    out_BLD = torch.empty(b, L, d, device=x_BDL.device, dtype=x_BDL.dtype)
    grid = (cdiv(L, _FWD_BLOCK_L), cdiv(d, _FWD_BLOCK_D), b)
    conv_fwd_kernel[(grid[1], grid[0], b) if _FWD_CHANNELS_FASTEST else grid](
        x_BDL, weight_DW, bias_D if bias_D is not None else weight_DW, seq_idx_BL if seq_idx_BL is not None else x_BDL,
        out_BLD, L, d, x_BDL.stride(0), x_BDL.stride(2), out_BLD.stride(0), out_BLD.stride(1),
        weight_DW.stride(0), weight_DW.stride(1),
        HAS_BIAS=bias_D is not None, HAS_SEQ=seq_idx_BL is not None, SILU=silu, W=weight_DW.shape[1],
        BLOCK_L=_FWD_BLOCK_L, BLOCK_D=_FWD_BLOCK_D, CHANNELS_FASTEST=_FWD_CHANNELS_FASTEST, FAST=_fast(),
        ONE_DOC_BRANCH=_FWD_ONE_DOC_BRANCH, WIDE=_wide_offsets(L, d, x_BDL.stride(2), out_BLD.stride(1)),
        num_warps=_FWD_WARPS,
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
    n_parts = cdiv(L, _BWD_ROWS * _BWD_SEG)
    seg = cdiv(L, _BWD_ROWS * n_parts)
    dw_part = torch.empty(b * n_parts, d, 4, device=x_BDL.device, dtype=torch.float32)
    db_part = torch.empty(b * n_parts, d, device=x_BDL.device, dtype=torch.float32)
    conv_bwd_kernel[(n_parts, cdiv(d, _BWD_BLOCK_D), b)](
        x_BDL, weight_DW, bias_D if bias_D is not None else weight_DW, seq_idx_BL if seq_idx_BL is not None else x_BDL,
        dout_BDL, dx_BDL, dw_part, db_part, L, d, n_parts, seg, x_BDL.stride(0), x_BDL.stride(2),
        dout_BDL.stride(0), dout_BDL.stride(2), dx_BDL.stride(0), dx_BDL.stride(2),
        weight_DW.stride(0), weight_DW.stride(1),
        HAS_BIAS=bias_D is not None, HAS_SEQ=seq_idx_BL is not None, SILU=silu, W=weight_DW.shape[1],
        ROWS=_BWD_ROWS, BLOCK_D=_BWD_BLOCK_D, PREFETCH=_BWD_PREFETCH, UNROLL=_BWD_UNROLL, FAST=_fast(),
        ONE_DOC_BRANCH=_BWD_ONE_DOC_BRANCH, L2_AHEAD=_BWD_L2_AHEAD, STAGES=_BWD_STAGES,
        WIDE=_wide_offsets(L, d, x_BDL.stride(2), dout_BDL.stride(2), dx_BDL.stride(2)), num_warps=_BWD_WARPS,
        maxnreg=_BWD_MAXNREG,
    )  # fmt: skip
    W = weight_DW.shape[1]
    # [d, 4], contiguous like the weight (no copy after the sum), and the bias's [d], in one launch
    dw, db = column_sums(dw_part, db_part) if bias_D is not None else (column_sums(dw_part), None)
    if W < 4:
        dw = dw[:, 4 - W :].contiguous()  # taps 4 - W ... 3 are the weight's columns
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
