"""Backward of the chunk scan for x (with dt, D and the decay of the chunk states folded in).

For position s of chunk c, head h (dy: the gradient of y; dH: the gradient of the state after chunk c):
    acc_s = sum_{l >= s, seq_l == seq_s} CB_ls exp(a_l - a_s) dy_l             (intra-chunk term)
          + [seq_s == seq_last] exp(a_last - a_s) dH B_s                        (chunk-state term)
    dx_s  = dt_s acc_s + D dy_s
    ddt_s = acc_s · x_s          (both terms are linear in dt_s)
    dD   += dy_s · x_s           (partial sums per program, reduced on the host)
and q_s = dt_s (chunk-state part of acc_s) · x_s, whose exclusive prefix sum over s is the chunk-state
term of the decay gradient (autograd.py).
One program per (batch, chunk, block of s) and HEADS consecutive heads of one group (1 or 2), holding all of P so
ddt_s is complete. With 2 heads (config dx_heads, the default) the group's tiles (CBᵀ, B) are loaded once for both:
CBᵀ in float32 is the largest stream this kernel reads (every head re-reads it), so pairs halve it. With the state
term first, 32-wide inner blocks and 2-D row sums a pair fits in 168 registers without spills (three programs per
SM, config dx_maxnreg) and beats one head at 128 (four per SM), which had been the faster until session 57
(docs/ssd_sessions.md, sessions 22 and 57). The intra-chunk loop reads
CBᵀ (cb_fwd writes it for the backward, zero above the diagonal and across documents) and carries no per-element
mask: at 64 x 64 tiles, mask and address arithmetic were more of the loop's instructions than the product
(711 SASS instructions per iteration with them, 290 without; docs/performance.md).
Not fused with dCB (dcb_bwd.py), although both compute each head's decay tile and read its dy: dCB sums over the
heads and dx over the rows, and the one shared layout (a column strip per program, heads outer, dCB's strip of
tiles held across the heads) took 255 registers with spills, one program per SM, and 1.48x the two kernels' time
(docs/ssd_sessions.md, session 35).
"""

import triton
import triton.language as tl

from models.kernels.fast_launch import fast_launch
from models.kernels.pdl import pdl_prologue
from models.kernels.ssd_triton.chunk_cb import LOG2E
from models.kernels.ssd_triton.launch import program_ids


