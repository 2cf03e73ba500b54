"""Backward for C and B with the intra-chunk part summed over heads first.

Multiplying every head's dCB^h by B (for dC) and by C (for dB) would take two N-wide products per head and tile
pair (the removed "per_head" mode, config.py's block_config). Here one program per (batch, chunk, group, block of
heads, tile [l, s]) sums dCB^h over its heads, so the intra-chunk parts become two per-group products in bc_finish,
dC += dCB B and dB += dCBᵀ C (C·Bᵀ's own backward, once per group):
    dCB_ls = sum_h [s <= l, seq_s == seq_l] exp(a^h_l - a^h_s) dt^h_s (dy^h_l · x^h_s)      (float32)
The same launch gives, per head, the state term O of the decay gradient and the state term of dC summed over its
heads (in programs of their own; the state term of dB comes from db_bwd.py), and the intra-chunk decay terms: with
M_ls = dCB^h_ls CB_ls, the pairs whose decay spans t sum to
    R_t = sum_{l >= t > s} M_ls = sum_{j >= t} (r_j - c_j),   r_j = sum_s M_js (row), c_j = sum_l M_lj (column),
so each tile only adds its row and column sums of M, into R_part[slot, b, h, c, position]: a tile (rows of block
m, columns of block k < m) writes +r at its rows in slot k and -c at its columns in slot m, the diagonal tile
r - c at its positions in slot m, so every entry is written exactly once (no zero fill) and the host takes
R = reverse cumsum over positions of the sum over slots (autograd.py). M is float32 and the diagonal M_jj enters
r_j and c_j as the same float32 value, so the subtraction loses nothing at bf16's scale (the cumulative sums of a
first version's bf16-rounded terms did; docs/performance.md). The column sums reduce across the program's warps.
Below the diagonal, config dcb_col_parts (4) splits each column sum into partial sums over
groups of rows, one per warp, so no head waits for a reduction across warps: group 0's goes to slot m as above, the
others to extra slots after the n_m slots, (n_m - 1) (parts - 1) of them, which dt_bwd_kernel adds only at the
positions they were written (blocks before m): no zero fill there either. Config dcb_diag_col_parts (on) does the
same on the diagonal, with r and the parts in slots of their own (parts more, written at every position).
Tiles below the diagonal (k < m) need no causal mask, and with EVEN (whole tiles) no load masks: see
chunk_scan_bwd.py on why the inner loops avoid per-element masks.
Loads and scheduling are not what bound the tiles: with TMA descriptor loads they ran 2% faster (~0.15 ms of a
1.3B step: not kept), with Triton's automatic warp specialisation 1.9x slower, and as a hand-scheduled Gluon kernel
(TMA ring, asynchronous wgmma, the next head's product overlapped or not) 1-15% slower (H200, docs/ssd_sessions.md,
session 36); the per-head element-wise work (~21 instructions per element of the tile) is.
"""

import triton
import triton.language as tl

from models.kernels.fast_launch import fast_launch
from models.kernels.pdl import pdl_prologue
from models.kernels.ssd_triton.chunk_cb import LOG2E
from models.kernels.ssd_triton.chunk_scan import FOLD_MAX_EXP
from models.kernels.ssd_triton.launch import program_ids


