"""C·Bᵀ per chunk and group: CB[b, c, g, l, s] = C_l · B_s for positions l, s of chunk c (float32),
and 0 where l and s belong to different documents (HAS_SEQ), so consumers may rely on CB alone for that mask.

Computed once per group and shared by every head of the group (with ngroups 1, by all heads), so the
chunk-scan kernels never recompute it. Tiles wholly above the diagonal (s > l everywhere) are skipped
and left unwritten: every consumer masks s <= l with ``tl.where`` before using a value.
"""

import triton
import triton.language as tl


@triton.jit
def cb_fwd_kernel(
    C_ptr,
    B_ptr,
    CB_ptr,
    seq_ptr,
    L,
    Q,
    NC,
    G,
    N,
    s_c_b,
    s_c_l,
    s_c_g,
    s_c_n,
    s_b_b,
    s_b_l,
    s_b_g,
    s_b_n,
    HAS_SEQ: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_bcg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    if pid_s * BLOCK_S > pid_m * BLOCK_M + BLOCK_M - 1:
        return  # the whole tile is above the diagonal
    g = pid_bcg % G
    c = (pid_bcg // G) % NC
    b = pid_bcg // (G * NC)
    t0 = c * Q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    valid_m = (offs_m < Q) & (t0 + offs_m < L)
    valid_s = (offs_s < Q) & (t0 + offs_s < L)
    C_base = C_ptr + b.to(tl.int64) * s_c_b + g * s_c_g + (t0 + offs_m).to(tl.int64)[:, None] * s_c_l
    B_base = B_ptr + b.to(tl.int64) * s_b_b + g * s_b_g + (t0 + offs_s).to(tl.int64)[None, :] * s_b_l
    acc = tl.zeros((BLOCK_M, BLOCK_S), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        c_tile = tl.load(C_base + offs_n[None, :] * s_c_n, mask=valid_m[:, None] & mask_n[None, :], other=0.0)
        bT_tile = tl.load(B_base + offs_n[:, None] * s_b_n, mask=mask_n[:, None] & valid_s[None, :], other=0.0)
        acc += tl.dot(c_tile, bT_tile, input_precision=PREC)
    if HAS_SEQ:
        seq_m = tl.load(seq_ptr + b.to(tl.int64) * L + t0 + offs_m, mask=valid_m, other=-1)
        seq_s = tl.load(seq_ptr + b.to(tl.int64) * L + t0 + offs_s, mask=valid_s, other=-2)
        acc = tl.where(seq_m[:, None] == seq_s[None, :], acc, 0.0)
    CB_base = CB_ptr + ((b.to(tl.int64) * NC + c) * G + g) * Q * Q
    tl.store(
        CB_base + offs_m[:, None] * Q + offs_s[None, :],
        acc,
        mask=(offs_m < Q)[:, None] & (offs_s < Q)[None, :],
    )