@fast_launch
@triton.jit
def chunk_scan_bwd_dx_kernel(
    CBT_ptr,
    x_ptr,
    dt_ptr,
    dA_ptr,
    B_ptr,
    dy_ptr,
    dH_ptr,
    D_ptr,
    seq_ptr,
    dx_ptr,
    ddt_ptr,
    q_ptr,
    dD_ptr,
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
    s_y_b,
    s_y_l,
    s_y_h,
    s_y_p,
    s_dx_b,
    s_dx_l,
    s_dx_h,
    s_dx_p,
    HAS_SEQ: tl.constexpr,
    HAS_D: tl.constexpr,
    D_HAS_HDIM: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INNER_FIRST: tl.constexpr,
    DX_STATE_FIRST: tl.constexpr,
    SUMS_2D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    n_k = tl.cdiv(Q, BLOCK_K)
    pid_bch, pid_k, _ = program_ids(n_k, 1, INNER_FIRST)
    h0 = (pid_bch % (H // HEADS)) * HEADS
    c = (pid_bch // (H // HEADS)) % NC
    b = pid_bch // ((H // HEADS) * NC)
    g = h0 // (H // G)  # HEADS divides H // G (the launcher checks): both heads are in group g
    t0 = c * Q
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    valid_k = (offs_k < Q) & (t0 + offs_k < L)
    t_k = (t0 + offs_k).to(tl.int64)
    keep_k = valid_k
    if HAS_SEQ:
        seq_k = tl.load(seq_ptr + b.to(tl.int64) * L + t_k, mask=valid_k, other=-1)
        seq_last = tl.load(seq_ptr + b.to(tl.int64) * L + tl.minimum(t0 + Q, L) - 1)
        keep_k = keep_k & (seq_k == seq_last)
    head_q0 = ((b.to(tl.int64) * H + h0) * NC + c) * Q
    head_q1 = head_q0 + NC * Q  # head h0 + 1 (used only with HEADS 2)
    # exp(u) = exp2(u log2 e): one MUFU.EX2 per element, without exp's range fix-ups
    a2_k0 = tl.load(dA_ptr + head_q0 + offs_k, mask=offs_k < Q, other=0.0) * LOG2E
    dy_chunk0 = dy_ptr + b.to(tl.int64) * s_y_b + h0 * s_y_h + t0.to(tl.int64) * s_y_l
    if HEADS == 2:
        a2_k1 = tl.load(dA_ptr + head_q1 + offs_k, mask=offs_k < Q, other=0.0) * LOG2E
        dy_chunk1 = dy_chunk0 + s_y_h

    # Both terms go into one float32 accumulator per head, [BLOCK_K, P]. DX_STATE_FIRST (config dx_state_first, the
    # default): the chunk-state term first (its q stored right away), then the intra-chunk loop adds to the same
    # accumulator, so one accumulator per head is live at any time (one head, 32-wide inner blocks: 128 registers,
    # four programs per SM, session 22); else the intra-chunk loop first and the chunk-state term in accumulators of
    # its own after it (with two heads, four [64, 64] float32 tiles live: 255 registers and spills at 4 warps). The
    # loop's offsets are int32 within the chunk (bases hold the int64 parts), and with EVEN (whole tiles everywhere)
    # its loads carry no masks: per element, address and mask arithmetic otherwise outnumbers the product.
    dt_k0 = tl.load(dt_ptr + head_q0 + offs_k, mask=offs_k < Q, other=0.0)
    x_base0 = x_ptr + b.to(tl.int64) * s_x_b + h0 * s_x_h + t_k[:, None] * s_x_l + offs_p[None, :] * s_x_p
    mask_kp = valid_k[:, None] & mask_p[None, :]
    if HEADS == 2:
        dt_k1 = tl.load(dt_ptr + head_q1 + offs_k, mask=offs_k < Q, other=0.0)
    # Both heads' loads before either head's stores: the compiler cannot move a load above a store (the pointers
    # might alias), so a load placed after the first head's stores is a second memory round trip per program. Here
    # both heads' x for q are loaded before the first q is stored, and after the loop both heads' x, dy (the D term)
    # and D before the first output (Triton 3.6's sm_90 code: all of them issued back to back). q itself stays
    # stored before the loop: held through it, the two q columns took 336 bytes of spills under dx_maxnreg 168.
    if DX_STATE_FIRST:
        acc0, acc1 = _state_term(B_ptr, dH_ptr, b, c, g, h0, t_k, valid_k, offs_p, mask_p, NC, H, P, N, s_b_b, s_b_g,
                                 s_b_l, s_b_n, HEADS, PREC, BLOCK_K, BLOCK_P, BLOCK_N)  # fmt: skip
        x_k0 = tl.load(x_base0, mask=mask_kp, other=0.0)
        if HEADS == 2:
            x_k1 = tl.load(x_base0 + s_x_h, mask=mask_kp, other=0.0)
        # x is loaded for q here and again for the outputs: held through the loop it costs registers.
        acc0, q0 = _fold_state(acc0, x_k0.to(tl.float32), dt_k0, dA_ptr + head_q0, a2_k0, keep_k, Q, SUMS_2D)
        if HEADS == 2:
            acc1, q1 = _fold_state(acc1, x_k1.to(tl.float32), dt_k1, dA_ptr + head_q1, a2_k1, keep_k, Q, SUMS_2D)
        _store_q(q_ptr + head_q0, q0, offs_k, Q, SUMS_2D)
        if HEADS == 2:
            _store_q(q_ptr + head_q1, q1, offs_k, Q, SUMS_2D)
    else:
        acc0 = tl.zeros((BLOCK_K, BLOCK_P), dtype=tl.float32)
        acc1 = acc0
    CBT_chunk = CBT_ptr + ((b.to(tl.int64) * NC + c) * G + g) * Q * Q  # CBᵀ[s, l] = CB[l, s]
    for m0 in range((pid_k * BLOCK_K // BLOCK_M) * BLOCK_M, Q, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        cb_ptrs = CBT_chunk + offs_k[:, None] * Q + offs_m[None, :]
        dy_offs = offs_m[:, None] * s_y_l + offs_p[None, :] * s_y_p
        # CB is 0 above the diagonal, across documents and past the end (cb_fwd): no mask here, and the clamp keeps
        # the decay finite where CB is 0. CBᵀ's rows are contiguous, so its loads are vectorised.
        if EVEN:
            cbT = tl.load(cb_ptrs)
        else:
            cbT = tl.load(cb_ptrs, mask=(offs_k < Q)[:, None] & (offs_m < Q)[None, :], other=0.0)
        acc0 = _intra_tile(
            acc0, cbT, dA_ptr + head_q0, dy_chunk0 + dy_offs, a2_k0, offs_m, t0, L, Q, mask_p, EVEN, PREC
        )
        if HEADS == 2:
            acc1 = _intra_tile(
                acc1, cbT, dA_ptr + head_q1, dy_chunk1 + dy_offs, a2_k1, offs_m, t0, L, Q, mask_p, EVEN, PREC
            )
    if not DX_STATE_FIRST:
        acc_h0, acc_h1 = _state_term(B_ptr, dH_ptr, b, c, g, h0, t_k, valid_k, offs_p, mask_p, NC, H, P, N, s_b_b,
                                     s_b_g, s_b_l, s_b_n, HEADS, PREC, BLOCK_K, BLOCK_P, BLOCK_N)  # fmt: skip

    # Per head: x (for q when the state term comes last, and for the outputs) and dy (the D term), all loaded
    # before the first store.
    dy_base0 = dy_ptr + b.to(tl.int64) * s_y_b + h0 * s_y_h + t_k[:, None] * s_y_l + offs_p[None, :] * s_y_p
    x_k0 = tl.load(x_base0, mask=mask_kp, other=0.0)
    dy_k0 = x_k0
    D_h0 = 0.0
    if HAS_D:
        dy_k0 = tl.load(dy_base0, mask=mask_kp, other=0.0)
        D_h0 = _load_D(D_ptr, h0, offs_p, mask_p, P, D_HAS_HDIM)
    x_k1 = x_k0
    dy_k1 = dy_k0
    D_h1 = D_h0
    if HEADS == 2:
        x_k1 = tl.load(x_base0 + s_x_h, mask=mask_kp, other=0.0)
        if HAS_D:
            dy_k1 = tl.load(dy_base0 + s_y_h, mask=mask_kp, other=0.0)
            D_h1 = _load_D(D_ptr, h0 + 1, offs_p, mask_p, P, D_HAS_HDIM)
    if not DX_STATE_FIRST:
        acc_h0, q0 = _fold_state(acc_h0, x_k0.to(tl.float32), dt_k0, dA_ptr + head_q0, a2_k0, keep_k, Q, SUMS_2D)
        acc0 += acc_h0
        if HEADS == 2:
            acc_h1, q1 = _fold_state(acc_h1, x_k1.to(tl.float32), dt_k1, dA_ptr + head_q1, a2_k1, keep_k, Q, SUMS_2D)
            acc1 += acc_h1
        _store_q(q_ptr + head_q0, q0, offs_k, Q, SUMS_2D)
        if HEADS == 2:
            _store_q(q_ptr + head_q1, q1, offs_k, Q, SUMS_2D)
    # fmt: off
    _dx_outputs(
        acc0, x_k0, dy_k0, dt_k0, D_h0, dx_ptr, ddt_ptr + head_q0, dD_ptr, b, c, h0, pid_k, n_k, mask_kp,
        offs_k, offs_p, mask_p, t_k, Q, NC, H, P, s_dx_b, s_dx_h, s_dx_l, s_dx_p,
        HAS_D=HAS_D, D_HAS_HDIM=D_HAS_HDIM, SUMS_2D=SUMS_2D,
    )
    if HEADS == 2:
        _dx_outputs(
            acc1, x_k1, dy_k1, dt_k1, D_h1, dx_ptr, ddt_ptr + head_q1, dD_ptr, b, c, h0 + 1, pid_k, n_k,
            mask_kp, offs_k, offs_p, mask_p, t_k, Q, NC, H, P, s_dx_b, s_dx_h, s_dx_l, s_dx_p,
            HAS_D=HAS_D, D_HAS_HDIM=D_HAS_HDIM, SUMS_2D=SUMS_2D,
        )
    # fmt: on


@triton.jit
def _intra_tile(acc, cbT, dA_head, dy_ptrs, a2_k, offs_m, t0, L, Q, mask_p, EVEN: tl.constexpr, PREC: tl.constexpr):
    """acc += (CBᵀ ∘ exp(a_l - a_s)) · dy over one block of l, for one head."""
    if EVEN:
        a_m = tl.load(dA_head + offs_m)
        dy_m = tl.load(dy_ptrs)
    else:
        a_m = tl.load(dA_head + offs_m, mask=offs_m < Q, other=0.0)
        dy_m = tl.load(dy_ptrs, mask=((offs_m < Q) & (t0 + offs_m < L))[:, None] & mask_p[None, :], other=0.0)
    wT = cbT * tl.exp2(tl.minimum(a_m[None, :] * LOG2E - a2_k[:, None], 0.0))
    return acc + tl.dot(wT.to(dy_m.dtype), dy_m, input_precision=PREC)


@triton.jit
def _state_term(B_ptr, dH_ptr, b, c, g, h0, t_k, valid_k, offs_p, mask_p, NC, H, P, N, s_b_b, s_b_g, s_b_l, s_b_n,
                HEADS: tl.constexpr, PREC: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """B_s · dHᵀ over N for heads h0 (and h0 + 1 with HEADS 2; else the second repeats the first), unscaled; B is
    the group's, loaded once for both heads."""
    B_base = B_ptr + b.to(tl.int64) * s_b_b + g * s_b_g + t_k[:, None] * s_b_l
    dH_base0 = dH_ptr + ((b.to(tl.int64) * NC + c) * H + h0) * P * N + offs_p[None, :] * N
    acc0 = tl.zeros((BLOCK_K, BLOCK_P), dtype=tl.float32)
    acc1 = acc0
    if HEADS == 2:
        acc1 = tl.zeros((BLOCK_K, BLOCK_P), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        b_tile = tl.load(B_base + offs_n[None, :] * s_b_n, mask=valid_k[:, None] & mask_n[None, :], other=0.0)
        dH_mask = mask_n[:, None] & mask_p[None, :]
        dHT0 = tl.load(dH_base0 + offs_n[:, None], mask=dH_mask, other=0.0)
        acc0 += tl.dot(b_tile, dHT0.to(b_tile.dtype), input_precision=PREC)
        if HEADS == 2:
            dHT1 = tl.load(dH_base0 + P * N + offs_n[:, None], mask=dH_mask, other=0.0)
            acc1 += tl.dot(b_tile, dHT1.to(b_tile.dtype), input_precision=PREC)
    return acc0, acc1


@triton.jit
def _row_sums(prod, SUMS_2D: tl.constexpr):
    """The row sums of prod (an accumulator-layout [BLOCK_K, P] float32 tile): [BLOCK_K, 1] with SUMS_2D, else
    [BLOCK_K]. Kept 2-D and stored through [BLOCK_K, 1] pointers (_rows), the sums stay in the accumulator's layout;
    for a 1-D result Triton 3.6 first converts the whole float32 tile to a blocked layout through shared memory (dx's
    machine code: 1960 -> 1832 instructions, 30 -> 22 barriers, 124 -> 116 registers; kernel_resources.py)."""
    if SUMS_2D:
        return tl.sum(prod, axis=1, keep_dims=True)
    else:
        return tl.sum(prod, axis=1)


@triton.jit
def _rows(v_k, SUMS_2D: tl.constexpr):
    """A [BLOCK_K] vector (pointers, mask, scale) shaped like _row_sums' result."""
    if SUMS_2D:
        return v_k[:, None]
    else:
        return v_k


@triton.jit
def _fold_state(acc_h, x_k, dt_k, dA_head, a2_k, keep_k, Q, SUMS_2D: tl.constexpr):
    """One head's chunk-state term scaled by [kept] exp(a_last - a_s), and its q_s = dt_s (term · x_s) (x_k: the
    head's x rows in float32; q shaped as _row_sums' result, stored by the caller)."""
    a2_last = tl.load(dA_head + Q - 1) * LOG2E
    acc_h = acc_h * tl.where(keep_k, tl.exp2(a2_last - a2_k), 0.0)[:, None]
    q = _rows(dt_k, SUMS_2D) * _row_sums(acc_h * x_k, SUMS_2D)
    return acc_h, q


@triton.jit
def _store_q(q_head, q, offs_k, Q, SUMS_2D: tl.constexpr):
    """One head's q (_fold_state's) stored at rows offs_k of its [Q] slice."""
    tl.store(_rows(q_head + offs_k, SUMS_2D), q, mask=_rows(offs_k < Q, SUMS_2D))


@triton.jit
def _load_D(D_ptr, h, offs_p, mask_p, P, D_HAS_HDIM: tl.constexpr):
    """Head h's D: its [P] vector (D of [H, P]) or its scalar (D of [H])."""
    if D_HAS_HDIM:
        return tl.load(D_ptr + h * P + offs_p, mask=mask_p, other=0.0)
    else:
        return tl.load(D_ptr + h)


@triton.jit
def _dx_outputs(
    acc, x_k, dy_k, dt_k, D_h, dx_ptr, ddt_head, dD_ptr, b, c, h, pid_k, n_k, mask_kp, offs_k, offs_p, mask_p,
    t_k, Q, NC, H, P, s_dx_b, s_dx_h, s_dx_l, s_dx_p, HAS_D: tl.constexpr, D_HAS_HDIM: tl.constexpr,
    SUMS_2D: tl.constexpr,
):  # fmt: skip
    """One head's outputs from its accumulator (both terms), its x rows and (with D) its dy rows and D (_load_D):
    ddt, dx (+ D dy) and dD's partial sums."""
    x_k = x_k.to(tl.float32)
    tl.store(_rows(ddt_head + offs_k, SUMS_2D), _row_sums(acc * x_k, SUMS_2D), mask=_rows(offs_k < Q, SUMS_2D))
    dx = acc * dt_k[:, None]
    if HAS_D:
        dy_k = dy_k.to(tl.float32)
        if D_HAS_HDIM:
            dx += dy_k * D_h[None, :]
        else:
            dx += dy_k * D_h
        # dD partial sums, [B * NC * num_k_blocks, H, P] (D of [H, P]) or [B * NC * num_k_blocks, H] (D of [H]:
        # summed over P here), summed over the first axis on the host. (As [H, B * NC * num_k_blocks, P] summed over
        # the middle axis and then over P, torch's sums took 0.020 ms at 1.3B.)
        dD_col = tl.sum(dy_k * x_k, axis=0)
        row = ((b.to(tl.int64) * NC + c) * n_k + pid_k) * H + h
        if D_HAS_HDIM:
            tl.store(dD_ptr + row * P + offs_p, dD_col, mask=mask_p)
        else:
            tl.store(dD_ptr + row, tl.sum(dD_col, axis=0))
    tl.store(
        dx_ptr + b.to(tl.int64) * s_dx_b + h * s_dx_h + t_k[:, None] * s_dx_l + offs_p[None, :] * s_dx_p,
        dx.to(dx_ptr.dtype.element_ty),
        mask=mask_kp,
    )
