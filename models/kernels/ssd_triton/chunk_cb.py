"""C·Bᵀ per chunk and group: CB[b, c, g, l, s] = C_l · B_s for positions s <= l of chunk c (float32),
and 0 where l and s belong to different documents (HAS_SEQ), so consumers may rely on CB alone for that mask.

Computed once per group and shared by every head of the group (with ngroups 1, by all heads), so the
chunk-scan kernels never recompute it. CB is also 0 above the diagonal (s > l), as far as its consumers read: each
reads, for a row l, the columns up to the end of l's block of rows, at most READ_BLOCK wide (the largest of their
row blocks: forward.cb_read_block), so tiles wholly beyond that are not even stored, and the others above the
diagonal are stored as zeros without computing them. So a consumer forms its weights as
CB * exp(min(a_l - a_s, 0)) with no per-element mask at all (the clamp keeps the factor finite where CB is 0): the
masks cost the consumers' inner loops more instructions than the products themselves.
"""

import triton
import triton.language as tl

from models.kernels.fast_launch import fast_launch
from models.kernels.pdl import pdl_prologue

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # the inner loops take exp(u) as exp2(u * LOG2E)


@fast_launch
@triton.jit
def cb_fwd_kernel(
    C_ptr,
    B_ptr,
    CB_ptr,
    CBT_ptr,
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
    WRITE_T: tl.constexpr,
    READ_BLOCK: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    pid_bcg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
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
    # Tiles wholly above the diagonal skip the product (and store the zeros).
    n_end = tl.where(pid_s * BLOCK_S > pid_m * BLOCK_M + BLOCK_M - 1, 0, N)
    for n0 in range(0, n_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        c_tile = tl.load(C_base + offs_n[None, :] * s_c_n, mask=valid_m[:, None] & mask_n[None, :], other=0.0)
        bT_tile = tl.load(B_base + offs_n[:, None] * s_b_n, mask=mask_n[:, None] & valid_s[None, :], other=0.0)
        acc += tl.dot(c_tile, bT_tile, input_precision=PREC)
    keep = offs_s[None, :] <= offs_m[:, None]
    if HAS_SEQ:
        seq_m = tl.load(seq_ptr + b.to(tl.int64) * L + t0 + offs_m, mask=valid_m, other=-1)
        seq_s = tl.load(seq_ptr + b.to(tl.int64) * L + t0 + offs_s, mask=valid_s, other=-2)
        keep = keep & (seq_m[:, None] == seq_s[None, :])
    acc = tl.where(keep, acc, 0.0)
    chunk_offset = ((b.to(tl.int64) * NC + c) * G + g) * Q * Q
    # Columns past the consumers' diagonal blocks (of READ_BLOCK rows, module docstring) are never read: not stored
    # (at 64-row tiles, 6 of a 256-chunk's 16 tiles).
    read_s = offs_s < ((pid_m * BLOCK_M + BLOCK_M - 1) // READ_BLOCK + 1) * READ_BLOCK
    in_chunk = (offs_m < Q)[:, None] & ((offs_s < Q) & read_s)[None, :]
    tl.store(CB_ptr + chunk_offset + offs_m[:, None] * Q + offs_s[None, :], acc, mask=in_chunk)
    if WRITE_T:
        # CBᵀ for the dx kernel, whose operand is CBᵀ (reading CB transposed instead, its strided loads made dx
        # slower, 0.412 -> 0.437 ms at 1.3B, although this store then goes: CB 0.023 -> 0.019 ms; session 17).
        tl.store(CBT_ptr + chunk_offset + offs_s[None, :] * Q + offs_m[:, None], acc, mask=in_chunk)
