"""The state recurrence fused with its per-chunk work: one program per (batch, head, block of P) walks the
chunks in order (forward) or in reverse (backward) and carries the [P, N] state in float32 registers, so the
per-chunk states never round-trip through memory and no separate state-passing kernel runs.

fused_scan_fwd_kernel: for c = 0 .. NC-1, with S the state entering chunk c,
    S_in[c] = S                                                                  (STORE_S_IN; x's dtype)
    y_l = [seq_l == seq_prev] exp(a_l) C_l Sᵀ + sum_{s <= l} CB_ls exp(a_l - a_s) dt_s x_s + D x_l   (WITH_Y)
    S   = decay_c S + sum_s [seq_s == seq_last] exp(a_last - a_s) dt_s x_s B_sᵀ
  and final = S. It replaces chunk_state -> state_passing -> chunk_scan in the forward (WITH_Y), and
  chunk_state -> state_passing in the backward's recompute of S_in (STORE_S_IN only). CB must already be zero
  across documents (cb_fwd_kernel with HAS_SEQ), so the intra-chunk loop needs only the causal mask.
fused_state_bwd_kernel: for c = NC-1 .. 0, with dS the gradient of chunk c's end state (dfinal after the last),
    dH[c]  = dS,   dtot_c = decay_c <dS, S_in[c]>          (partial sums per block of P)
    dS     = decay_c dS + sum_l [seq_l == seq_prev] exp(a_l) dy_l C_lᵀ
  and dinit = dS. It replaces chunk_scan_bwd_dstates -> state_passing_bwd.
decay_c = exp(a_last_c) [seq_last_c == seq_prev_c] as in state_passing.py; seq_prev of chunk 0 is document 0
(the initial state's). a_* is the within-chunk cumulative sum of dt * A (float32, [B, H, NC, Q], dt = 0 on the
padding after the last token, so padding neither decays nor adds).
"""

import torch
import triton
import triton.language as tl

from models.kernels.fast_launch import cdiv, fast_launch, next_power_of_2
from models.kernels.ssd_triton.config import BlockConfig
from models.kernels.ssd_triton.launch import dot_precision, dummy


@triton.jit
def _chunk_docs(seq_ptr, b, c, L, Q):
    """Document of the state entering chunk c (0 for the first chunk) and of chunk c's last token."""
    t0 = c * Q
    prev = tl.load(seq_ptr + b.to(tl.int64) * L + tl.maximum(t0 - 1, 0))
    prev = tl.where(c > 0, prev, 0)
    last = tl.load(seq_ptr + b.to(tl.int64) * L + tl.minimum(t0 + Q, L) - 1)
    return prev, last


