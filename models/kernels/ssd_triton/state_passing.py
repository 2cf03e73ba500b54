"""The recurrence between chunks, forward and backward (carried in float32; S_in stored in x's dtype, the operand
precision its consumers' dot products use anyway, and in the backward's recompute also in float32: below).

Forward, per (batch, head) and a block of the flattened [P*N] state, sequentially over chunks c:
    S_in[c] = H_{c-1}                      (the state entering chunk c; H_{-1} = initial state, document 0)
    H_c     = decay_c * H_{c-1} + states[c],   decay_c = exp(a_last_c) * [seq_bound_c == seq_bound_{c-1}]
with seq_bound_c the document of chunk c's last token (seq_bound_{-1} = 0); final = H_{NC-1}.

Backward, in reverse, given dS_in (the gradient reaching each S_in directly) and dfinal:
    dH_c = dS_in[c+1] + decay_{c+1} * dH_{c+1}  (dH_{NC-1} = dfinal)  -> also the gradient of states[c]
    dtot_c = decay_c <dH_c, S_in[c]>      (through decay_c = exp(a_last_c) [...]; it reaches every dA_t of c)
    dinit = dS_in[0] + decay_0 * dH_0.
The two inner products are reduced per block and written as partial sums (summed on the host).

dtot needs S_in in float32: <dH_c, S_in[c]> sums P * N products of both signs and keeps their relative error, so
bf16-rounded states gave dA 30x mamba_ssm's error wherever the carried state weighs (initial states, a final-state
gradient; docs/ssd_sessions.md, session 8). The backward's recompute therefore also keeps S_in in float32
(KEEP_S32) in a buffer of its own. (Written over the chunk states it had just read instead, the forward and
recompute calls together took 0.460 ms at 1.3B against 0.172 with a separate float32 output: measured, session 8.)

Kept states (config keep_states): the forward hands S_in to the backward instead of the backward recomputing it,
as two slabs in x's dtype (kept_states_buffer): the high part S_in itself (what the chunk scan and dC read) and the
low part, S_in32 - high (exact in float32, rounded once). high + low carries about 16 of float32's 24 bits for
dtot (entering_state32), at the bytes of one float32 copy; a float32 copy alone made dC's state term read twice the
bytes (session 15, H100, 1.3B: dCB 0.435 -> 0.489 ms). With float32 x, one slab: S_in is exact.
"""

import torch
import triton
import triton.language as tl

from models.kernels.fast_launch import cdiv, fast_launch
from models.kernels.pdl import pdl_prologue
from models.kernels.ssd_triton.chunk_state import chunk_scan_bwd_dstates_kernel
from models.kernels.ssd_triton.config import BlockConfig, heads_per_program, whole_tiles
from models.kernels.ssd_triton.launch import dot_precision, dummy


@triton.jit
def chunk_decay(dA_ptr, seq_ptr, b, h, c, L, Q, NC, H, HAS_SEQ: tl.constexpr):
    """decay_c of head h: exp(a_last of chunk c), or 0 when chunk c ends in another document than chunk c - 1."""
    a_last = tl.load(dA_ptr + ((b.to(tl.int64) * H + h) * NC + c) * Q + Q - 1)
    decay = tl.exp(a_last)
    if HAS_SEQ:
        bound = tl.load(seq_ptr + b.to(tl.int64) * L + tl.minimum(c * Q + Q, L) - 1)
        prev = tl.load(seq_ptr + b.to(tl.int64) * L + tl.maximum(c * Q - 1, 0))
        prev = tl.where(c > 0, prev, 0)
        decay = tl.where(bound == prev, decay, 0.0)
    return decay


def kept_states_buffer(x, NC: int, H: int, P: int, N: int) -> torch.Tensor:
    """The forward's kept entering states, [K, B, NC, H, P, N] in x's dtype: K = 2 (high, low part) for 16-bit x,
    K = 1 (S_in itself) for float32 x."""
    K = 1 if x.dtype == torch.float32 else 2
    return torch.empty(K, x.shape[0], NC, H, P, N, device=x.device, dtype=x.dtype)