@fast_launch
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
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INNER_FIRST: tl.constexpr,
    HEADS_STAGES: tl.constexpr = None,
    COL_PARTS: tl.constexpr = 1,
    DIAG_PARTS: tl.constexpr = False,
    FOLD_DT: tl.constexpr = False,
    PART: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    # PART (config dcb_state_apart): 0, the tiles and the state term in one launch (the grid's last axis n_m + 1);
    # 1, the tiles only (n_m); 2, the state term only (1). Apart, each launch compiles only its own branches, so
    # the tiles can take a register cap of their own: every branch alone takes ~255 registers uncapped, and capped at
    # 168 the tiles' heads loops stay (almost) free of spills while the state term's do not (kernel_resources.py).
    # One program per tile (rows pid_m, columns pid_k < n_m): above the diagonal it does nothing (bc_finish reads
    # the tiles on and below it only, so they are not even zeroed), on or below it one tile; programs pid_k = n_m do
    # the state term of dC and O. Every program loops over its heads once, and the state term, which is as long as a
    # tile, does not run after the diagonal tile in series (H100, 1.3B: 0.582 -> 0.441 ms, session 11).
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    n_m = tl.cdiv(Q, BLOCK_M)
    if PART == 0:
        pid0, pid_m, pid_k = program_ids(n_m, n_m + 1, INNER_FIRST)
    elif PART == 1:
        pid0, pid_m, pid_k = program_ids(n_m, n_m, INNER_FIRST)
    else:
        pid0, pid_m, pid_k = program_ids(n_m, 1, INNER_FIRST)
    n_hb = (H // G) // HEADS_PER_PROG
    hb = pid0 % n_hb
    g = (pid0 // n_hb) % G
    c = (pid0 // (n_hb * G)) % NC
    b = pid0 // (n_hb * G * NC)
    t0 = c * Q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid_m = (offs_m < Q) & (t0 + offs_m < L)
    t_m = (t0 + offs_m).to(tl.int64)
    keep_m = valid_m
    if HAS_SEQ:
        seq_m = tl.load(seq_ptr + b.to(tl.int64) * L + t_m, mask=valid_m, other=-1)
        prev = tl.load(seq_ptr + b.to(tl.int64) * L + tl.maximum(t0 - 1, 0))
        keep_m = keep_m & (seq_m == tl.where(c > 0, prev, 0))
    h0 = g * (H // G) + hb * HEADS_PER_PROG
    m0 = pid_m * BLOCK_M
    # (PART's comparisons are compile-time: Triton short-circuits them, so a launch compiles only its branches.)
    if PART == 2 or (PART == 0 and pid_k >= n_m):  # the heads' state term
        _dcb_state(
            dy_ptr, dA_ptr, C_ptr, S_in_ptr, dCstate_ptr, O_ptr, L, Q, NC, H, G, P, N, BATCH, s_c_b, s_c_l, s_c_g,
            s_c_n, s_y_b, s_y_l, s_y_h, s_y_p, b, c, g, h0, HEADS_PER_PROG, hb, offs_m, valid_m, t_m, keep_m,
            PREC=PREC, BLOCK_M=BLOCK_M, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N,
        )  # fmt: skip
    elif pid_k < pid_m:  # one tile below the diagonal
        _dcb_tile(
            dy_ptr, x_ptr, dt_ptr, dA_ptr, CB_ptr, seq_ptr, dCB_ptr, R_ptr, L, Q, NC, H, G, P, BATCH, b, c, g, hb, h0,
            pid_m, pid_k * BLOCK_M, offs_m, valid_m, t0, s_x_b, s_x_l, s_x_h, s_x_p, s_y_b, s_y_l, s_y_h, s_y_p,
            HEADS_PER_PROG, HAS_SEQ=HAS_SEQ, EVEN=EVEN, DIAG=False, PREC=PREC, BLOCK=BLOCK_M, BLOCK_P=BLOCK_P,
            HEADS_STAGES=HEADS_STAGES, COL_PARTS=COL_PARTS, DIAG_PARTS=DIAG_PARTS, FOLD_DT=FOLD_DT,
        )  # fmt: skip
    elif pid_k == pid_m:  # the diagonal tile; pid_k > pid_m, above the diagonal, has nothing to do
        _dcb_tile(
            dy_ptr, x_ptr, dt_ptr, dA_ptr, CB_ptr, seq_ptr, dCB_ptr, R_ptr, L, Q, NC, H, G, P, BATCH, b, c, g, hb, h0,
            pid_m, m0, offs_m, valid_m, t0, s_x_b, s_x_l, s_x_h, s_x_p, s_y_b, s_y_l, s_y_h, s_y_p, HEADS_PER_PROG,
            HAS_SEQ=HAS_SEQ, EVEN=EVEN, DIAG=True, PREC=PREC, BLOCK=BLOCK_M, BLOCK_P=BLOCK_P,
            HEADS_STAGES=HEADS_STAGES, COL_PARTS=COL_PARTS, DIAG_PARTS=DIAG_PARTS, FOLD_DT=FOLD_DT,
        )  # fmt: skip


@triton.jit
def _dcb_state(
    dy_ptr, dA_ptr, C_ptr, S_in_ptr, dCstate_ptr, O_ptr, L, Q, NC, H, G, P, N, BATCH, s_c_b, s_c_l, s_c_g, s_c_n,
    s_y_b, s_y_l, s_y_h, s_y_p, b, c, g, h_first, n_heads, slot, offs_m, valid_m, t_m, keep_m,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """State term of dC summed over heads h_first ... h_first + n_heads - 1 (into dC_state's slot `slot`), and O
    per head, at positions offs_m."""
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    h0 = h_first
    C_m = tl.load(
        C_ptr + b.to(tl.int64) * s_c_b + g * s_c_g + t_m[:, None] * s_c_l + offs_n[None, :] * s_c_n,
        mask=valid_m[:, None] & mask_n[None, :],
        other=0.0,
    )
    dC_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(n_heads):
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
    out = dCstate_ptr + ((slot.to(tl.int64) * BATCH + b) * L + t_m[:, None]) * G * N + g * N + offs_n[None, :]
    tl.store(out, dC_acc, mask=valid_m[:, None] & mask_n[None, :])


@triton.jit
def _dcb_head(
    dy_chunk, x_chunk, dt_ptr, dA_ptr, cb, b, c, h, NC, Q, H, P, t0, L, offs_m, offs_k, offs_p, valid_m, in_k,
    s_x_h, s_x_l, s_x_p, s_y_h, s_y_l, s_y_p, EVEN: tl.constexpr, PREC: tl.constexpr, CLAMP: tl.constexpr,
    FOLD_DT: tl.constexpr,
):  # fmt: skip
    """Head h's share of a tile: dCB^h (unmasked), M = dCB^h CB itself, its row sums r (at offs_m), and the head's
    offset into [B, H, NC, Q] arrays. CLAMP: the decay's exponent clamped at 0, which a whole tile
    below the diagonal does not need (a falls along the chunk: a_l <= a_s for l > s, up to the cumsum's rounding),
    saving an instruction per element and head (859 against 891 per head in Triton 3.6's loop, the same registers).
    FOLD_DT (config fold_dt): dt_ptr holds a2dt (dt.py), so exp(a_l - a_s) dt_s is one 2^(a_l log2(e) - a2dt_s) and
    a_s is not loaded; the clamp is then at chunk_scan's FOLD_MAX_EXP (a_l - a_s <= 0 does not bound log2(dt_s))."""
    head_q = ((b.to(tl.int64) * H + h) * NC + c) * Q
    dy_ptrs = dy_chunk + h * s_y_h + offs_m[:, None] * s_y_l + offs_p[None, :] * s_y_p
    x_ptrs = x_chunk + h * s_x_h + offs_k[None, :] * s_x_l + offs_p[:, None] * s_x_p
    if EVEN:
        a_m = tl.load(dA_ptr + head_q + offs_m)
        if not FOLD_DT:
            a_k = tl.load(dA_ptr + head_q + offs_k)
        dt_k = tl.load(dt_ptr + head_q + offs_k)
        dy_m = tl.load(dy_ptrs)
        xT = tl.load(x_ptrs)
    else:
        valid_k = in_k & (t0 + offs_k < L)
        a_m = tl.load(dA_ptr + head_q + offs_m, mask=offs_m < Q, other=0.0)
        if not FOLD_DT:
            a_k = tl.load(dA_ptr + head_q + offs_k, mask=in_k, other=0.0)
        dt_k = tl.load(dt_ptr + head_q + offs_k, mask=in_k, other=float("inf") if FOLD_DT else 0.0)
        dy_m = tl.load(dy_ptrs, mask=valid_m[:, None] & (offs_p < P)[None, :], other=0.0)
        xT = tl.load(x_ptrs, mask=(offs_p < P)[:, None] & valid_k[None, :], other=0.0)
    dyx = tl.dot(dy_m, xT, input_precision=PREC)
    # Unmasked: CB is 0 above the diagonal and across documents (cb_fwd), so M needs no mask, and the clamp
    # keeps dcb finite there; the sum over heads is masked once by the caller, not per head.
    if FOLD_DT:
        log2_w = a_m[:, None] * LOG2E - dt_k[None, :]
        if CLAMP:
            log2_w = tl.minimum(log2_w, FOLD_MAX_EXP)
        dcb = dyx * tl.exp2(log2_w)
    else:
        log2_decay = a_m[:, None] * LOG2E - (a_k * LOG2E)[None, :]
        if CLAMP:  # on the diagonal (pairs above it) or with load masks (rows past the chunk read a = 0)
            log2_decay = tl.minimum(log2_decay, 0.0)
        dcb = dyx * tl.exp2(log2_decay) * dt_k[None, :]
    M = dcb * cb
    return dcb, M, tl.sum(M, axis=1), head_q


@triton.jit
def _store_sums(R_rows, R_cols, head_q, r, col, offs_m, offs_k, Q, in_k, DIAG: tl.constexpr):
    """A head's row sums r and column sums col of M into R_part (module docstring)."""
    if DIAG:
        tl.store(R_cols + head_q + offs_m, r - col, mask=offs_m < Q)
    else:
        tl.store(R_rows + head_q + offs_m, r, mask=offs_m < Q)
        tl.store(R_cols + head_q + offs_k, -col, mask=in_k)


@triton.jit
def _store_sums_in_parts(R_ptr, R_rows, R_cols, head_q, r, M, pid_m, offs_m, offs_k, Q, in_k, slot,
                         PARTS: tl.constexpr, BLOCK: tl.constexpr, DIAG: tl.constexpr):  # fmt: skip
    """M's column sums as PARTS partial sums over groups of BLOCK // PARTS rows (with one group per warp, each a
    reduction within its warp: no shared memory, no barrier). Below the diagonal: the row sums r as _store_sums
    writes them, the first group's column sums into slot pid_m as _store_sums does, group j > 0's into R_part's
    extra slot n_m + (pid_m - 1) (PARTS - 1) + j - 1, which dt_bwd_kernel adds at the positions of the blocks before
    pid_m. On the diagonal (config dcb_diag_col_parts): r alone into slot pid_m and group j's sums into the extra
    slot n_m + (n_m - 1) (PARTS - 1) + j, which every block's diagonal tile writes at its own positions; M_jj still
    enters r_j and one group's sum as the same float32 value."""
    cols = tl.sum(tl.reshape(M, (PARTS, BLOCK // PARTS, BLOCK)), axis=1)  # [PARTS, BLOCK]
    part = tl.arange(0, PARTS)
    n_m = tl.cdiv(Q, BLOCK)
    if DIAG:
        tl.store(R_cols + head_q + offs_m, r, mask=offs_m < Q)
        slot_of = n_m + (n_m - 1) * (PARTS - 1) + part
    else:
        tl.store(R_rows + head_q + offs_m, r, mask=offs_m < Q)
        slot_of = tl.where(part == 0, pid_m, n_m + (pid_m - 1) * (PARTS - 1) + part - 1)
    tl.store(R_ptr + slot_of.to(tl.int64)[:, None] * slot + head_q + offs_k[None, :], -cols, mask=in_k[None, :])


@triton.jit
def _dcb_tile(
    dy_ptr, x_ptr, dt_ptr, dA_ptr, CB_ptr, seq_ptr, dCB_ptr, R_ptr, L, Q, NC, H, G, P, BATCH, b, c, g, hb, h0,
    pid_m, k0, offs_m, valid_m, t0, s_x_b, s_x_l, s_x_h, s_x_p, s_y_b, s_y_l, s_y_h, s_y_p, HEADS_PER_PROG,
    HAS_SEQ: tl.constexpr, EVEN: tl.constexpr, DIAG: tl.constexpr, PREC: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_P: tl.constexpr, HEADS_STAGES: tl.constexpr, COL_PARTS: tl.constexpr, DIAG_PARTS: tl.constexpr,
    FOLD_DT: tl.constexpr,
):  # fmt: skip
    """One tile (rows l: block pid_m, columns s: k0 ...) of dCB summed over the program's heads, with each head's
    row and column sums of M into R_part (module docstring). The column sums reduce across the warps (through shared
    memory, with a barrier): ~0.11 of dCB's 0.45 ms at the 1.3B shape (H100, docs/ssd_sessions.md, session 14), hence
    COL_PARTS below. HEADS_STAGES (not None): the heads loop software-pipelined over that many
    stages for every load in it, the per-head vectors a_m, a_k, dt_k too (through shared memory; Triton pipelines
    only the loads that feed a product otherwise, so each head waits for those three plain loads). COL_PARTS > 1
    (per-head sums, below the diagonal, and on it too with DIAG_PARTS): the column sums as partial sums over row
    groups (_store_sums_in_parts)."""
    offs_k = k0 + tl.arange(0, BLOCK)
    offs_p = tl.arange(0, BLOCK_P)
    in_k = offs_k < Q
    in_tile = (offs_m < Q)[:, None] & in_k[None, :]
    chunk_offset = ((b.to(tl.int64) * NC + c) * G + g) * Q * Q
    if EVEN:
        cb = tl.load(CB_ptr + chunk_offset + offs_m[:, None] * Q + offs_k[None, :])
    else:
        cb = tl.load(CB_ptr + chunk_offset + offs_m[:, None] * Q + offs_k[None, :], mask=in_tile, other=0.0)
    dy_chunk = dy_ptr + b.to(tl.int64) * s_y_b + t0.to(tl.int64) * s_y_l
    x_chunk = x_ptr + b.to(tl.int64) * s_x_b + t0.to(tl.int64) * s_x_l
    R_rows = R_ptr + tl.cast(k0 // BLOCK, tl.int64) * BATCH * H * NC * Q  # slot k: this tile's row sums
    R_cols = R_ptr + pid_m.to(tl.int64) * BATCH * H * NC * Q  # slot m: its column sums (and the diagonal's r - c)
    dcb_acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    # fmt: off
    for i in tl.range(HEADS_PER_PROG, num_stages=HEADS_STAGES):
        dcb, M, r, q = _dcb_head(
            dy_chunk, x_chunk, dt_ptr, dA_ptr, cb, b, c, h0 + i, NC, Q, H, P, t0, L, offs_m, offs_k, offs_p,
            valid_m, in_k, s_x_h, s_x_l, s_x_p, s_y_h, s_y_l, s_y_p, EVEN, PREC, DIAG or not EVEN, FOLD_DT,
        )
        dcb_acc += dcb
        if COL_PARTS > 1 and (DIAG_PARTS or not DIAG):
            _store_sums_in_parts(R_ptr, R_rows, R_cols, q, r, M, pid_m, offs_m, offs_k, Q, in_k,
                                 tl.cast(BATCH, tl.int64) * H * NC * Q, COL_PARTS, BLOCK, DIAG)
        else:
            _store_sums(R_rows, R_cols, q, r, tl.sum(M, axis=0), offs_m, offs_k, Q, in_k, DIAG)
    # fmt: on
    if DIAG:  # pairs above the diagonal (s > l): 0
        dcb_acc = tl.where(offs_k[None, :] <= offs_m[:, None], dcb_acc, 0.0)
    dCB_ptrs = (
        dCB_ptr + (((hb.to(tl.int64) * BATCH + b) * NC + c) * G + g) * Q * Q + offs_m[:, None] * Q + offs_k[None, :]
    )
    if HAS_SEQ:
        # Pairs in different documents: 0, by a store of their own. As a tl.where on dcb_acc (the form before session
        # 41) the document mask cost the heads loop 27 instructions per head in 64-bit address arithmetic, although
        # applied after it (sm_90, Triton 3.6, 1.3B: below the diagonal 584 -> 557 per head, 555 without documents;
        # on it 615 -> 593; with fold_dt 509 -> 500, 540 -> 531), whichever way the ids were loaded.
        seq_k = tl.load(seq_ptr + b.to(tl.int64) * L + t0 + offs_k, mask=in_k & (t0 + offs_k < L), other=-2)
        seq_m = tl.load(seq_ptr + b.to(tl.int64) * L + t0 + offs_m, mask=valid_m, other=-1)
        same = seq_k[None, :] == seq_m[:, None]
        tl.store(dCB_ptrs, tl.zeros_like(dcb_acc), mask=in_tile & ~same)
        tl.store(dCB_ptrs, dcb_acc, mask=in_tile & same)
    else:
        tl.store(dCB_ptrs, dcb_acc, mask=in_tile)
