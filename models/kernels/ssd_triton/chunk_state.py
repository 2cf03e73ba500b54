"""Chunk states and their transposed twin in the backward.

chunk_state_fwd_kernel: the state each chunk builds from its own tokens, at its last token,
    states[b, c, h] = sum_s [seq_s == seq_last] exp(a_last - a_s) dt_s x_s B_sᵀ      ([P, N], float32)
chunk_scan_bwd_dstates_kernel: the gradient of the state entering each chunk (through y's state term),
    dS_in[b, c, h] = sum_l [seq_l == seq_prev] exp(a_l) dy_l C_lᵀ                      ([P, N], float32)
Both are one [P, chunk] x [chunk, N] product per (batch, chunk, head) with a per-position scale (optionally for two
heads of a group per program, HEADS 2: the group's B or C is then read once for both); with FOLD_DT (config
fold_dt_states) dt_ptr holds a2dt = a_s log2(e) - log2(dt_s) (dt.py) and the states' scale exp(a_last - a_s) dt_s is
one 2^(a_last log2(e) - a2dt_s): no dt to load or multiply by;
a_* is the within-chunk cumulative sum of dt * A (float32), seq_prev the document of the state
entering the chunk (0 for the first chunk: the initial state belongs to document 0).
"""

import triton
import triton.language as tl

from models.kernels.fast_launch import fast_launch
from models.kernels.pdl import pdl_prologue
from models.kernels.ssd_triton.chunk_cb import LOG2E