@triton.jit
def entering_state32(S32_ptr, S_lo_ptr, offs, mask, SPLIT: tl.constexpr):
    """S_in in float32 at offs: from S_in32, or (SPLIT) as kept high + low parts."""
    s = tl.load(S32_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if SPLIT:
        s += tl.load(S_lo_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return s


@fast_launch
@triton.jit
def state_passing_fwd_kernel(
    states_ptr,
    dA_ptr,
    seq_ptr,
    init_ptr,
    S_in_ptr,
    S32_ptr,
    final_ptr,
    L,
    Q,
    NC,
    H,
    PN,
    HAS_SEQ: tl.constexpr,
    HAS_INIT: tl.constexpr,
    KEEP_S32: tl.constexpr,
    STORE_LO: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    pid_bh = tl.program_id(0)
    pid_k = tl.program_id(1)
    h = pid_bh % H
    b = pid_bh // H
    offs = pid_k * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PN
    if HAS_INIT:
        state = tl.load(init_ptr + (b.to(tl.int64) * H + h) * PN + offs, mask=mask, other=0.0)
    else:
        state = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(NC):
        base = ((b.to(tl.int64) * NC + c) * H + h) * PN
        hi = state.to(S_in_ptr.dtype.element_ty)
        tl.store(S_in_ptr + base + offs, hi, mask=mask)
        if KEEP_S32:
            tl.store(S32_ptr + base + offs, state, mask=mask)
        if STORE_LO:  # S32_ptr: the kept states' low part
            tl.store(S32_ptr + base + offs, (state - hi.to(tl.float32)).to(S32_ptr.dtype.element_ty), mask=mask)
        new = tl.load(states_ptr + base + offs, mask=mask, other=0.0)
        decay = chunk_decay(dA_ptr, seq_ptr, b, h, c, L, Q, NC, H, HAS_SEQ)
        state = decay * state + new
    tl.store(final_ptr + (b.to(tl.int64) * H + h) * PN + offs, state, mask=mask)


@fast_launch
@triton.jit
def state_passing_bwd_kernel(
    dS_in_ptr,
    S_in_ptr,
    S_lo_ptr,
    dA_ptr,
    seq_ptr,
    dfinal_ptr,
    dH_ptr,
    dinit_ptr,
    dtot_ptr,
    L,
    Q,
    NC,
    H,
    PN,
    BATCH,
    HAS_SEQ: tl.constexpr,
    HAS_DFINAL: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    pid_bh = tl.program_id(0)
    pid_k = tl.program_id(1)
    h = pid_bh % H
    b = pid_bh // H
    offs = pid_k * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PN
    if HAS_DFINAL:
        dstate = tl.load(dfinal_ptr + (b.to(tl.int64) * H + h) * PN + offs, mask=mask, other=0.0)
    else:
        dstate = tl.zeros((BLOCK,), dtype=tl.float32)
    # dtot partial sums: [num_blocks, BATCH, H, NC]
    dtot_base = dtot_ptr + ((pid_k.to(tl.int64) * BATCH + b) * H + h) * NC
    for i in range(NC):
        c = NC - 1 - i
        base = ((b.to(tl.int64) * NC + c) * H + h) * PN
        tl.store(dH_ptr + base + offs, dstate.to(dH_ptr.dtype.element_ty), mask=mask)
        s_in = entering_state32(S_in_ptr, S_lo_ptr, base + offs, mask, SPLIT)
        decay = chunk_decay(dA_ptr, seq_ptr, b, h, c, L, Q, NC, H, HAS_SEQ)
        tl.store(dtot_base + c, decay * tl.sum(dstate * s_in, axis=0))
        dstate = tl.load(dS_in_ptr + base + offs, mask=mask, other=0.0) + decay * dstate
    tl.store(dinit_ptr + (b.to(tl.int64) * H + h) * PN + offs, dstate, mask=mask)


def staged_dstates(dy, dfinal, dA_cs, C, seq, S_in, cfg: BlockConfig, S_lo=None):
    """dS_in (y's state term) in one kernel, then the reverse recurrence in another: dH (dy's dtype), dinit
    (float32), dtot partial sums [n_blocks, b, H, NC]. S_in: float32, or the high part of kept states whose low
    part is S_lo."""
    b, L, H, P = dy.shape
    G, N = C.shape[2:]
    NC, Q = dA_cs.shape[2:]
    dev = dy.device
    has_seq = seq is not None
    seq_arg = seq if has_seq else dummy(dev)
    dS_in = torch.empty(b, NC, H, P, N, device=dev, dtype=torch.float32)
    heads = heads_per_program(H // G, min(cfg.state_heads, 2))
    grid = (b * NC * H // heads, cdiv(P, cfg.state_p), cdiv(N, cfg.state_n))
    chunk_scan_bwd_dstates_kernel[grid](
        dy,
        C,
        dA_cs,
        seq_arg,
        dS_in,
        L,
        Q,
        NC,
        H,
        G,
        P,
        N,
        *dy.stride(),
        *C.stride(),
        HAS_SEQ=has_seq,
        EVEN=whole_tiles(L, Q, P, cfg.state_p, cfg.state_k) and N % cfg.state_n == 0,
        HEADS=heads,
        BLOCK_P=cfg.state_p,
        BLOCK_N=cfg.state_n,
        BLOCK_K=cfg.state_k,
        PREC=dot_precision(dy),
        num_warps=cfg.state_warps,
        num_stages=cfg.state_stages,
    )
    PN = P * N
    n_blocks = cdiv(PN, cfg.pass_block)
    # dH in dy's dtype: its consumers (dx, dB) round it to that dtype for their products anyway, so storing it
    # rounded changes no result and halves its traffic (and spares them the conversion).
    dH = torch.empty_like(dS_in, dtype=dy.dtype)
    dinit = torch.empty(b, H, P, N, device=dev, dtype=torch.float32)
    dtot = torch.empty(n_blocks, b, H, NC, device=dev, dtype=torch.float32)
    state_passing_bwd_kernel[(b * H, n_blocks)](
        dS_in,
        S_in,
        S_lo if S_lo is not None else dummy(dev),
        dA_cs,
        seq_arg,
        dfinal if dfinal is not None else dummy(dev),
        dH,
        dinit,
        dtot,
        L,
        Q,
        NC,
        H,
        PN,
        b,
        HAS_SEQ=has_seq,
        HAS_DFINAL=dfinal is not None,
        SPLIT=S_lo is not None,
        BLOCK=cfg.pass_block,
        num_warps=4,
    )
    return dH, dinit, dtot
