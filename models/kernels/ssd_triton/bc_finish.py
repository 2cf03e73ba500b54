"""The last step of dB and dC in the backward: partial sums and the intra-chunk products in one kernel.

For positions r of chunk c and group g (dCB summed over its head blocks; its tiles above the diagonal are never
written, and the loops below read the tiles on and below it only: dcb_bwd.py):
    dC_r = sum_hb dC_state[hb, r] + sum_{s <= r} dCB_rs B_s      (hb: head blocks)
    dB_r = sum_hb dB_state[hb, r] + sum_{l >= r} dCB_lr C_l
written straight in B's / C's dtype. In PyTorch this was a reduction over head blocks per tensor, two padded
float32 copies of B and C, two float32 batched products (SIMT on Hopper: no tensor cores for float32 without
TF32), two un-chunking copies, two adds and the casts back. The products here run on the tensor cores in TF32 for
bf16 / fp16 inputs (dCB keeps 10 mantissa bits, where mamba_ssm rounds it to bf16's 7) and in full float32 for
float32 inputs (dot_precision).
"""

import triton
import triton.language as tl

from models.kernels.fast_launch import fast_launch
from models.kernels.pdl import pdl_prologue


@fast_launch
@triton.jit
def bc_finish_kernel(
    dCB_ptr,
    dC_state_ptr,
    dB_state_ptr,
    B_ptr,
    C_ptr,
    dB_ptr,
    dC_ptr,
    L,
    Q,
    NC,
    G,
    N,
    BATCH,
    s_b_b,
    s_b_l,
    s_b_g,
    s_b_n,
    s_c_b,
    s_c_l,
    s_c_g,
    s_c_n,
    s_db_b,
    s_db_l,
    s_db_g,
    s_db_n,
    s_dc_b,
    s_dc_l,
    s_dc_g,
    s_dc_n,
    # The partial sums' count (dC's state term, dB's and dCB's: one per head block, dcb_bwd.py) as a constant, so
    # that the loops over them unroll and their loads are in flight together (as a run-time count, 2 head blocks
    # took bc_finish from 0.030 to 0.066 ms at the 1.3B shape; H100, session 22).
    N_HB: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    pid_bcg = tl.program_id(0)
    pid_m = tl.program_id(1)
    # Axis 2: dC's programs, then dB's, each over blocks of N: at the 1.3B and 370M shapes one program per chunk and
    # block of rows doing both outputs for all of N was 256 programs of serial products (0.052 ms at either shape).
    n_nb = tl.cdiv(N, BLOCK_N)
    pid_w = tl.program_id(2)
    do_dC = pid_w < n_nb
    g = pid_bcg % G
    c = (pid_bcg // G) % NC
    b = pid_bcg // (G * NC)
    t0 = c * Q
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid_w % n_nb) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid_m = (offs_m < Q) & (t0 + offs_m < L)
    mask_mn = valid_m[:, None] & (offs_n < N)[None, :]
    t_m = (t0 + offs_m).to(tl.int64)

    # State terms: partial sums per head block, [N_HB, b, L, G, N] float32 (dC's from dcb_bwd.py, dB's from
    # db_bwd.py).
    state_at = (b.to(tl.int64) * L + t_m[:, None]) * G * N + g * N + offs_n[None, :]
    hb_stride = tl.cast(BATCH, tl.int64) * L * G * N  # BATCH may arrive as a constexpr (the JIT specialises 1)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Intra-chunk products; dCB [N_HB, b, NC, G, Q, Q] float32, each head block's partial summed as it is loaded.
    chunk = ((b.to(tl.int64) * NC + c) * G + g) * Q * Q
    hb_chunk = tl.cast(BATCH, tl.int64) * NC * G * Q * Q
    if do_dC:
        for i in tl.static_range(N_HB):
            acc += tl.load(dC_state_ptr + i * hb_stride + state_at, mask=mask_mn, other=0.0)
        B_chunk = B_ptr + b.to(tl.int64) * s_b_b + g * s_b_g + t0.to(tl.int64) * s_b_l
        hi = tl.minimum((pid_m + 1) * BLOCK_M, Q)
        for k0 in range(0, hi, BLOCK_K):  # dC_r: columns s <= r
            offs_k = k0 + tl.arange(0, BLOCK_K)
            valid_k = (offs_k < Q) & (t0 + offs_k < L)
            tile = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
            for hb in tl.static_range(N_HB):
                tile += tl.load(
                    dCB_ptr + hb * hb_chunk + chunk + offs_m[:, None] * Q + offs_k[None, :],
                    mask=(offs_m < Q)[:, None] & (offs_k < Q)[None, :],
                    other=0.0,
                )
            B_k = tl.load(
                B_chunk + offs_k[:, None] * s_b_l + offs_n[None, :] * s_b_n,
                mask=valid_k[:, None] & (offs_n < N)[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.dot(tile, B_k, input_precision=PREC)
        # Each output by its own strides: the mixer hands views of one [b, L, conv_dim] buffer (the conv's gradient).
        dC_at = b.to(tl.int64) * s_dc_b + t_m[:, None] * s_dc_l + g * s_dc_g + offs_n[None, :] * s_dc_n
        tl.store(dC_ptr + dC_at, acc.to(dC_ptr.dtype.element_ty), mask=mask_mn)
    else:
        for hb in tl.static_range(N_HB):
            acc += tl.load(dB_state_ptr + hb * hb_stride + state_at, mask=mask_mn, other=0.0)
        C_chunk = C_ptr + b.to(tl.int64) * s_c_b + g * s_c_g + t0.to(tl.int64) * s_c_l
        for l0 in range(pid_m * BLOCK_M // BLOCK_K * BLOCK_K, Q, BLOCK_K):  # dB_r: rows l >= r
            offs_l = l0 + tl.arange(0, BLOCK_K)
            valid_l = (offs_l < Q) & (t0 + offs_l < L)
            tileT = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)  # [r, l] = dCB[l, r]
            for hb in tl.static_range(N_HB):
                tileT += tl.load(
                    dCB_ptr + hb * hb_chunk + chunk + offs_l[None, :] * Q + offs_m[:, None],
                    mask=(offs_m < Q)[:, None] & (offs_l < Q)[None, :],
                    other=0.0,
                )
            C_l = tl.load(
                C_chunk + offs_l[:, None] * s_c_l + offs_n[None, :] * s_c_n,
                mask=valid_l[:, None] & (offs_n < N)[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.dot(tileT, C_l, input_precision=PREC)
        dB_at = b.to(tl.int64) * s_db_b + t_m[:, None] * s_db_l + g * s_db_g + offs_n[None, :] * s_db_n
        tl.store(dB_ptr + dB_at, acc.to(dB_ptr.dtype.element_ty), mask=mask_mn)