@fast_launch
@triton.jit
def chunk_state_fwd_kernel(
    x_ptr,
    B_ptr,
    dt_ptr,
    dA_ptr,
    seq_ptr,
    states_ptr,
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
    HAS_SEQ: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FOLD_DT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    pid_bch = tl.program_id(0)
    pid_p = tl.program_id(1)
    pid_n = tl.program_id(2)
    h0 = (pid_bch % (H // HEADS)) * HEADS
    c = (pid_bch // (H // HEADS)) % NC
    b = pid_bch // ((H // HEADS) * NC)
    g = h0 // (H // G)  # HEADS divides H // G (the launcher checks): both heads are in group g
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc0, acc1 = chunk_local_states(
        x_ptr, B_ptr, dt_ptr, dA_ptr, seq_ptr, b, c, h0, g, offs_p, offs_n, L, Q, NC, H, P, N, s_x_b, s_x_l, s_x_h,
        s_x_p, s_b_b, s_b_l, s_b_g, s_b_n, HAS_SEQ, EVEN, PREC, HEADS, BLOCK_P, BLOCK_N, BLOCK_K, FOLD_DT,
    )  # fmt: skip
    out_mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    out_base0 = states_ptr + ((b.to(tl.int64) * NC + c) * H + h0) * P * N + offs_p[:, None] * N + offs_n[None, :]
    tl.store(out_base0, acc0, mask=out_mask)
    if HEADS == 2:
        tl.store(out_base0 + P * N, acc1, mask=out_mask)


@triton.jit
def chunk_local_states(x_ptr, B_ptr, dt_ptr, dA_ptr, seq_ptr, b, c, h0, g, offs_p, offs_n, L, Q, NC, H, P, N, s_x_b,
                       s_x_l, s_x_h, s_x_p, s_b_b, s_b_l, s_b_g, s_b_n, HAS_SEQ: tl.constexpr, EVEN: tl.constexpr,
                       PREC: tl.constexpr, HEADS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, FOLD_DT: tl.constexpr):  # fmt: skip
    """The [BLOCK_P, BLOCK_N] tiles of chunk c's own state for heads h0 (and h0 + 1 with HEADS 2; else the second
    tile repeats the first), float32: the loop of chunk_state_fwd_kernel, shared with chained_states.py. FOLD_DT:
    dt_ptr holds a2dt (module docstring)."""
    t0 = c * Q
    head_q0 = ((b.to(tl.int64) * H + h0) * NC + c) * Q
    head_q1 = head_q0 + NC * Q  # head h0 + 1 (used only with HEADS 2)
    if HAS_SEQ:
        seq_last = tl.load(seq_ptr + b.to(tl.int64) * L + tl.minimum(t0 + Q, L) - 1)
    else:
        seq_last = 0
    # Offsets within the chunk are int32 (the bases hold the int64 parts); with EVEN (whole tiles) no load masks.
    x_chunk0 = x_ptr + b.to(tl.int64) * s_x_b + h0 * s_x_h + t0.to(tl.int64) * s_x_l
    B_chunk = B_ptr + b.to(tl.int64) * s_b_b + g * s_b_g + t0.to(tl.int64) * s_b_l
    a_last0 = tl.load(dA_ptr + head_q0 + Q - 1)
    if FOLD_DT:
        a_last0 = a_last0 * LOG2E
    acc0 = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    acc1 = acc0
    if HEADS == 2:
        a_last1 = tl.load(dA_ptr + head_q1 + Q - 1)
        if FOLD_DT:
            a_last1 = a_last1 * LOG2E
        acc1 = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, Q, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x_offs = offs_k[None, :] * s_x_l + offs_p[:, None] * s_x_p
        b_ptrs = B_chunk + offs_k[:, None] * s_b_l + offs_n[None, :] * s_b_n
        valid_k = (offs_k < Q) & (t0 + offs_k < L)
        keep = valid_k
        if HAS_SEQ:
            if EVEN:
                seq_k = tl.load(seq_ptr + b.to(tl.int64) * L + t0 + offs_k)
            else:
                seq_k = tl.load(seq_ptr + b.to(tl.int64) * L + t0 + offs_k, mask=valid_k, other=-1)
            keep = keep & (seq_k == seq_last)
        if EVEN:
            b_tile = tl.load(b_ptrs)
        else:
            b_tile = tl.load(b_ptrs, mask=valid_k[:, None] & (offs_n < N)[None, :], other=0.0)
        acc0 = _state_tile(acc0, b_tile, x_chunk0 + x_offs, dA_ptr + head_q0, dt_ptr + head_q0, a_last0, offs_k,
                           offs_p, valid_k, keep, P, Q, HAS_SEQ, EVEN, PREC, FOLD_DT)  # fmt: skip
        if HEADS == 2:
            acc1 = _state_tile(acc1, b_tile, x_chunk0 + s_x_h + x_offs, dA_ptr + head_q1, dt_ptr + head_q1, a_last1,
                               offs_k, offs_p, valid_k, keep, P, Q, HAS_SEQ, EVEN, PREC, FOLD_DT)  # fmt: skip
    return acc0, acc1


@triton.jit
def _state_tile(acc, b_tile, x_ptrs, dA_head, dt_head, a_last, offs_k, offs_p, valid_k, keep, P, Q,
                HAS_SEQ: tl.constexpr, EVEN: tl.constexpr, PREC: tl.constexpr, FOLD_DT: tl.constexpr):  # fmt: skip
    """acc += xᵀ · (B ∘ scale) over one block of positions, for one head: scale_s = [kept] exp(a_last - a_s) dt_s
    (FOLD_DT: dt_head holds a2dt, a_last is in log2 units, scale_s = [kept] 2^(a_last - a2dt_s))."""
    if EVEN:
        xT = tl.load(x_ptrs)
    else:
        xT = tl.load(x_ptrs, mask=(offs_p < P)[:, None] & valid_k[None, :], other=0.0)
    if FOLD_DT:
        # a2dt is +inf past the chunk's end (the padding's dt is 0): its scale is 0 without a mask.
        if EVEN:
            a2dt_k = tl.load(dt_head + offs_k)
        else:
            a2dt_k = tl.load(dt_head + offs_k, mask=offs_k < Q, other=float("inf"))
        weight_k = tl.exp2(a_last - a2dt_k)
    else:
        if EVEN:
            a_k = tl.load(dA_head + offs_k)
            dt_k = tl.load(dt_head + offs_k)
        else:
            a_k = tl.load(dA_head + offs_k, mask=offs_k < Q, other=0.0)
            dt_k = tl.load(dt_head + offs_k, mask=offs_k < Q, other=0.0)
        weight_k = tl.exp(a_last - a_k) * dt_k
    if EVEN and not HAS_SEQ:
        scale_k = weight_k
    else:
        scale_k = tl.where(keep, weight_k, 0.0)
    # The per-position scale multiplies B, and B is rounded to the operand dtype after it (as mamba_ssm does), not
    # x: rounding the scaled x instead left the states with an error that the decay gradient picks up coherently
    # (Triton interpreter, float16, whole chunks: dA error 9.7e-4 against mamba_ssm's 7.2e-4; 7.3e-4 this way).
    return acc + tl.dot(xT, (b_tile * scale_k[:, None]).to(xT.dtype), input_precision=PREC)


@fast_launch
@triton.jit
def chunk_scan_bwd_dstates_kernel(
    dy_ptr,
    C_ptr,
    dA_ptr,
    seq_ptr,
    dS_ptr,
    L,
    Q,
    NC,
    H,
    G,
    P,
    N,
    s_y_b,
    s_y_l,
    s_y_h,
    s_y_p,
    s_c_b,
    s_c_l,
    s_c_g,
    s_c_n,
    HAS_SEQ: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    pid_bch = tl.program_id(0)
    pid_p = tl.program_id(1)
    pid_n = tl.program_id(2)
    h0 = (pid_bch % (H // HEADS)) * HEADS
    c = (pid_bch // (H // HEADS)) % NC
    b = pid_bch // ((H // HEADS) * NC)
    g = h0 // (H // G)  # HEADS divides H // G (the launcher checks): both heads are in group g
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc0, acc1 = chunk_local_dstates(
        dy_ptr, C_ptr, dA_ptr, seq_ptr, b, c, h0, g, offs_p, offs_n, L, Q, NC, H, P, N, s_y_b, s_y_l, s_y_h, s_y_p,
        s_c_b, s_c_l, s_c_g, s_c_n, HAS_SEQ, EVEN, PREC, HEADS, BLOCK_P, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    out_mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    out_base0 = dS_ptr + ((b.to(tl.int64) * NC + c) * H + h0) * P * N + offs_p[:, None] * N + offs_n[None, :]
    tl.store(out_base0, acc0, mask=out_mask)
    if HEADS == 2:
        tl.store(out_base0 + P * N, acc1, mask=out_mask)


@triton.jit
def chunk_local_dstates(dy_ptr, C_ptr, dA_ptr, seq_ptr, b, c, h0, g, offs_p, offs_n, L, Q, NC, H, P, N, s_y_b, s_y_l,
                        s_y_h, s_y_p, s_c_b, s_c_l, s_c_g, s_c_n, HAS_SEQ: tl.constexpr, EVEN: tl.constexpr,
                        PREC: tl.constexpr, HEADS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):  # fmt: skip
    """The [BLOCK_P, BLOCK_N] tiles of dS_in[c] (y's state term) for heads h0 (and h0 + 1 with HEADS 2; else the
    second tile repeats the first), float32: the loop of chunk_scan_bwd_dstates_kernel, shared with
    chained_states.py."""
    t0 = c * Q
    head_q0 = ((b.to(tl.int64) * H + h0) * NC + c) * Q
    head_q1 = head_q0 + NC * Q  # head h0 + 1 (used only with HEADS 2)
    if HAS_SEQ:
        prev = tl.load(seq_ptr + b.to(tl.int64) * L + tl.maximum(t0 - 1, 0))
        seq_prev = tl.where(c > 0, prev, 0)
    else:
        seq_prev = 0
    dy_chunk0 = dy_ptr + b.to(tl.int64) * s_y_b + h0 * s_y_h + t0.to(tl.int64) * s_y_l
    C_chunk = C_ptr + b.to(tl.int64) * s_c_b + g * s_c_g + t0.to(tl.int64) * s_c_l
    acc0 = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    acc1 = acc0
    if HEADS == 2:
        acc1 = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, Q, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        dy_offs = offs_k[None, :] * s_y_l + offs_p[:, None] * s_y_p
        c_ptrs = C_chunk + offs_k[:, None] * s_c_l + offs_n[None, :] * s_c_n
        valid_k = (offs_k < Q) & (t0 + offs_k < L)
        keep = valid_k
        if HAS_SEQ:
            if EVEN:
                seq_k = tl.load(seq_ptr + b.to(tl.int64) * L + t0 + offs_k)
            else:
                seq_k = tl.load(seq_ptr + b.to(tl.int64) * L + t0 + offs_k, mask=valid_k, other=-1)
            keep = keep & (seq_k == seq_prev)
        if EVEN:
            c_tile = tl.load(c_ptrs)
        else:
            c_tile = tl.load(c_ptrs, mask=valid_k[:, None] & (offs_n < N)[None, :], other=0.0)
        acc0 = _dstates_tile(acc0, c_tile, dy_chunk0 + dy_offs, dA_ptr + head_q0, offs_k, offs_p, valid_k, keep, P, Q,
                             HAS_SEQ, EVEN, PREC)  # fmt: skip
        if HEADS == 2:
            acc1 = _dstates_tile(acc1, c_tile, dy_chunk0 + s_y_h + dy_offs, dA_ptr + head_q1, offs_k, offs_p, valid_k,
                                 keep, P, Q, HAS_SEQ, EVEN, PREC)  # fmt: skip
    return acc0, acc1


@triton.jit
def _dstates_tile(acc, c_tile, dy_ptrs, dA_head, offs_k, offs_p, valid_k, keep, P, Q, HAS_SEQ: tl.constexpr,
                  EVEN: tl.constexpr, PREC: tl.constexpr):  # fmt: skip
    """acc += (dy ∘ scale)ᵀ · C over one block of positions, for one head: scale_l = [kept] exp(a_l)."""
    if EVEN:
        a_k = tl.load(dA_head + offs_k)
        dyT = tl.load(dy_ptrs)
    else:
        a_k = tl.load(dA_head + offs_k, mask=offs_k < Q, other=0.0)
        dyT = tl.load(dy_ptrs, mask=(offs_p < P)[:, None] & valid_k[None, :], other=0.0)
    if EVEN and not HAS_SEQ:
        scale_k = tl.exp(a_k)
    else:
        scale_k = tl.where(keep, tl.exp(a_k), 0.0)
    return acc + tl.dot((dyT * scale_k[None, :]).to(c_tile.dtype), c_tile, input_precision=PREC)
