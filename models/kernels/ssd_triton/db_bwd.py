"""dB's chunk-state term, summed over the heads of a group:
    dB_s += sum_h [seq_s == seq_last] exp(a_last - a_s) dt_s x_s dH^h          (dH^h: the chunk end state's gradient)
One program per (batch, chunk, group, block of heads, block of positions s) loops over its heads and writes one
partial sum per head block (float32 [num_head_blocks, B, L, G, N]), which bc_finish.py adds with dB's intra-chunk
part dCBᵀ C. All of P and N are held per program. (The per-head dC / dB kernels that multiplied each head's dCB by
B and C in-kernel, config bc_mode "per_head", were removed in session 45: dcb_bwd.py's grouped sums beat them,
config.py's block_config.)
"""

import triton
import triton.language as tl

from models.kernels.fast_launch import fast_launch
from models.kernels.pdl import pdl_prologue
from models.kernels.ssd_triton.chunk_cb import LOG2E
from models.kernels.ssd_triton.launch import program_ids


@fast_launch
@triton.jit
def chunk_state_bwd_db_kernel(
    x_ptr,
    dt_ptr,
    dA_ptr,
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
    HAS_SEQ: tl.constexpr,
    PREC: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INNER_FIRST: tl.constexpr,
    FOLD_DT: tl.constexpr,
    PDL: tl.constexpr = False,  # dt_ptr holds a2dt (dt.py; config fold_dt_states): the scale is one 2^(a_last - a2dt_s)
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
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
        dB_acc += tl.dot(x_k, dH.to(x_k.dtype), input_precision=PREC) * scale_k[:, None]
    out = dB_ptr + ((hb.to(tl.int64) * BATCH + b) * L + t_k[:, None]) * G * N + g * N + offs_n[None, :]
    tl.store(out, dB_acc, mask=valid_k[:, None] & mask_n[None, :])
