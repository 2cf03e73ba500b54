"""The chunk scan forward: every output position from the state entering its chunk and the chunk's own tokens.

    y_l = [seq_l == seq_prev] exp(a_l) C_l S_inᵀ                          (state term, S_in: [P, N])
        + sum_{s <= l, seq_s == seq_l} CB_ls exp(a_l - a_s) dt_s x_s        (intra-chunk term)
        + D x_l
One program per (batch, chunk, head, block of positions l, block of P); the intra-chunk loop stops at
the diagonal. CB comes from chunk_cb (shared by the heads of a group), S_in from state_passing.
CB comes in already zeroed above the diagonal and across documents (cb_fwd), so the intra-chunk loop masks
nothing; the decay exponent is clamped at 0, so no inf is ever multiplied by a zero of CB.
"""

import triton
import triton.language as tl

from models.kernels.ssd_triton.chunk_cb import LOG2E


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
    HAS_SEQ: tl.constexpr,
    HAS_D: tl.constexpr,
    D_HAS_HDIM: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_bch = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_p = tl.program_id(2)
    h = pid_bch % H
    c = (pid_bch // H) % NC
    b = pid_bch // (H * NC)
    g = h // (H // G)
    t0 = c * Q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    valid_m = (offs_m < Q) & (t0 + offs_m < L)
    t_m = (t0 + offs_m).to(tl.int64)
    dA_base = dA_ptr + ((b.to(tl.int64) * H + h) * NC + c) * Q
    dt_base = dt_ptr + ((b.to(tl.int64) * H + h) * NC + c) * Q
    a_m = tl.load(dA_base + offs_m, mask=offs_m < Q, other=0.0)

    # State term: C_l · S_in (all N), scaled per position.
    keep_m = valid_m
    if HAS_SEQ:
        seq_m = tl.load(seq_ptr + b.to(tl.int64) * L + t_m, mask=valid_m, other=-1)
        prev = tl.load(seq_ptr + b.to(tl.int64) * L + tl.maximum(t0 - 1, 0))
        keep_m = keep_m & (seq_m == tl.where(c > 0, prev, 0))
    C_base = C_ptr + b.to(tl.int64) * s_c_b + g * s_c_g + t_m[:, None] * s_c_l
    S_base = S_in_ptr + ((b.to(tl.int64) * NC + c) * H + h) * P * N + offs_p[None, :] * N
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        c_tile = tl.load(C_base + offs_n[None, :] * s_c_n, mask=valid_m[:, None] & mask_n[None, :], other=0.0)
        sT_tile = tl.load(S_base + offs_n[:, None], mask=mask_n[:, None] & mask_p[None, :], other=0.0)
        acc += tl.dot(c_tile, sT_tile.to(c_tile.dtype), input_precision=PREC)
    acc = acc * tl.where(keep_m, tl.exp(a_m), 0.0)[:, None]

    # Intra-chunk term, s <= l. CB is 0 above the diagonal, across documents and past the end (cb_fwd), so the
    # weights need no mask, only the clamp that keeps the decay finite where CB is 0; offsets within the chunk are
    # int32, and with EVEN (whole tiles) the loads carry no masks (kernel docstring of chunk_scan_bwd).
    a2_m = a_m * LOG2E
    x_chunk = x_ptr + b.to(tl.int64) * s_x_b + h * s_x_h + t0.to(tl.int64) * s_x_l
    CB_rows = CB_ptr + ((b.to(tl.int64) * NC + c) * G + g) * Q * Q + offs_m[:, None] * Q
    hi = tl.minimum((pid_m + 1) * BLOCK_M, Q)
    for k0 in range(0, hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_ptrs = x_chunk + offs_k[:, None] * s_x_l + offs_p[None, :] * s_x_p
        if EVEN:
            a_k = tl.load(dA_base + offs_k)
            dt_k = tl.load(dt_base + offs_k)
            cb = tl.load(CB_rows + offs_k[None, :])
            x_tile = tl.load(x_ptrs)
        else:
            a_k = tl.load(dA_base + offs_k, mask=offs_k < Q, other=0.0)
            dt_k = tl.load(dt_base + offs_k, mask=offs_k < Q, other=0.0)
            cb = tl.load(CB_rows + offs_k[None, :], mask=(offs_m < Q)[:, None] & (offs_k < Q)[None, :], other=0.0)
            valid_k = (offs_k < Q) & (t0 + offs_k < L)
            x_tile = tl.load(x_ptrs, mask=valid_k[:, None] & mask_p[None, :], other=0.0)
        w = cb * tl.exp2(tl.minimum(a2_m[:, None] - a_k[None, :] * LOG2E, 0.0)) * dt_k[None, :]
        acc += tl.dot(w.to(x_tile.dtype), x_tile, input_precision=PREC)

    if HAS_D:
        x_m = tl.load(
            x_chunk + offs_m[:, None] * s_x_l + offs_p[None, :] * s_x_p,
            mask=valid_m[:, None] & mask_p[None, :],
            other=0.0,
        )
        if D_HAS_HDIM:
            d = tl.load(D_ptr + h * P + offs_p, mask=mask_p, other=0.0)
            acc += x_m.to(tl.float32) * d[None, :]
        else:
            acc += x_m.to(tl.float32) * tl.load(D_ptr + h)
    y_base = y_ptr + b.to(tl.int64) * s_y_b + h * s_y_h
    tl.store(
        y_base + t_m[:, None] * s_y_l + offs_p[None, :] * s_y_p,
        acc.to(y_ptr.dtype.element_ty),
        mask=valid_m[:, None] & mask_p[None, :],
    )
