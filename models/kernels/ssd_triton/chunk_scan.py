"""The chunk scan forward: every output position from the state entering its chunk and the chunk's own tokens.

    y_l = [seq_l == seq_prev] exp(a_l) C_l S_inᵀ                          (state term, S_in: [P, N])
        + sum_{s <= l, seq_s == seq_l} CB_ls exp(a_l - a_s) dt_s x_s        (intra-chunk term)
        + D x_l
One program per (batch, chunk, block of positions l, block of P) and HEADS consecutive heads of one group (1 or 2);
the intra-chunk loop stops at the diagonal. CB comes from chunk_cb (shared by the heads of a group), S_in from
state_passing. With 2 heads the group's CB (float32) and C tiles are loaded once for both.
CB comes in already zeroed above the diagonal and across documents (cb_fwd), so the intra-chunk loop masks
nothing; the decay exponent is clamped at 0, so no inf is ever multiplied by a zero of CB. With FOLD_DT (config
fold_dt) dt_ptr holds a2dt = a_s log2(e) - log2(dt_s) (dt.py) instead of dt: the weight exp(a_l - a_s) dt_s is one
2^(a_l log2(e) - a2dt_s), without the multiply by dt_s; its exponent, (a_l - a_s) log2(e) + log2(dt_s), is no
longer <= 0 where the weight is real, so the clamp moves to FOLD_MAX_EXP (no real weight reaches it unless dt_s >=
2^64; a2dt = +inf where dt_s = 0 gives the weight 0).
"""

import triton
import triton.language as tl

from models.kernels.fast_launch import fast_launch
from models.kernels.fast_math import sigmoid
from models.kernels.pdl import pdl_prologue
from models.kernels.ssd_triton.chunk_cb import LOG2E
from models.kernels.ssd_triton.launch import program_ids

# The folded exponent's clamp (FOLD_DT): 2^64 * |CB x| stays finite in float32, and no true weight is clamped unless
# dt_s >= 2^64.
FOLD_MAX_EXP: tl.constexpr = tl.constexpr(64.0)


