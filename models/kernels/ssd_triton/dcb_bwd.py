"""Backward for C and B with the intra-chunk part summed over heads first (bc_mode "grouped").

The per-head kernels in bc_bwd.py multiply every head's dCB^h by B (for dC) and by C (for dB) inside the
kernel: two N-wide products per head and tile pair. Here one program per (batch, chunk, group, block of
heads, block of l) sums dCB^h over its heads tile by tile, so the intra-chunk parts become two per-group
products on the host, dC += dCB B and dB += dCBᵀ C (C·Bᵀ's own backward, once per group):
    dCB_ls = sum_h [s <= l, seq_s == seq_l] exp(a^h_l - a^h_s) dt^h_s (dy^h_l · x^h_s)      (float32)
The same pass gives, per head, the decay-gradient parts O (state term) and R (intra-chunk pairs spanning
t), exactly as chunk_scan_bwd_dc_kernel does, and the state term of dC summed over its heads; the state
term of dB comes from chunk_state_bwd_db_kernel with INTRA=False.
Loop order: blocks of s outside, heads inside, so each dCB tile is summed in registers and written once;
the running row sums R needs per head are kept as a [heads, BLOCK_M] array.
"""

import triton
import triton.language as tl


@triton.jit
def chunk_scan_bwd_dcb_kernel(
    dy_ptr,
    x_ptr,
    dt_ptr,
    dA_ptr,
    C_ptr,
    CB_ptr,
    S_in_ptr,
    seq_ptr,
    dCstate_ptr,
    dCB_ptr,
    O_ptr,
    R_ptr,
    L,
    Q,
    NC,
    H,
    G,
    P,
    N,
    HEADS_PER_PROG,
    BATCH,
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
    PREC: tl.constexpr,
    HEADS_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid0 = tl.program_id(0)
    pid_m = tl.program_id(1)
    n_hb = (H // G) // HEADS_PER_PROG
    hb = pid0 % n_hb
    g = (pid0 // n_hb) % G
    c = (pid0 // (n_hb * G)) % NC
    b = pid0 // (n_hb * G * NC)
    t0 = c * Q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    valid_m = (offs_m < Q) & (t0 + offs_m < L)
    t_m = (t0 + offs_m).to(tl.int64)
    keep_m = valid_m
    if HAS_SEQ:
        seq_m = tl.load(seq_ptr + b.to(tl.int64) * L + t_m, mask=valid_m, other=-1)
        prev = tl.load(seq_ptr + b.to(tl.int64) * L + tl.maximum(t0 - 1, 0))
        keep_m = keep_m & (seq_m == tl.where(c > 0, prev, 0))
    h0 = g * (H // G) + hb * HEADS_PER_PROG

    # State term of dC (summed over the heads) and O per head.
    C_m = tl.load(
        C_ptr + b.to(tl.int64) * s_c_b + g * s_c_g + t_m[:, None] * s_c_l + offs_n[None, :] * s_c_n,
        mask=valid_m[:, None] & mask_n[None, :],
        other=0.0,
    )
    dC_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(HEADS_PER_PROG):
        h = h0 + i
        head_q = ((b.to(tl.int64) * H + h) * NC + c) * Q
        a_m = tl.load(dA_ptr + head_q + offs_m, mask=offs_m < Q, other=0.0)
        dy_m = tl.load(
            dy_ptr + b.to(tl.int64) * s_y_b + h * s_y_h + t_m[:, None] * s_y_l + offs_p[None, :] * s_y_p,
            mask=valid_m[:, None] & mask_p[None, :],
            other=0.0,
        )
        S = tl.load(
            S_in_ptr + ((b.to(tl.int64) * NC + c) * H + h) * P * N + offs_p[:, None] * N + offs_n[None, :],
            mask=mask_p[:, None] & mask_n[None, :],
            other=0.0,
        )
        dC_h = tl.dot(dy_m, S.to(dy_m.dtype), input_precision=PREC) * tl.where(keep_m, tl.exp(a_m), 0.0)[:, None]
        tl.store(O_ptr + head_q + offs_m, tl.sum(dC_h * C_m.to(tl.float32), axis=1), mask=offs_m < Q)
        dC_acc += dC_h
    out = dCstate_ptr + ((hb.to(tl.int64) * BATCH + b) * L + t_m[:, None]) * G * N + g * N + offs_n[None, :]
    tl.store(out, dC_acc, mask=valid_m[:, None] & mask_n[None, :])

    # Intra-chunk: dCB summed over the heads, tile by tile; R per head.
    head_ids = tl.arange(0, HEADS_POW2)
    carry = tl.zeros((HEADS_POW2, BLOCK_M), dtype=tl.float32)  # per head and row l: sum of M_ls over s done
    CB_base = CB_ptr + ((b.to(tl.int64) * NC + c) * G + g) * Q * Q + offs_m[:, None] * Q
    dCB_base = dCB_ptr + (((hb.to(tl.int64) * BATCH + b) * NC + c) * G + g) * Q * Q + offs_m[:, None] * Q
    R_part = R_ptr + pid_m.to(tl.int64) * BATCH * H * NC * Q  # R partials: [num_m_blocks, B, H, NC, Q]
    hi = tl.minimum((pid_m + 1) * BLOCK_M, Q)
    for k0 in range(0, hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        valid_k = (offs_k < Q) & (t0 + offs_k < L)
        t_k = (t0 + offs_k).to(tl.int64)
        keep = (offs_k[None, :] <= offs_m[:, None]) & valid_m[:, None] & valid_k[None, :]
        if HAS_SEQ:
            seq_k = tl.load(seq_ptr + b.to(tl.int64) * L + t_k, mask=valid_k, other=-2)
            keep = keep & (seq_k[None, :] == seq_m[:, None])
        cb = tl.load(CB_base + offs_k[None, :], mask=(offs_m < Q)[:, None] & (offs_k < Q)[None, :], other=0.0)
        cb = tl.where(keep, cb, 0.0)  # masked after a rectangular load, which stays vectorised
        dcb_acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for i in range(HEADS_PER_PROG):
            h = h0 + i
            head_q = ((b.to(tl.int64) * H + h) * NC + c) * Q
            a_m = tl.load(dA_ptr + head_q + offs_m, mask=offs_m < Q, other=0.0)
            a_k = tl.load(dA_ptr + head_q + offs_k, mask=offs_k < Q, other=0.0)
            dt_k = tl.load(dt_ptr + head_q + offs_k, mask=offs_k < Q, other=0.0)
            dy_m = tl.load(
                dy_ptr + b.to(tl.int64) * s_y_b + h * s_y_h + t_m[:, None] * s_y_l + offs_p[None, :] * s_y_p,
                mask=valid_m[:, None] & mask_p[None, :],
                other=0.0,
            )
            xT = tl.load(
                x_ptr + b.to(tl.int64) * s_x_b + h * s_x_h + t_k[None, :] * s_x_l + offs_p[:, None] * s_x_p,
                mask=mask_p[:, None] & valid_k[None, :],
                other=0.0,
            )
            dyx = tl.dot(dy_m, xT, input_precision=PREC)
            decay = tl.exp(tl.where(keep, a_m[:, None] - a_k[None, :], float("-inf")))
            dcb = tl.where(keep, dyx * decay * dt_k[None, :], 0.0)
            dcb_acc += dcb
            M = dcb * cb
            is_h = (head_ids == i)[:, None]
            carry_h = tl.sum(tl.where(is_h, carry, 0.0), axis=0)
            before_t = carry_h[:, None] + tl.cumsum(M, axis=1) - M  # [l, t]: sum_{s < t} M_ls
            R_t = tl.sum(tl.where(offs_m[:, None] >= offs_k[None, :], before_t, 0.0), axis=0)
            tl.store(R_part + head_q + offs_k, R_t, mask=offs_k < Q)
            carry += tl.where(is_h, tl.sum(M, axis=1)[None, :], 0.0)
        tl.store(dCB_base + offs_k[None, :], dcb_acc, mask=(offs_m < Q)[:, None] & (offs_k < Q)[None, :])
