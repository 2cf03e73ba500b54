"""The forward's chunk states, recurrence between chunks and chunk scan in one kernel (config chained_scan).

chained_states.py computes each chunk's own state, chains the states entering the chunks and writes them, S_in
[B, NC, H, P, N] in x's dtype, for the chunk scan (chunk_scan.py) to read back, once per block of output rows.
Here one program per (chunk, batch, head), holding all of [P, N], does what both do for its chunk:

    own    = sum_s exp(a_last - a_s) dt_s x_sᵀ B_s                  (chunk_state.chunk_local_states)
    S_in   = the hand-off of chunk c - 1's program (or the initial state); then S_in decay_c + own handed on at once,
             so the next chunk's program waits no longer than in chained_states.py
    y_l    = [seq_l == seq_prev] exp(a_l) C_l S_inᵀ + sum_{s <= l} CB_ls exp(a_l - a_s) dt_s x_s + D x_l
             for every block of rows l of the chunk (chunk_scan.py's loop, one head)

so S_in never reaches memory in the forward (the backward recomputes it, chained_states.py with keep_s32). The
state term rounds S_in to x's dtype for its product, as the chunk scan's load of the stored S_in did: the outputs
are those of chained_states + chunk_scan up to the order of float32 sums. Ordering, tickets and hand-offs:
chained_states.py's docstring.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels.fast_launch import fast_launch, next_power_of_2
from models.kernels.ssd_triton.chained_states import chain_counters, entering_states, hand_on, take_ticket
from models.kernels.ssd_triton.chunk_cb import LOG2E
from models.kernels.ssd_triton.chunk_scan import scan_store, scan_tile
from models.kernels.ssd_triton.chunk_state import chunk_local_states
from models.kernels.ssd_triton.config import BlockConfig, whole_tiles
from models.kernels.ssd_triton.launch import dot_precision, dummy
from models.kernels.ssd_triton.state_passing import chunk_decay

__all__ = ["chained_scan"]


@fast_launch
@triton.jit
def chained_scan_fwd_kernel(
    x_ptr,
    B_ptr,
    C_ptr,
    CB_ptr,
    dt_ptr,
    dA_ptr,
    D_ptr,
    seq_ptr,
    init_ptr,
    sync_ptr,
    carry_ptr,
    y_ptr,
    final_ptr,
    L,
    Q,
    NC,
    H,
    G,
    P,
    N,
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
    HAS_INIT: tl.constexpr,
    HAS_D: tl.constexpr,
    D_HAS_HDIM: tl.constexpr,
    EVEN_STATE: tl.constexpr,
    EVEN_SCAN: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_KS: tl.constexpr,
):
    c, r, b, h, _, _ = take_ticket(sync_ptr, BATCH, NC, H, P, N, 1, BLOCK_P, BLOCK_N, False)
    g = h // (H // G)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    own, _ = chunk_local_states(
        x_ptr, B_ptr, dt_ptr, dA_ptr, seq_ptr, b, c, h, g, offs_p, offs_n, L, Q, NC, H, P, N, s_x_b, s_x_l, s_x_h,
        s_x_p, s_b_b, s_b_l, s_b_g, s_b_n, HAS_SEQ, EVEN_STATE, PREC, 1, BLOCK_P, BLOCK_N, BLOCK_K, False, False,
    )  # fmt: skip

    # The state entering chunk c (float32), and at once the state leaving it, handed on (or the final state).
    PN = P * N
    tile = offs_p[:, None] * N + offs_n[None, :]
    mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    counter = sync_ptr + 1 + r
    s_in, _ = entering_states(init_ptr, carry_ptr, counter, b, h, c, tile, mask, PN, H, 2, HAS_INIT, 1, BLOCK_P,
                              BLOCK_N)  # fmt: skip
    s_out = chunk_decay(dA_ptr, seq_ptr, b, h, c, L, Q, NC, H, HAS_SEQ) * s_in + own
    hand_on(carry_ptr, final_ptr, counter, b, h, c, tile, mask, s_out, s_out, PN, H, NC, 2, 1)

    # The chunk's outputs, block of rows by block of rows: S_inᵀ in the operand dtype, [N, P].
    s_inT = tl.trans(s_in.to(x_ptr.dtype.element_ty))
    t0 = c * Q
    head_q = ((b.to(tl.int64) * H + h) * NC + c) * Q
    x_chunk = x_ptr + b.to(tl.int64) * s_x_b + h * s_x_h + t0.to(tl.int64) * s_x_l
    C_chunk = C_ptr + b.to(tl.int64) * s_c_b + g * s_c_g
    CB_chunk = CB_ptr + ((b.to(tl.int64) * NC + c) * G + g) * Q * Q
    mask_p = offs_p < P
    if HAS_SEQ:
        prev = tl.load(seq_ptr + b.to(tl.int64) * L + tl.maximum(t0 - 1, 0))
        prev = tl.where(c > 0, prev, 0)
    for m0 in range(0, Q, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        valid_m = (offs_m < Q) & (t0 + offs_m < L)
        t_m = (t0 + offs_m).to(tl.int64)
        a2_m = tl.load(dA_ptr + head_q + offs_m, mask=offs_m < Q, other=0.0) * LOG2E
        keep_m = valid_m
        if HAS_SEQ:
            seq_m = tl.load(seq_ptr + b.to(tl.int64) * L + t_m, mask=valid_m, other=-1)
            keep_m = keep_m & (seq_m == prev)
        c_tile = tl.load(
            C_chunk + t_m[:, None] * s_c_l + offs_n[None, :] * s_c_n,
            mask=valid_m[:, None] & (offs_n < N)[None, :],
            other=0.0,
        )
        acc = tl.dot(c_tile, s_inT, input_precision=PREC) * tl.where(keep_m, tl.exp2(a2_m), 0.0)[:, None]
        CB_rows = CB_chunk + offs_m[:, None] * Q
        for k0 in range(0, tl.minimum(m0 + BLOCK_M, Q), BLOCK_KS):
            offs_k = k0 + tl.arange(0, BLOCK_KS)
            x_offs = offs_k[:, None] * s_x_l + offs_p[None, :] * s_x_p
            if EVEN_SCAN:
                cb = tl.load(CB_rows + offs_k[None, :])
            else:
                cb = tl.load(CB_rows + offs_k[None, :], mask=(offs_m < Q)[:, None] & (offs_k < Q)[None, :], other=0.0)
            acc = scan_tile(acc, cb, dA_ptr + head_q, dt_ptr + head_q, x_chunk + x_offs, a2_m, offs_k, t0, L, Q,
                            mask_p, EVEN_SCAN, PREC, False)  # fmt: skip
        scan_store(acc, x_ptr, D_ptr, y_ptr, b, h, t0, offs_m, offs_p, mask_p, valid_m, t_m, P, s_x_b, s_x_h, s_x_l,
                   s_x_p, s_y_b, s_y_h, s_y_l, s_y_p, HAS_D=HAS_D, D_HAS_HDIM=D_HAS_HDIM)  # fmt: skip


def chained_scan(x, dt_p, dA_cs, B, C, D, seq, init, CB, cfg: BlockConfig, y_dtype=None):
    """ssd_forward's chained path in one kernel: y [b, L, H, P] (y_dtype, default x's) and final states [b, H, P, N]
    (float32). One head per program, all of P and N (padded to powers of two)."""
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    NC, Q = dt_p.shape[2:]
    dev = x.device
    block_p, block_n = max(16, next_power_of_2(P)), max(16, next_power_of_2(N))
    n_chains = b * H
    y = torch.empty_like(x, dtype=y_dtype, memory_format=torch.contiguous_format)
    final = torch.empty(b, H, P, N, device=dev, dtype=torch.float32)
    carry = torch.empty(b, 2, H, P, N, device=dev, dtype=torch.float32)
    chained_scan_fwd_kernel[(NC * n_chains,)](
        x,
        B,
        C,
        CB,
        dt_p,
        dA_cs,
        D if D is not None else dummy(dev),
        seq if seq is not None else dummy(dev),
        init if init is not None else dummy(dev),
        chain_counters(n_chains, dev),
        carry,
        y,
        final,
        L,
        Q,
        NC,
        H,
        G,
        P,
        N,
        b,
        *x.stride(),
        *B.stride(),
        *C.stride(),
        *y.stride(),
        HAS_SEQ=seq is not None,
        HAS_INIT=init is not None,
        HAS_D=D is not None,
        D_HAS_HDIM=D is not None and D.dim() == 2,
        EVEN_STATE=whole_tiles(L, Q, P, block_p, cfg.state_k) and N == block_n,
        EVEN_SCAN=whole_tiles(L, Q, P, block_p, cfg.scan_m, cfg.scan_k),
        PREC=dot_precision(x),
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        BLOCK_K=cfg.state_k,
        BLOCK_M=cfg.scan_m,
        BLOCK_KS=cfg.scan_k,
        num_warps=cfg.chained_scan_warps,
        num_stages=cfg.chained_stages,
    )
    return y, final