@fast_launch
@triton.jit
def chunk_scan_fwd_kernel(
    CB_ptr,
    x_ptr,
    dt_ptr,
    dA_ptr,
    C_ptr,
    S_in_ptr,
    D_ptr,
    seq_ptr,
    y_ptr,
    L,
    Q,
    NC,
    H,
    G,
    P,
    N,
    s_x_b,
    s_x_l,
    s_x_h,
    s_x_p,
    s_c_b,
    s_c_l,
    s_c_g,
    s_c_n,
    s_y_b,
    s_y_l,
    s_y_h,
    s_y_p,
    z_ptr,
    w_ptr,
    g_ptr,
    ss_ptr,
    s_z_b,
    s_z_l,
    J,
    HAS_SEQ: tl.constexpr,
    HAS_D: tl.constexpr,
    D_HAS_HDIM: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    HEADS: tl.constexpr,
    FOLD_DT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INNER_FIRST: tl.constexpr,
    GATE: tl.constexpr = False,
    FAST: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    pid_bch, pid_m, pid_p = program_ids(tl.cdiv(Q, BLOCK_M), tl.cdiv(P, BLOCK_P), INNER_FIRST)
    h0 = (pid_bch % (H // HEADS)) * HEADS
    c = (pid_bch // (H // HEADS)) % NC
    b = pid_bch // ((H // HEADS) * NC)
    g = h0 // (H // G)  # HEADS divides H // G (the launcher checks): both heads are in group g
    t0 = c * Q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    valid_m = (offs_m < Q) & (t0 + offs_m < L)
    t_m = (t0 + offs_m).to(tl.int64)
    head_q0 = ((b.to(tl.int64) * H + h0) * NC + c) * Q
    head_q1 = head_q0 + NC * Q  # head h0 + 1 (used only with HEADS 2)
    a2_m0 = tl.load(dA_ptr + head_q0 + offs_m, mask=offs_m < Q, other=0.0) * LOG2E
    if HEADS == 2:
        a2_m1 = tl.load(dA_ptr + head_q1 + offs_m, mask=offs_m < Q, other=0.0) * LOG2E

    # State term: C_l · S_in (all N), scaled per position (C is the group's: loaded once for both heads).
    keep_m = valid_m
    if HAS_SEQ:
        seq_m = tl.load(seq_ptr + b.to(tl.int64) * L + t_m, mask=valid_m, other=-1)
        prev = tl.load(seq_ptr + b.to(tl.int64) * L + tl.maximum(t0 - 1, 0))
        keep_m = keep_m & (seq_m == tl.where(c > 0, prev, 0))
    C_base = C_ptr + b.to(tl.int64) * s_c_b + g * s_c_g + t_m[:, None] * s_c_l
    S_base0 = S_in_ptr + ((b.to(tl.int64) * NC + c) * H + h0) * P * N + offs_p[None, :] * N
    acc0 = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    if HEADS == 2:
        acc1 = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        c_tile = tl.load(C_base + offs_n[None, :] * s_c_n, mask=valid_m[:, None] & mask_n[None, :], other=0.0)
        s_mask = mask_n[:, None] & mask_p[None, :]
        sT0 = tl.load(S_base0 + offs_n[:, None], mask=s_mask, other=0.0)
        acc0 += tl.dot(c_tile, sT0.to(c_tile.dtype), input_precision=PREC)
        if HEADS == 2:
            sT1 = tl.load(S_base0 + P * N + offs_n[:, None], mask=s_mask, other=0.0)
            acc1 += tl.dot(c_tile, sT1.to(c_tile.dtype), input_precision=PREC)
    acc0 = acc0 * tl.where(keep_m, tl.exp2(a2_m0), 0.0)[:, None]
    if HEADS == 2:
        acc1 = acc1 * tl.where(keep_m, tl.exp2(a2_m1), 0.0)[:, None]

    # Intra-chunk term, s <= l. CB is 0 above the diagonal, across documents and past the end (cb_fwd), so the
    # weights need no mask, only the clamp that keeps the decay finite where CB is 0; offsets within the chunk are
    # int32, and with EVEN (whole tiles) the loads carry no masks (kernel docstring of chunk_scan_bwd).
    x_chunk0 = x_ptr + b.to(tl.int64) * s_x_b + h0 * s_x_h + t0.to(tl.int64) * s_x_l
    CB_rows = CB_ptr + ((b.to(tl.int64) * NC + c) * G + g) * Q * Q + offs_m[:, None] * Q
    hi = tl.minimum((pid_m + 1) * BLOCK_M, Q)
    for k0 in range(0, hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_offs = offs_k[:, None] * s_x_l + offs_p[None, :] * s_x_p
        if EVEN:
            cb = tl.load(CB_rows + offs_k[None, :])
        else:
            cb = tl.load(CB_rows + offs_k[None, :], mask=(offs_m < Q)[:, None] & (offs_k < Q)[None, :], other=0.0)
        acc0 = scan_tile(acc0, cb, dA_ptr + head_q0, dt_ptr + head_q0, x_chunk0 + x_offs, a2_m0, offs_k, t0, L, Q,
                          mask_p, EVEN, PREC, FOLD_DT)  # fmt: skip
        if HEADS == 2:
            acc1 = scan_tile(acc1, cb, dA_ptr + head_q1, dt_ptr + head_q1, x_chunk0 + s_x_h + x_offs, a2_m1, offs_k,
                              t0, L, Q, mask_p, EVEN, PREC, FOLD_DT)  # fmt: skip

    # Both heads' loads (x and D for the D term, z and the norm's weight for the gate) before either head's stores:
    # the compiler cannot move a load above a store (the pointers might alias), so a load placed after a store waits
    # a memory round trip of its own (per program three more with the gate, one more without; chunk_scan_bwd's dx).
    # With the gate this takes 176 registers uncapped (two programs per SM): config scan_maxnreg holds it at 168.
    # Loading them earlier (before the loop or the state term) is slower: held through the products, the four tiles
    # cost a program per SM or spills (session 75: the 1.3B's gated scan 0.290 -> 0.353-0.440 ms; commit ca5aac4).
    inputs = both_heads_inputs(x_ptr, D_ptr, z_ptr, w_ptr, b, h0, offs_p, mask_p, valid_m, t_m, P, s_x_b, s_x_h,
                               s_x_l, s_x_p, s_z_b, s_z_l, HAS_D, D_HAS_HDIM, GATE, HEADS)  # fmt: skip
    x_m0, D_h0, z_m0, w_h0, x_m1, D_h1, z_m1, w_h1 = inputs
    # fmt: off
    acc0 = scan_store(acc0, x_m0, D_h0, y_ptr, b, h0, offs_p, mask_p, valid_m, t_m, s_y_b, s_y_h, s_y_l, s_y_p,
                      HAS_D=HAS_D, D_HAS_HDIM=D_HAS_HDIM)
    if GATE:
        ss = gate_store(acc0, z_m0, w_h0, g_ptr, b, h0, t_m, offs_p, mask_p, valid_m, L, H, P, FAST)
    if HEADS == 2:
        acc1 = scan_store(acc1, x_m1, D_h1, y_ptr, b, h0 + 1, offs_p, mask_p, valid_m, t_m, s_y_b, s_y_h, s_y_l,
                          s_y_p, HAS_D=HAS_D, D_HAS_HDIM=D_HAS_HDIM)
        if GATE:
            ss += gate_store(acc1, z_m1, w_h1, g_ptr, b, h0 + 1, t_m, offs_p, mask_p, valid_m, L, H, P, FAST)
    if GATE:  # this program's part of each row's sum of squares: part (head block, block of P) of J
        part = (h0 // HEADS) * tl.cdiv(P, BLOCK_P) + pid_p
        tl.store(ss_ptr + (b.to(tl.int64) * L + t_m) * J + part, ss, mask=valid_m)
    # fmt: on


@triton.jit
def scan_tile(acc, cb, dA_head, dt_head, x_ptrs, a2_m, offs_k, t0, L, Q, mask_p, EVEN: tl.constexpr,
               PREC: tl.constexpr, FOLD_DT: tl.constexpr):  # fmt: skip
    """acc += (CB ∘ exp(a_l - a_s) dt_s) · x over one block of s, for one head (FOLD_DT: dt_head holds a2dt)."""
    if EVEN:
        if not FOLD_DT:
            a_k = tl.load(dA_head + offs_k)
        dt_k = tl.load(dt_head + offs_k)
        x_tile = tl.load(x_ptrs)
    else:
        if not FOLD_DT:
            a_k = tl.load(dA_head + offs_k, mask=offs_k < Q, other=0.0)
        dt_k = tl.load(dt_head + offs_k, mask=offs_k < Q, other=float("inf") if FOLD_DT else 0.0)
        valid_k = (offs_k < Q) & (t0 + offs_k < L)
        x_tile = tl.load(x_ptrs, mask=valid_k[:, None] & mask_p[None, :], other=0.0)
    if FOLD_DT:
        w = cb * tl.exp2(tl.minimum(a2_m[:, None] - dt_k[None, :], FOLD_MAX_EXP))
    else:
        w = cb * tl.exp2(tl.minimum(a2_m[:, None] - a_k[None, :] * LOG2E, 0.0)) * dt_k[None, :]
    return acc + tl.dot(w.to(x_tile.dtype), x_tile, input_precision=PREC)


@triton.jit
def scan_store_inputs(x_ptr, D_ptr, z_ptr, w_ptr, b, h, offs_p, mask_p, valid_m, t_m, P, s_x_b, s_x_h, s_x_l, s_x_p,
                      s_z_b, s_z_l, HAS_D: tl.constexpr, D_HAS_HDIM: tl.constexpr, GATE: tl.constexpr):  # fmt: skip
    """What one head's scan_store and gate_store read: (x tile, D) with HAS_D, (z tile, the norm's weight) with GATE;
    0.0 for each that is not needed."""
    mask = valid_m[:, None] & mask_p[None, :]
    x_m = 0.0
    d = 0.0
    if HAS_D:
        x_m = tl.load(x_ptr + b.to(tl.int64) * s_x_b + h * s_x_h + t_m[:, None] * s_x_l + offs_p[None, :] * s_x_p,
                      mask=mask, other=0.0)  # fmt: skip
        if D_HAS_HDIM:
            d = tl.load(D_ptr + h * P + offs_p, mask=mask_p, other=0.0)
        else:
            d = tl.load(D_ptr + h)
    z = 0.0
    w = 0.0
    if GATE:
        cols = h * P + offs_p
        z = tl.load(z_ptr + b.to(tl.int64) * s_z_b + t_m[:, None] * s_z_l + cols[None, :], mask=mask, other=0.0)
        w = tl.load(w_ptr + cols, mask=mask_p, other=0.0)
    return x_m, d, z, w


@triton.jit
def both_heads_inputs(x_ptr, D_ptr, z_ptr, w_ptr, b, h0, offs_p, mask_p, valid_m, t_m, P, s_x_b, s_x_h, s_x_l, s_x_p,
                      s_z_b, s_z_l, HAS_D: tl.constexpr, D_HAS_HDIM: tl.constexpr, GATE: tl.constexpr,
                      HEADS: tl.constexpr):  # fmt: skip
    """scan_store_inputs of heads h0 and h0 + 1, all issued before any store: (x, D, z, w) of h0, then of h0 + 1 (with
    HEADS 1 those repeat h0's and go unused)."""
    x0, d0, z0, w0 = scan_store_inputs(x_ptr, D_ptr, z_ptr, w_ptr, b, h0, offs_p, mask_p, valid_m, t_m, P, s_x_b, s_x_h,
                                       s_x_l, s_x_p, s_z_b, s_z_l, HAS_D, D_HAS_HDIM, GATE)  # fmt: skip
    x1, d1, z1, w1 = x0, d0, z0, w0
    if HEADS == 2:
        x1, d1, z1, w1 = scan_store_inputs(x_ptr, D_ptr, z_ptr, w_ptr, b, h0 + 1, offs_p, mask_p, valid_m, t_m,
                                           P, s_x_b, s_x_h, s_x_l, s_x_p, s_z_b, s_z_l, HAS_D, D_HAS_HDIM,
                                           GATE)  # fmt: skip
    return x0, d0, z0, w0, x1, d1, z1, w1


@triton.jit
def scan_store(acc, x_m, d, y_ptr, b, h, offs_p, mask_p, valid_m, t_m, s_y_b, s_y_h, s_y_l, s_y_p,
                HAS_D: tl.constexpr, D_HAS_HDIM: tl.constexpr):  # fmt: skip
    """One head's output: + D x (x_m, d from scan_store_inputs), stored in y's dtype; returns it as stored (rounded),
    in float32."""
    if HAS_D:
        if D_HAS_HDIM:
            acc += x_m.to(tl.float32) * d[None, :]
        else:
            acc += x_m.to(tl.float32) * d
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(
        y_ptr + b.to(tl.int64) * s_y_b + h * s_y_h + t_m[:, None] * s_y_l + offs_p[None, :] * s_y_p,
        y,
        mask=valid_m[:, None] & mask_p[None, :],
    )
    return y.to(tl.float32)


@triton.jit
def gate_store(y, z, w, g_ptr, b, h, t_m, offs_p, mask_p, valid_m, L, H, P, FAST: tl.constexpr):  # fmt: skip
    """The gated norm's first half on one head's tile of y (as stored): the gated value v = y silu(z) times the
    norm's weight w to g (out_proj's input before its per-row 1 / rms, the norm's rows being all H * P channels), and
    the rows' sums of v^2 over the tile, returned [BLOCK_M] (gated_rmsnorm_triton.py's forward, split at its sum; z
    and w from scan_store_inputs)."""
    cols = h * P + offs_p
    mask = valid_m[:, None] & mask_p[None, :]
    z = z.to(tl.float32)
    v = y * (z * sigmoid(z, FAST))
    w = w.to(tl.float32)
    rows = b.to(tl.int64) * L + t_m  # g is [B, L, H * P], dense
    tl.store(g_ptr + rows[:, None] * (H * P) + cols[None, :], (v * w).to(g_ptr.dtype.element_ty), mask=mask)
    return tl.sum(v * v, axis=1)
