"""dt's preprocessing and its gradient, one kernel each way (the glue that was a dozen small PyTorch ops).

Forward, per (batch, chunk, block of heads):
    u = dt + dt_bias;  v = softplus(u) (u > 20: u, as F.softplus);  dt_p = clamp(v, lo, hi);  0 past the end
    dA_cs = cumsum over the chunk of dt_p * A                        ([b, H, NC, Q], float32, chunk-padded)
    a2dt = dA_cs log2(e) - log2(dt_p)   (+inf where dt_p = 0)        (only with config fold_dt, same shape)
a2dt folds dt into the decay's exponent: the intra-chunk weight exp(a_l - a_s) dt_s of the chunk scan and of dCB is
2^(a_l log2(e) - a2dt_s), one MUFU.EX2 without the multiply by dt_s per element (config.py's fold_dt).
Backward, from the chunked SSD's gradients (autograd.py): the gradient of dA_cs's pre-cumsum input
    g_t = sum_{j >= t} REV_j + sum_{s < t} q_s + sum_blocks dtot_c
(REV: the per-position terms whose reverse cumsum enters, from dcb_bwd.py as partial sums in slots, added here; q
from chunk_scan_bwd.py; dtot from the recurrence between chunks), then
d(dt_p) = ddt + g A, dA_h = sum g dt_p, and back through the clamp (no gradient where it clamps, as torch.clamp)
and softplus (sigmoid(u)) to d(dt) in dt's dtype and d(dt_bias). dA and
d(dt_bias) come out as partial sums per (batch, chunk) program, [b * NC, H] each, which the last program of each
block of heads to finish sums (an atomic counter per block says which is last; before, two PyTorch reductions with
dD's took 0.013 ms per layer, H100, docs/ssd_sessions.md session 16). The programs of chunk 0 also sum dD's partial
sums over the dx kernel's blocks (D of [H]; that kernel ran before this one).
A comes as is, or (a_is_log: the model's mixer) as its parameter A_log: both kernels take A = -exp(A_log) and the
backward returns A_log's gradient, dA times A, so no PyTorch op runs for A either way (four tiny kernels per layer
and step before, session 44).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from models.kernels.fast_launch import cdiv, fast_launch, next_power_of_2
from models.kernels.pdl import pdl_prologue
from models.kernels.ssd_triton.chunk_cb import LOG2E
from models.kernels.ssd_triton.launch import zeroed_counters


@triton.jit
def _log1p(x):
    # log(1 + x) accurate for small x (Goldberg): the rounding of 1 + x cancels in x / (w - 1).
    w = 1.0 + x
    return tl.where(w == 1.0, x, tl.log(w) * x / (w - 1.0))


@triton.jit
def _dt_pre_clamp(dt_ptr, bias_ptr, b, t, offs_h, valid, H, s_dt_b, s_dt_l, s_dt_h, HAS_BIAS, SOFTPLUS):
    """u (dt + bias) and v (softplus(u) or u), float32 [BLOCK_Q, BLOCK_H]."""
    u = tl.load(
        dt_ptr + b.to(tl.int64) * s_dt_b + t.to(tl.int64)[:, None] * s_dt_l + offs_h[None, :] * s_dt_h,
        mask=valid,
        other=0.0,
    ).to(tl.float32)
    if HAS_BIAS:
        u += tl.load(bias_ptr + offs_h, mask=offs_h < H, other=0.0).to(tl.float32)[None, :]
    v = u
    if SOFTPLUS:
        v = tl.where(u > 20.0, u, tl.maximum(u, 0.0) + _log1p(tl.exp(-tl.abs(u))))
    return u, v


@triton.jit
def _load_A(A_ptr, offs_h, mask_h, A_LOG: tl.constexpr):
    """A [BLOCK_H] in float32: as stored, or with A_LOG -exp(A_log) from the model's parameter (no PyTorch ops
    for it, either way)."""
    A = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0)
    if A_LOG:
        A = -tl.exp(A)
    return A


@fast_launch
@triton.jit
def dt_fwd_kernel(
    dt_ptr,
    bias_ptr,
    A_ptr,
    dt_p_ptr,
    dA_cs_ptr,
    a2dt_ptr,
    L,
    Q,
    NC,
    H,
    s_dt_b,
    s_dt_l,
    s_dt_h,
    lo,
    hi,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    FOLD_DT: tl.constexpr,
    A_LOG: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    pid_bc = tl.program_id(0)
    c = pid_bc % NC
    b = pid_bc // NC
    offs_q = tl.arange(0, BLOCK_Q)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t = c * Q + offs_q
    in_q = (offs_q < Q)[:, None] & (offs_h < H)[None, :]
    valid = in_q & (t < L)[:, None]
    _, v = _dt_pre_clamp(dt_ptr, bias_ptr, b, t, offs_h, valid, H, s_dt_b, s_dt_l, s_dt_h, HAS_BIAS, SOFTPLUS)
    dt_p = tl.where(valid, tl.minimum(tl.maximum(v, lo), hi), 0.0)  # padded positions: dt = 0
    A = _load_A(A_ptr, offs_h, offs_h < H, A_LOG)
    dA_cs = tl.cumsum(dt_p * A[None, :], axis=0)
    out = ((b.to(tl.int64) * H + offs_h[None, :]) * NC + c) * Q + offs_q[:, None]  # [b, H, NC, Q]
    tl.store(dt_p_ptr + out, dt_p, mask=in_q)
    tl.store(dA_cs_ptr + out, dA_cs, mask=in_q)
    if FOLD_DT:
        # +inf where dt_p = 0 (padding, or dt clamped or rounded to 0): the weight is then 2^-inf = 0, as dt_s = 0
        # makes it. log2 takes dt_p floored at float32's smallest normal, so that no log2(0) is evaluated (the
        # interpreter's numpy warns) and every normal dt_p is taken as it is.
        log2_dt = tl.log2(tl.maximum(dt_p, 1.1754943508222875e-38))
        tl.store(a2dt_ptr + out, tl.where(dt_p > 0.0, dA_cs * LOG2E - log2_dt, float("inf")), mask=in_q)


class ColumnParts(NamedTuple):
    """dCB's extra column-sum slots (dcb_bwd.py, config dcb_col_parts), which dt_bwd_kernel adds to R's."""

    slots: torch.Tensor  # [n, b, H, NC, Q] float32: those of the tiles below the diagonal first, the diagonal's last
    per_block: int  # slots per row block below the diagonal (parts - 1): slot i belongs to row block 1 + i // this
    block: int  # rows per block (dc_m): slot i holds values at the positions of the blocks before its own
    n_diag: int  # the diagonal tiles' slots (config dcb_diag_col_parts), written at every position


@fast_launch
@triton.jit
def dt_bwd_kernel(
    dt_ptr,
    bias_ptr,
    A_ptr,
    ddt_p_ptr,
    rev_ptr,
    rev_parts_ptr,
    col_extra_ptr,
    q_ptr,
    dtot_ptr,
    ddt_ptr,
    dA_part_ptr,
    dbias_part_ptr,
    dD_part_ptr,
    done_ptr,
    dA_ptr,
    dbias_ptr,
    dD_ptr,
    L,
    Q,
    NC,
    H,
    BATCH,
    n_dtot,
    n_rev_parts,
    n_col_extra,
    n_col_diag,
    col_extra_per_block,
    col_block,
    n_dD_parts,
    s_dt_b,
    s_dt_l,
    s_dt_h,
    s_ddt_b,
    s_ddt_l,
    s_ddt_h,
    lo,
    hi,
    HAS_BIAS: tl.constexpr,
    HAS_DD: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    A_LOG: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    pid_bc = tl.program_id(0)
    c = pid_bc % NC
    b = pid_bc // NC
    offs_q = tl.arange(0, BLOCK_Q)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    if HAS_DD:
        if pid_bc == 0:  # dD [H]: the dx kernel's partial sums, [n_dD_parts, H]
            tl.store(dD_ptr + offs_h, _sum_rows(dD_part_ptr, n_dD_parts, H, offs_h, mask_h, BLOCK_R), mask=mask_h)
    t = c * Q + offs_q
    in_q = (offs_q < Q)[:, None] & mask_h[None, :]
    valid = in_q & (t < L)[:, None]
    at = ((b.to(tl.int64) * H + offs_h[None, :]) * NC + c) * Q + offs_q[:, None]  # [b, H, NC, Q]

    # g: the gradient of dt_p * A at each position (module docstring).
    # REV comes as [n, b, H, NC, Q] partial sums (dCB's slots), added here.
    slot = tl.cast(BATCH, tl.int64) * H * NC * Q
    rev = tl.load(rev_ptr + at, mask=in_q, other=0.0)
    for i in range(n_rev_parts):
        rev += tl.load(rev_parts_ptr + i * slot + at, mask=in_q, other=0.0)
    # dCB's extra column-sum slots (config dcb_col_parts): the i-th holds a partial sum from the tiles of row block
    # 1 + i // col_extra_per_block, written (and read) only at the positions of the blocks before it.
    for i in range(n_col_extra):
        before = (offs_q // col_block < 1 + i // col_extra_per_block)[:, None]
        rev += tl.load(col_extra_ptr + i * slot + at, mask=in_q & before, other=0.0)
    for i in range(n_col_diag):  # the diagonal tiles' parts (config dcb_diag_col_parts), written at every position
        rev += tl.load(col_extra_ptr + (n_col_extra + i) * slot + at, mask=in_q, other=0.0)
    g = tl.cumsum(rev, axis=0, reverse=True)
    q = tl.load(q_ptr + at, mask=in_q, other=0.0)
    g += tl.cumsum(q, axis=0) - q
    dtot = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for i in range(n_dtot):  # partial sums per state-passing block: [n_dtot, b, H, NC]
        dtot += tl.load(dtot_ptr + ((i * BATCH + b.to(tl.int64)) * H + offs_h) * NC + c, mask=mask_h, other=0.0)
    g += dtot[None, :]

    u, v = _dt_pre_clamp(dt_ptr, bias_ptr, b, t, offs_h, valid, H, s_dt_b, s_dt_l, s_dt_h, HAS_BIAS, SOFTPLUS)
    dt_p = tl.where(valid, tl.minimum(tl.maximum(v, lo), hi), 0.0)
    A = _load_A(A_ptr, offs_h, mask_h, A_LOG)
    d_dt_p = tl.load(ddt_p_ptr + at, mask=in_q, other=0.0) + g * A[None, :]
    d_u = tl.where(valid & (v >= lo) & (v <= hi), d_dt_p, 0.0)
    if SOFTPLUS:
        d_u = tl.where(u > 20.0, d_u, d_u / (1.0 + tl.exp(-u)))
    tl.store(
        ddt_ptr + b.to(tl.int64) * s_ddt_b + t.to(tl.int64)[:, None] * s_ddt_l + offs_h[None, :] * s_ddt_h,
        d_u.to(ddt_ptr.dtype.element_ty),
        mask=valid,
    )
    part = pid_bc.to(tl.int64) * H + offs_h  # [b * NC, H]
    tl.store(dA_part_ptr + part, tl.sum(tl.where(valid, g * dt_p, 0.0), axis=0), mask=mask_h)
    if HAS_BIAS:
        tl.store(dbias_part_ptr + part, tl.sum(d_u, axis=0), mask=mask_h)
    # The last program of this block of heads sums every program's partials: all threads' stores first, then one
    # increment (acq_rel: the last one sees the others' stores, read past L1).
    tl.debug_barrier()
    n_parts = tl.num_programs(0)
    if tl.atomic_add(done_ptr + tl.program_id(1), 1, sem="acq_rel") == n_parts - 1:
        tl.atomic_xchg(done_ptr + tl.program_id(1), 0, sem="relaxed")  # zero for the next launch (every program is in)
        dA = _sum_rows(dA_part_ptr, n_parts, H, offs_h, mask_h, BLOCK_R)
        if A_LOG:
            dA = dA * A  # d/dA_log of -exp(A_log) is A itself
        tl.store(dA_ptr + offs_h, dA, mask=mask_h)
        if HAS_BIAS:
            tl.store(dbias_ptr + offs_h, _sum_rows(dbias_part_ptr, n_parts, H, offs_h, mask_h, BLOCK_R), mask=mask_h)


@triton.jit
def _sum_rows(ptr, n_rows, H, offs_h, mask_h, BLOCK_R: tl.constexpr):
    """sum_i ptr[i, offs_h] over the n_rows rows of a [n_rows, H] float32 array, read past L1."""
    acc = tl.zeros((BLOCK_R, offs_h.shape[0]), dtype=tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        at = rows.to(tl.int64)[:, None] * H + offs_h[None, :]
        acc += tl.load(ptr + at, mask=(rows < n_rows)[:, None] & mask_h[None, :], other=0.0, cache_modifier=".cg")
    return tl.sum(acc, axis=0)


# Elements ([chunk positions, heads]) per program of the dt kernels. The backward reads ~20 float32 slots per element
# in a loop of dependent loads, so more, smaller programs keep more loads in flight: H200, 1.3B with documents
# (bench_ssd.py's inputs, profiler, session 54): dt_bwd_kernel 38.0-38.3 us at 4096 elements (256 programs), 29.4 at
# 2048, 29.9 at 1024.
_ELEMENTS_PER_PROGRAM = 2048


def _tiles(Q: int, H: int) -> tuple[int, int]:
    block_q = next_power_of_2(Q)
    return block_q, min(next_power_of_2(H), max(1, _ELEMENTS_PER_PROGRAM // block_q))


def dt_forward(
    dt_BLH,
    dt_bias,
    A_H,
    Q: int,
    NC: int,
    softplus: bool,
    limit: tuple[float, float],
    fold_dt: bool = False,
    a_is_log: bool = False,
):
    """(dt_p, dA_cs, a2dt), float32 [b, H, NC, Q] each (dt_p zero past the end); a2dt (module docstring) only with
    fold_dt, else None. a_is_log: A_H holds A_log, and A = -exp(A_log) is taken in the kernel."""
    b, L, H = dt_BLH.shape
    dt_p = torch.empty(b, H, NC, Q, device=dt_BLH.device, dtype=torch.float32)
    dA_cs = torch.empty_like(dt_p)
    a2dt = torch.empty_like(dt_p) if fold_dt else None
    block_q, block_h = _tiles(Q, H)
    dt_fwd_kernel[(b * NC, cdiv(H, block_h))](
        dt_BLH,
        dt_bias if dt_bias is not None else dt_p,
        A_H,
        dt_p,
        dA_cs,
        a2dt if fold_dt else dt_p,
        L,
        Q,
        NC,
        H,
        *dt_BLH.stride(),
        float(limit[0]),
        float(limit[1]),
        HAS_BIAS=dt_bias is not None,
        SOFTPLUS=softplus,
        FOLD_DT=fold_dt,
        A_LOG=a_is_log,
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
    )
    return dt_p, dA_cs, a2dt


def dt_backward(
    dt_BLH,
    dt_bias,
    A_H,
    ddt_p,
    rev,
    rev_parts,
    q,
    dtot,
    col_extra: ColumnParts | None,
    softplus: bool,
    limit: tuple[float, float],
    dD_parts=None,
    ddt_out=None,
    a_is_log: bool = False,
):
    """(d dt [b, L, H] in dt's dtype (written into ddt_out when given: any strides, e.g. the mixer's view of its
    input gradient, so no copy follows), dA [H] and d dt_bias [H] in float32 or None, dD [H] or None) from the chunked
    SSD's ddt_p and the parts of the decay gradient (module docstring): rev [b, H, NC, Q], plus rev_parts, partial
    sums [n, b, H, NC, Q], summed in the kernel; col_extra: dCB's extra column-sum slots
    or None; dD_parts: D's partial sums [n, H] (float32) to sum, or None. a_is_log: A_H holds A_log (as in
    dt_forward), and the gradient returned for it is A_log's."""
    b, L, H = dt_BLH.shape
    NC, Q = ddt_p.shape[2:]
    dev = dt_BLH.device
    ddt = torch.empty(b, L, H, device=dev, dtype=dt_BLH.dtype) if ddt_out is None else ddt_out
    parts = torch.empty(2, b * NC, H, device=dev, dtype=torch.float32)  # dA, d dt_bias per program
    sums = torch.empty(3, H, device=dev, dtype=torch.float32)  # dA, d dt_bias, dD
    block_q, block_h = _tiles(Q, H)
    done = zeroed_counters(cdiv(H, block_h), dev, "dt_bwd")  # finished programs per head block, left zero
    dt_bwd_kernel[(b * NC, cdiv(H, block_h))](
        dt_BLH,
        dt_bias if dt_bias is not None else ddt_p,
        A_H,
        ddt_p,
        rev,
        rev_parts,
        rev if col_extra is None else col_extra.slots,
        q,
        dtot,
        ddt,
        parts[0],
        parts[1],
        parts if dD_parts is None else dD_parts,
        done,
        sums[0],
        sums[1],
        sums[2],
        L,
        Q,
        NC,
        H,
        b,
        dtot.shape[0],
        rev_parts.shape[0],
        0 if col_extra is None else col_extra.slots.shape[0] - col_extra.n_diag,
        0 if col_extra is None else col_extra.n_diag,
        1 if col_extra is None else max(col_extra.per_block, 1),
        Q if col_extra is None else col_extra.block,
        0 if dD_parts is None else dD_parts.shape[0],
        *dt_BLH.stride(),
        *ddt.stride(),
        float(limit[0]),
        float(limit[1]),
        HAS_BIAS=dt_bias is not None,
        HAS_DD=dD_parts is not None,
        SOFTPLUS=softplus,
        A_LOG=a_is_log,
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_R=32,
    )
    return ddt, sums[0], (sums[1] if dt_bias is not None else None), (sums[2] if dD_parts is not None else None)
