"""The decay's column factors for the intra-chunk weights off the diagonal (config factored_decay).

The chunk scan and dx weigh every pair (l, s) of a chunk, s <= l, by exp(a_l - a_s) (a: the decay's cumulative sum
within the chunk, which falls along it). Where a whole block of pairs lies on both sides of one position r (s <= r
<= l), the weight splits into two factors that are both <= 1,

    exp(a_l - a_s) = exp(a_l - a_r) exp(a_r - a_s),

so the block's weights are CB times a row vector times a column vector, and one of the two can scale the
accumulator once instead of every element. The loops then multiply each element of CB by a column factor read from
memory, where they took a subtract, a clamp, an exp2 (MUFU) and a multiply (sm_90, Triton 3.6, the chunk scan's loop:
279 -> 182 instructions for two heads: docs/performance.md, session 71). Read from memory, not computed in the loop:
an exp2 of a per-column vector inside the loop makes Triton 3.6 build the weights in a blocked layout and move them
through shared memory to the product's (235 instructions). The diagonal blocks, where no such r exists, keep the
per-element weights.

    rows (the chunk scan): r_j = j * block, the first row of row block j, and for every column s
        V[b, h, c, j, s] = exp(a_{r_j} - a_s) dt_s        (2^(a_{r_j} log2(e) - a2dt_s) with fold_dt; used for s < r_j)
    columns (dx): r_j = min((j + 1) * block, Q) - 1, the last column of column block j, and for every row l
        V[b, h, c, j, l] = exp(a_l - a_{r_j})              (used for l > r_j)

Both are float32, [b, H, NC, cdiv(Q, block), Q]. Each exponent is clamped where the kernels clamp it (at 0, or at
chunk_scan's FOLD_MAX_EXP with fold_dt), so values on the side a kernel does not read stay finite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels.fast_launch import cdiv, fast_launch, next_power_of_2
from models.kernels.pdl import pdl_prologue
from models.kernels.ssd_triton.chunk_cb import LOG2E
from models.kernels.ssd_triton.chunk_scan import FOLD_MAX_EXP


@fast_launch
@triton.jit
def decay_factors_kernel(
    dA_ptr,
    dt_ptr,
    out_ptr,
    Q,
    N_REF: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    ROWS: tl.constexpr,
    FOLD_DT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    head_c = tl.program_id(0)  # (b, h, c) of dA's [b, H, NC, Q]: all of its reference blocks
    offs = tl.arange(0, BLOCK_Q)
    in_q = offs < Q
    base = head_c.to(tl.int64) * Q
    a2 = tl.load(dA_ptr + base + offs, mask=in_q, other=0.0) * LOG2E
    if ROWS:
        if FOLD_DT:  # dt_ptr holds a2dt (dt.py): +inf where dt is 0, so the factor is 0 there
            a2dt = tl.load(dt_ptr + base + offs, mask=in_q, other=float("inf"))
        else:
            dt = tl.load(dt_ptr + base + offs, mask=in_q, other=0.0)
    for j in tl.static_range(N_REF):
        if ROWS:
            a2_ref = tl.load(dA_ptr + base + j * BLOCK) * LOG2E
            if FOLD_DT:
                v = tl.exp2(tl.minimum(a2_ref - a2dt, FOLD_MAX_EXP))
            else:
                v = tl.exp2(tl.minimum(a2_ref - a2, 0.0)) * dt
        else:
            a2_ref = tl.load(dA_ptr + base + tl.minimum((j + 1) * BLOCK, Q) - 1) * LOG2E
            v = tl.exp2(tl.minimum(a2 - a2_ref, 0.0))
        tl.store(out_ptr + (head_c.to(tl.int64) * N_REF + j) * Q + offs, v, mask=in_q)


def decay_factors(dA_cs: torch.Tensor, dt: torch.Tensor, block: int, rows: bool, fold_dt: bool) -> torch.Tensor:
    """V [b, H, NC, cdiv(Q, block), Q] (module docstring): rows (the chunk scan's, dt: a2dt with fold_dt, else
    dt_p) or columns (dx's; dt unused)."""
    b, H, NC, Q = dA_cs.shape
    n_ref = cdiv(Q, block)
    out = torch.empty(b, H, NC, n_ref, Q, device=dA_cs.device, dtype=torch.float32)
    decay_factors_kernel[(b * H * NC,)](
        dA_cs,
        dt,
        out,
        Q,
        N_REF=n_ref,
        BLOCK=block,
        BLOCK_Q=max(16, next_power_of_2(Q)),
        ROWS=rows,
        FOLD_DT=fold_dt,
        num_warps=4,
    )
    return out
