"""Backward for C and B, summed over the heads of a group, and two parts of the decay gradient.

With dCB^h_ls = [s <= l, seq_s == seq_l] exp(a_l - a_s) dt_s (dy_l · x_s) for head h:
    dC_l = sum_h [ sum_s dCB^h_ls B_s  +  [seq_l == seq_prev] exp(a_l) dy_l S_in^h ]
    dB_s = sum_h [ sum_l dCB^h_ls C_l  +  [seq_s == seq_last] exp(a_last - a_s) dt_s x_s dH^h ]
The gradient with respect to dA_t = dt_t A_t (the increments of the cumulative decay a) is assembled on
the host from sums that have no cancellation (see autograd.py). The dC kernel gives, per head,
    O_l = C_l · (the state term of dC^h_l)              (y_l's state term carries exp(a_l))
    R_t = sum_{l >= t > s} M_ls,  M_ls = CB_ls dCB^h_ls   (intra-chunk pairs whose decay spans t)
R is computed straight from fp32 M with a running prefix sum over s, never as the difference of two
large sums (row sums minus column sums), which loses digits to the diagonal terms.
One program per (batch, chunk, group, block of heads, block of positions) loops over its heads and
writes one partial sum per head block (float32 [num_head_blocks, B, L, G, N]); the host adds them.
All of P and N are held per program.
"""

import triton
import triton.language as tl

from models.kernels.fast_launch import fast_launch
from models.kernels.ssd_triton.chunk_cb import LOG2E
from models.kernels.ssd_triton.launch import program_ids