@triton.jit
def _stateT_at(P, N, pid_p, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets and mask of a [P, N] state in memory seen transposed as [BLOCK_N, BLOCK_P] (column block pid_p),
    formed where they are used. (Block pointers served here until Triton 3.9 removed them.)"""
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    return offs_p[None, :] * N + offs_n[:, None], (offs_n < N)[:, None] & (offs_p < P)[None, :]


@triton.jit
def _load_stateT(base, P, N, pid_p, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    at, mask = _stateT_at(P, N, pid_p, BLOCK_P, BLOCK_N)
    return tl.load(base + at, mask=mask, other=0.0)


@triton.jit
def _store_stateT(base, stateT, P, N, pid_p, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    at, mask = _stateT_at(P, N, pid_p, BLOCK_P, BLOCK_N)
    tl.store(base + at, stateT.to(base.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit
def fused_scan_fwd_kernel(
    CB_ptr,
    x_ptr,
    dt_ptr,
    dA_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    seq_ptr,
    init_ptr,
    y_ptr,
    S_in_ptr,
    final_ptr,
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
    HAS_INIT: tl.constexpr,
    HAS_D: tl.constexpr,
    D_HAS_HDIM: tl.constexpr,
    WITH_Y: tl.constexpr,
    STORE_S_IN: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_KS: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_p = tl.program_id(1)
    h = pid_bh % H
    b = pid_bh // H
    g = h // (H // G)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    # The state is carried transposed, [BLOCK_N, BLOCK_P], so both of its products take it as the right-hand
    # operand as it is (no register transpose); in memory states are [P, N].
    bh = b.to(tl.int64) * H + h
    if HAS_INIT:
        stateT = _load_stateT(init_ptr + bh * P * N, P, N, pid_p, BLOCK_P, BLOCK_N)
    else:
        stateT = tl.zeros((BLOCK_N, BLOCK_P), dtype=tl.float32)
    x_base = x_ptr + b.to(tl.int64) * s_x_b + h * s_x_h
    B_base = B_ptr + b.to(tl.int64) * s_b_b + g * s_b_g
    C_base = C_ptr + b.to(tl.int64) * s_c_b + g * s_c_g
    y_base = y_ptr + b.to(tl.int64) * s_y_b + h * s_y_h
    if HAS_D:
        if D_HAS_HDIM:
            d_p = tl.load(D_ptr + h * P + offs_p, mask=mask_p, other=0.0)
        else:
            d_p = tl.load(D_ptr + h + offs_p * 0)
    for c in range(NC):
        t0 = c * Q
        dA_base = dA_ptr + (bh * NC + c) * Q
        dt_base = dt_ptr + (bh * NC + c) * Q
        if HAS_SEQ:
            seq_prev, seq_last = _chunk_docs(seq_ptr, b, c, L, Q)
        if STORE_S_IN:
            S_in_base = S_in_ptr + ((b.to(tl.int64) * NC + c) * H + h) * P * N
            _store_stateT(S_in_base, stateT, P, N, pid_p, BLOCK_P, BLOCK_N)
        if WITH_Y:
            sT = stateT.to(x_ptr.dtype.element_ty)
            CB_base = CB_ptr + ((b.to(tl.int64) * NC + c) * G + g) * Q * Q
            for m0 in range(0, Q, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                valid_m = (offs_m < Q) & (t0 + offs_m < L)
                t_m = (t0 + offs_m).to(tl.int64)
                a_m = tl.load(dA_base + offs_m, mask=offs_m < Q, other=0.0)
                c_tile = tl.load(
                    C_base + t_m[:, None] * s_c_l + offs_n[None, :] * s_c_n,
                    mask=valid_m[:, None] & mask_n[None, :],
                    other=0.0,
                )
                acc = tl.dot(c_tile, sT, input_precision=PREC)
                keep_m = valid_m
                if HAS_SEQ:
                    seq_m = tl.load(seq_ptr + b.to(tl.int64) * L + t_m, mask=valid_m, other=-1)
                    keep_m = keep_m & (seq_m == seq_prev)
                acc = acc * tl.where(keep_m, tl.exp(a_m), 0.0)[:, None]
                # Intra-chunk term up to the diagonal block (CB is zero across documents and past the end).
                for k0 in range(0, tl.minimum(m0 + BLOCK_M, Q), BLOCK_K):
                    offs_k = k0 + tl.arange(0, BLOCK_K)
                    a_k = tl.load(dA_base + offs_k, mask=offs_k < Q, other=0.0)
                    dt_k = tl.load(dt_base + offs_k, mask=offs_k < Q, other=0.0)
                    causal = (offs_k[None, :] <= offs_m[:, None]) & (offs_k < Q)[None, :]
                    cb = tl.load(
                        CB_base + offs_m[:, None] * Q + offs_k[None, :],
                        mask=causal & (offs_m < Q)[:, None],
                        other=0.0,
                    )
                    decay = tl.exp(tl.where(causal, a_m[:, None] - a_k[None, :], float("-inf")))
                    w = cb * decay * dt_k[None, :]
                    x_tile = tl.load(
                        x_base + (t0 + offs_k).to(tl.int64)[:, None] * s_x_l + offs_p[None, :] * s_x_p,
                        mask=((offs_k < Q) & (t0 + offs_k < L))[:, None] & mask_p[None, :],
                        other=0.0,
                    )
                    acc += tl.dot(w.to(x_tile.dtype), x_tile, input_precision=PREC)
                if HAS_D:
                    x_m = tl.load(
                        x_base + t_m[:, None] * s_x_l + offs_p[None, :] * s_x_p,
                        mask=valid_m[:, None] & mask_p[None, :],
                        other=0.0,
                    )
                    acc += x_m.to(tl.float32) * d_p[None, :]
                tl.store(
                    y_base + t_m[:, None] * s_y_l + offs_p[None, :] * s_y_p,
                    acc.to(y_ptr.dtype.element_ty),
                    mask=valid_m[:, None] & mask_p[None, :],
                )
        # The recurrence, then the chunk's own state accumulated onto it.
        a_last = tl.load(dA_base + Q - 1)
        decay_c = tl.exp(a_last)
        if HAS_SEQ:
            decay_c = tl.where(seq_last == seq_prev, decay_c, 0.0)
        stateT = stateT * decay_c
        for k0 in range(0, Q, BLOCK_KS):
            offs_k = k0 + tl.arange(0, BLOCK_KS)
            valid_k = (offs_k < Q) & (t0 + offs_k < L)
            t_k = (t0 + offs_k).to(tl.int64)
            a_k = tl.load(dA_base + offs_k, mask=offs_k < Q, other=0.0)
            dt_k = tl.load(dt_base + offs_k, mask=offs_k < Q, other=0.0)
            keep_k = valid_k
            if HAS_SEQ:
                seq_k = tl.load(seq_ptr + b.to(tl.int64) * L + t_k, mask=valid_k, other=-1)
                keep_k = keep_k & (seq_k == seq_last)
            scale_k = tl.where(keep_k, tl.exp(a_last - a_k) * dt_k, 0.0)
            x_tile = tl.load(
                x_base + t_k[:, None] * s_x_l + offs_p[None, :] * s_x_p,
                mask=valid_k[:, None] & mask_p[None, :],
                other=0.0,
            )
            bT = tl.load(
                B_base + t_k[None, :] * s_b_l + offs_n[:, None] * s_b_n,
                mask=mask_n[:, None] & valid_k[None, :],
                other=0.0,
            )
            # The scale goes on B before the rounding, not on x: see chunk_state_fwd_kernel.
            stateT = tl.dot((bT * scale_k[None, :]).to(x_tile.dtype), x_tile, acc=stateT, input_precision=PREC)
    _store_stateT(final_ptr + bh * P * N, stateT, P, N, pid_p, BLOCK_P, BLOCK_N)


@fast_launch
@triton.jit
def fused_state_bwd_kernel(
    dy_ptr,
    C_ptr,
    dA_ptr,
    seq_ptr,
    S_in_ptr,
    dfinal_ptr,
    dH_ptr,
    dinit_ptr,
    dtot_ptr,
    L,
    Q,
    NC,
    H,
    G,
    P,
    N,
    BATCH,
    s_y_b,
    s_y_l,
    s_y_h,
    s_y_p,
    s_c_b,
    s_c_l,
    s_c_g,
    s_c_n,
    HAS_SEQ: tl.constexpr,
    HAS_DFINAL: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_p = tl.program_id(1)
    h = pid_bh % H
    b = pid_bh // H
    g = h // (H // G)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    bh = b.to(tl.int64) * H + h  # dstate is carried transposed, [BLOCK_N, BLOCK_P], as above
    if HAS_DFINAL:
        dstate = _load_stateT(dfinal_ptr + bh * P * N, P, N, pid_p, BLOCK_P, BLOCK_N)
    else:
        dstate = tl.zeros((BLOCK_N, BLOCK_P), dtype=tl.float32)
    dy_base = dy_ptr + b.to(tl.int64) * s_y_b + h * s_y_h
    C_base = C_ptr + b.to(tl.int64) * s_c_b + g * s_c_g
    dtot_base = dtot_ptr + ((pid_p.to(tl.int64) * BATCH + b) * H + h) * NC  # [P blocks, BATCH, H, NC]
    for i in range(NC):
        c = NC - 1 - i
        t0 = c * Q
        dA_base = dA_ptr + (bh * NC + c) * Q
        base = ((b.to(tl.int64) * NC + c) * H + h) * P * N
        _store_stateT(dH_ptr + base, dstate, P, N, pid_p, BLOCK_P, BLOCK_N)
        s_in = _load_stateT(S_in_ptr + base, P, N, pid_p, BLOCK_P, BLOCK_N)
        s_in = s_in.to(tl.float32)
        decay_c = tl.exp(tl.load(dA_base + Q - 1))
        if HAS_SEQ:
            seq_prev, seq_last = _chunk_docs(seq_ptr, b, c, L, Q)
            decay_c = tl.where(seq_last == seq_prev, decay_c, 0.0)
        tl.store(dtot_base + c, decay_c * tl.sum(tl.sum(dstate * s_in, axis=1), axis=0))
        # Gradient reaching S_in[c] through y's state term, accumulated onto the decayed one.
        dstate = dstate * decay_c
        for k0 in range(0, Q, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            valid_k = (offs_k < Q) & (t0 + offs_k < L)
            t_k = (t0 + offs_k).to(tl.int64)
            a_k = tl.load(dA_base + offs_k, mask=offs_k < Q, other=0.0)
            keep_k = valid_k
            if HAS_SEQ:
                seq_k = tl.load(seq_ptr + b.to(tl.int64) * L + t_k, mask=valid_k, other=-1)
                keep_k = keep_k & (seq_k == seq_prev)
            scale_k = tl.where(keep_k, tl.exp(a_k), 0.0)
            dy_tile = tl.load(
                dy_base + t_k[:, None] * s_y_l + offs_p[None, :] * s_y_p,
                mask=valid_k[:, None] & mask_p[None, :],
                other=0.0,
            )
            cT = tl.load(
                C_base + t_k[None, :] * s_c_l + offs_n[:, None] * s_c_n,
                mask=mask_n[:, None] & valid_k[None, :],
                other=0.0,
            )
            dstate = tl.dot(cT, (dy_tile * scale_k[:, None]).to(cT.dtype), acc=dstate, input_precision=PREC)
    _store_stateT(dinit_ptr + bh * P * N, dstate, P, N, pid_p, BLOCK_P, BLOCK_N)


def fused_dstates(dy, dfinal, dA_cs, C, seq, S_in, cfg: BlockConfig):
    """dS_in and the reverse recurrence in one kernel (fused_scan.fused_state_bwd_kernel)."""
    b, L, H, P = dy.shape
    G, N = C.shape[2:]
    NC, Q = dA_cs.shape[2:]
    dev = dy.device
    n_p = cdiv(P, cfg.fusedb_p)
    dH = torch.empty(b, NC, H, P, N, device=dev, dtype=dy.dtype)  # rounded as its consumers round it (above)
    dinit = torch.empty(b, H, P, N, device=dev, dtype=torch.float32)
    dtot = torch.empty(n_p, b, H, NC, device=dev, dtype=torch.float32)
    fused_state_bwd_kernel[(b * H, n_p)](
        dy,
        C,
        dA_cs,
        seq if seq is not None else dummy(dev),
        S_in,
        dfinal if dfinal is not None else dummy(dev),
        dH,
        dinit,
        dtot,
        L,
        Q,
        NC,
        H,
        G,
        P,
        N,
        b,
        *dy.stride(),
        *C.stride(),
        HAS_SEQ=seq is not None,
        HAS_DFINAL=dfinal is not None,
        PREC=dot_precision(dy),
        BLOCK_P=cfg.fusedb_p,
        BLOCK_N=max(16, next_power_of_2(N)),
        BLOCK_K=cfg.fusedb_k,
        num_warps=cfg.fusedb_warps,
        num_stages=cfg.fusedb_stages,
    )
    return dH, dinit, dtot