@fast_launch
@triton.jit
def chunk_scan_bwd_dc_kernel(
    dy_ptr,
    x_ptr,
    dt_ptr,
    dA_ptr,
    B_ptr,
    C_ptr,
    CB_ptr,
    S_in_ptr,
    seq_ptr,
    dC_ptr,
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
    s_b_b,
    s_b_l,
    s_b_g,
    s_b_n,
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
    C_m = tl.load(
        C_ptr + b.to(tl.int64) * s_c_b + g * s_c_g + t_m[:, None] * s_c_l + offs_n[None, :] * s_c_n,
        mask=valid_m[:, None] & mask_n[None, :],
        other=0.0,
    )
    keep_m = valid_m
    if HAS_SEQ:
        seq_m = tl.load(seq_ptr + b.to(tl.int64) * L + t_m, mask=valid_m, other=-1)
        prev = tl.load(seq_ptr + b.to(tl.int64) * L + tl.maximum(t0 - 1, 0))
        keep_m = keep_m & (seq_m == tl.where(c > 0, prev, 0))
    hi = tl.minimum((pid_m + 1) * BLOCK_M, Q)
    CB_base = CB_ptr + ((b.to(tl.int64) * NC + c) * G + g) * Q * Q + offs_m[:, None] * Q
    dC_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(HEADS_PER_PROG):
        h = g * (H // G) + hb * HEADS_PER_PROG + i
        dA_base = dA_ptr + ((b.to(tl.int64) * H + h) * NC + c) * Q
        dt_base = dt_ptr + ((b.to(tl.int64) * H + h) * NC + c) * Q
        a_m = tl.load(dA_base + offs_m, mask=offs_m < Q, other=0.0)
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
        head_q = ((b.to(tl.int64) * H + h) * NC + c) * Q
        tl.store(O_ptr + head_q + offs_m, tl.sum(dC_h * C_m.to(tl.float32), axis=1), mask=offs_m < Q)
        R_base = R_ptr + pid_m.to(tl.int64) * BATCH * H * NC * Q + head_q  # R partials: [num_m_blocks, B, H, NC, Q]
        carry = tl.zeros((BLOCK_M,), dtype=tl.float32)  # per row l: sum of M_ls over the s blocks done
        x_base = x_ptr + b.to(tl.int64) * s_x_b + h * s_x_h
        for k0 in range(0, hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            valid_k = (offs_k < Q) & (t0 + offs_k < L)
            t_k = (t0 + offs_k).to(tl.int64)
            a_k = tl.load(dA_base + offs_k, mask=offs_k < Q, other=0.0)
            dt_k = tl.load(dt_base + offs_k, mask=offs_k < Q, other=0.0)
            keep = (offs_k[None, :] <= offs_m[:, None]) & valid_m[:, None] & valid_k[None, :]
            if HAS_SEQ:
                seq_k = tl.load(seq_ptr + b.to(tl.int64) * L + t_k, mask=valid_k, other=-2)
                keep = keep & (seq_k[None, :] == seq_m[:, None])
            xT = tl.load(
                x_base + t_k[None, :] * s_x_l + offs_p[:, None] * s_x_p,
                mask=mask_p[:, None] & valid_k[None, :],
                other=0.0,
            )
            dyx = tl.dot(dy_m, xT, input_precision=PREC)
            decay = tl.exp(tl.where(keep, a_m[:, None] - a_k[None, :], float("-inf")))
            dcb = tl.where(keep, dyx * decay * dt_k[None, :], 0.0)
            M = dcb * tl.load(CB_base + offs_k[None, :], mask=keep, other=0.0)
            before_t = carry[:, None] + tl.cumsum(M, axis=1) - M  # [l, t]: sum_{s < t} M_ls
            R_t = tl.sum(tl.where(offs_m[:, None] >= offs_k[None, :], before_t, 0.0), axis=0)
            tl.store(R_base + offs_k, R_t, mask=offs_k < Q)
            carry += tl.sum(M, axis=1)
            b_k = tl.load(
                B_ptr + b.to(tl.int64) * s_b_b + g * s_b_g + t_k[:, None] * s_b_l + offs_n[None, :] * s_b_n,
                mask=valid_k[:, None] & mask_n[None, :],
                other=0.0,
            )
            dC_h += tl.dot(dcb.to(b_k.dtype), b_k, input_precision=PREC)
        dC_acc += dC_h
    out = dC_ptr + ((hb.to(tl.int64) * BATCH + b) * L + t_m[:, None]) * G * N + g * N + offs_n[None, :]
    tl.store(out, dC_acc, mask=valid_m[:, None] & mask_n[None, :])


@fast_launch
@triton.jit
def chunk_state_bwd_db_kernel(
    dy_ptr,
    x_ptr,
    dt_ptr,
    dA_ptr,
    C_ptr,
    dH_ptr,
    seq_ptr,
    dB_ptr,
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
    INTRA: tl.constexpr,  # False: only the chunk-state term (bc_mode "grouped" adds dCBᵀ C on the host)
    PREC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INNER_FIRST: tl.constexpr,
    FOLD_DT: tl.constexpr,  # dt_ptr holds a2dt (dt.py; config fold_dt_states): the scale is one 2^(a_last - a2dt_s)
):
    tl.static_assert(not (FOLD_DT and INTRA), "the intra-chunk term multiplies by dt itself")
    pid0, pid_k, _ = program_ids(tl.cdiv(Q, BLOCK_K), 1, INNER_FIRST)
    n_hb = (H // G) // HEADS_PER_PROG
    hb = pid0 % n_hb
    g = (pid0 // n_hb) % G
    c = (pid0 // (n_hb * G)) % NC
    b = pid0 // (n_hb * G * NC)
    t0 = c * Q
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    valid_k = (offs_k < Q) & (t0 + offs_k < L)
    t_k = (t0 + offs_k).to(tl.int64)
    keep_k = valid_k
    if HAS_SEQ:
        seq_k = tl.load(seq_ptr + b.to(tl.int64) * L + t_k, mask=valid_k, other=-1)
        seq_last = tl.load(seq_ptr + b.to(tl.int64) * L + tl.minimum(t0 + Q, L) - 1)
        keep_k = keep_k & (seq_k == seq_last)
    m_start = (pid_k * BLOCK_K // BLOCK_M) * BLOCK_M
    dB_acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for i in range(HEADS_PER_PROG):
        h = g * (H // G) + hb * HEADS_PER_PROG + i
        dA_base = dA_ptr + ((b.to(tl.int64) * H + h) * NC + c) * Q
        dt_base = dt_ptr + ((b.to(tl.int64) * H + h) * NC + c) * Q
        a_last = tl.load(dA_base + Q - 1)
        if FOLD_DT:
            a2dt_k = tl.load(dt_base + offs_k, mask=offs_k < Q, other=float("inf"))
            weight_k = tl.exp2(a_last * LOG2E - a2dt_k)
        else:
            a_k = tl.load(dA_base + offs_k, mask=offs_k < Q, other=0.0)
            dt_k = tl.load(dt_base + offs_k, mask=offs_k < Q, other=0.0)
            weight_k = tl.exp(a_last - a_k) * dt_k
        x_k = tl.load(
            x_ptr + b.to(tl.int64) * s_x_b + h * s_x_h + t_k[:, None] * s_x_l + offs_p[None, :] * s_x_p,
            mask=valid_k[:, None] & mask_p[None, :],
            other=0.0,
        )
        dH = tl.load(
            dH_ptr + ((b.to(tl.int64) * NC + c) * H + h) * P * N + offs_p[:, None] * N + offs_n[None, :],
            mask=mask_p[:, None] & mask_n[None, :],
            other=0.0,
        )
        scale_k = tl.where(keep_k, weight_k, 0.0)
        dB_h = tl.dot(x_k, dH.to(x_k.dtype), input_precision=PREC) * scale_k[:, None]
        dy_base = dy_ptr + b.to(tl.int64) * s_y_b + h * s_y_h
        if INTRA:
            for m0 in range(m_start, Q, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                valid_m = (offs_m < Q) & (t0 + offs_m < L)
                t_m = (t0 + offs_m).to(tl.int64)
                a_m = tl.load(dA_base + offs_m, mask=offs_m < Q, other=0.0)
                keep = (offs_k[:, None] <= offs_m[None, :]) & valid_k[:, None] & valid_m[None, :]
                if HAS_SEQ:
                    seq_m = tl.load(seq_ptr + b.to(tl.int64) * L + t_m, mask=valid_m, other=-2)
                    keep = keep & (seq_k[:, None] == seq_m[None, :])
                dyT = tl.load(
                    dy_base + t_m[None, :] * s_y_l + offs_p[:, None] * s_y_p,
                    mask=mask_p[:, None] & valid_m[None, :],
                    other=0.0,
                )
                xdy = tl.dot(x_k, dyT, input_precision=PREC)
                decay = tl.exp(tl.where(keep, a_m[None, :] - a_k[:, None], float("-inf")))
                dcbT = tl.where(keep, xdy * decay * dt_k[:, None], 0.0)
                C_m = tl.load(
                    C_ptr + b.to(tl.int64) * s_c_b + g * s_c_g + t_m[:, None] * s_c_l + offs_n[None, :] * s_c_n,
                    mask=valid_m[:, None] & mask_n[None, :],
                    other=0.0,
                )
                dB_h += tl.dot(dcbT.to(C_m.dtype), C_m, input_precision=PREC)
        dB_acc += dB_h
    out = dB_ptr + ((hb.to(tl.int64) * BATCH + b) * L + t_k[:, None]) * G * N + g * N + offs_n[None, :]
    tl.store(out, dB_acc, mask=valid_k[:, None] & mask_n[None, :])
