"""Launchers of the forward kernels: C·Bᵀ, and the states entering each chunk with or without the outputs.

Two paths compute the same function (config ``chained``):
  - chained (default): cb_fwd -> chained_states_fwd (the chunk states and the recurrence between chunks in one
    kernel, chained_states.py) -> chunk_scan_fwd;
  - staged: cb_fwd -> chunk_state_fwd -> state_passing_fwd -> chunk_scan_fwd, one kernel per stage with the
    [B, NC, H, P, N] chunk states and entering states in memory between them (mamba_ssm's structure).
The backward recomputes CB and the entering states S_in with ``cb_and_entering_states`` (nothing
[B, NC, H, P, N] is kept between forward and backward), or with config keep_states takes the forward's S_in (high
and low parts, state_passing.py) and recomputes CB only.
"""

from __future__ import annotations

import torch

from models.kernels.fast_launch import cdiv
from models.kernels.ssd_triton.chained_states import chained_states
from models.kernels.ssd_triton.chunk_cb import cb_fwd_kernel
from models.kernels.ssd_triton.chunk_scan import chunk_scan_fwd_kernel
from models.kernels.ssd_triton.chunk_state import chunk_state_fwd_kernel
from models.kernels.ssd_triton.config import BlockConfig, heads_per_program, whole_tiles
from models.kernels.ssd_triton.launch import dot_precision, dummy, grid
from models.kernels.ssd_triton.state_passing import kept_states_buffer, state_passing_fwd_kernel


def cb_read_block(cfg: BlockConfig) -> int:
    """The widest block of rows in which a consumer of CB (or CBᵀ) reads columns up to the block's end: entries
    (l, s) with s >= (l // it + 1) * it are never read (chunk_cb.py). Every block size is a power of two."""
    return max(cfg.scan_m, cfg.scan_k, cfg.dx_k, cfg.dx_m, cfg.dc_m)


def chunk_cb(x, B, C, seq, Q: int, NC: int, cfg: BlockConfig, transposed: bool = False):
    """CB [b, NC, G, Q, Q] float32: C_l · B_s within each chunk for s <= l, 0 above the diagonal and across
    documents; with ``transposed``, (CB, CBᵀ) (the backward's dx kernel reads CBᵀ)."""
    b, L = x.shape[:2]
    G, N = B.shape[2:]
    CB = torch.empty(b, NC, G, Q, Q, device=x.device, dtype=torch.float32)
    CBT = torch.empty_like(CB) if transposed else None
    grid = (b * NC * G, cdiv(Q, cfg.cb_m), cdiv(Q, cfg.cb_s))
    cb_fwd_kernel[grid](
        C,
        B,
        CB,
        CBT if transposed else dummy(x.device),
        seq if seq is not None else dummy(x.device),
        L,
        Q,
        NC,
        G,
        N,
        *C.stride(),
        *B.stride(),
        HAS_SEQ=seq is not None,
        WRITE_T=transposed,
        READ_BLOCK=cb_read_block(cfg),
        BLOCK_M=cfg.cb_m,
        BLOCK_S=cfg.cb_s,
        BLOCK_N=cfg.cb_n,
        PREC=dot_precision(x),
        num_warps=cfg.cb_warps,
        num_stages=cfg.cb_stages,
    )
    return (CB, CBT) if transposed else CB


def cb_for_backward(x, B, C, seq, Q: int, NC: int, cfg: BlockConfig):
    """(CB, CBᵀ) for the backward's kernels (dx reads CBᵀ, chunk_cb.py says why)."""
    return chunk_cb(x, B, C, seq, Q, NC, cfg, transposed=True)


def _staged_states(x, dt_p, dA_cs, B, seq, init, cfg: BlockConfig, keep_s32: bool = False, keep_split: bool = False,
                   a2dt=None):  # fmt: skip
    """Chunk states (float32) -> S_in (x's dtype) and final (float32), one kernel each; with keep_s32 also S_in in
    float32 (state_passing.py says why the backward wants it), with keep_split the kept states (kept_states_buffer:
    S_in is its first slab), else None. a2dt (config fold_dt_states): the states' scale with dt in its exponent."""
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    NC, Q = dt_p.shape[2:]
    dev = x.device
    has_seq = seq is not None
    seq_arg = seq if has_seq else dummy(dev)
    states = torch.empty(b, NC, H, P, N, device=dev, dtype=torch.float32)
    heads = heads_per_program(H // G, min(cfg.state_heads, 2))
    grid = (b * NC * H // heads, cdiv(P, cfg.state_p), cdiv(N, cfg.state_n))
    chunk_state_fwd_kernel[grid](
        x,
        B,
        dt_p if a2dt is None else a2dt,
        dA_cs,
        seq_arg,
        states,
        L,
        Q,
        NC,
        H,
        G,
        P,
        N,
        *x.stride(),
        *B.stride(),
        HAS_SEQ=has_seq,
        EVEN=whole_tiles(L, Q, P, cfg.state_p, cfg.state_k) and N % cfg.state_n == 0,
        HEADS=heads,
        BLOCK_P=cfg.state_p,
        BLOCK_N=cfg.state_n,
        BLOCK_K=cfg.state_k,
        FOLD_DT=a2dt is not None,
        PREC=dot_precision(x),
        num_warps=cfg.state_warps,
        num_stages=cfg.state_stages,
    )
    kept = kept_states_buffer(x, NC, H, P, N) if keep_split else None
    S_in = torch.empty_like(states, dtype=x.dtype) if kept is None else kept[0]
    store_lo = kept is not None and kept.shape[0] == 2
    S_in32 = torch.empty_like(states) if keep_s32 else None
    final = torch.empty(b, H, P, N, device=dev, dtype=torch.float32)
    PN = P * N
    state_passing_fwd_kernel[(b * H, cdiv(PN, cfg.pass_block))](
        states,
        dA_cs,
        seq_arg,
        init if init is not None else dummy(dev),
        S_in,
        S_in32 if keep_s32 else kept[1] if store_lo else dummy(dev),
        final,
        L,
        Q,
        NC,
        H,
        PN,
        HAS_SEQ=has_seq,
        HAS_INIT=init is not None,
        KEEP_S32=keep_s32,
        STORE_LO=store_lo,
        BLOCK=cfg.pass_block,
        num_warps=4,
    )
    return S_in, final, S_in32 if keep_s32 else kept


def _staged_scan(x, dt_p, dA_cs, C, D, seq, CB, S_in, cfg: BlockConfig, y_dtype=None, a2dt=None, gate=None):
    """y from the chunk scan kernel; with a2dt (dt.py, config fold_dt) its weights take dt in their exponent. With
    gate = (z [b, L, H * P] (last dim contiguous), the gated norm's weight [H * P], fast sigmoid): (y, g, ss), g =
    y silu(z) w [b, L, H * P] in y's dtype and ss [b * L, J] float32, the rows' sums of (y silu(z))^2 in J parts
    (chunk_scan.gate_store): the gated RMSNorm without its division by the rows' rms."""
    b, L, H, P = x.shape
    G, N = C.shape[2:]
    NC, Q = dt_p.shape[2:]
    y = torch.empty_like(x, dtype=y_dtype, memory_format=torch.contiguous_format)
    heads = heads_per_program(H // G, min(cfg.scan_heads, 2))
    if gate is not None:
        z, w_norm, fast = gate
        J = H // heads * cdiv(P, cfg.scan_p)
        g = torch.empty(b, L, H * P, device=x.device, dtype=y.dtype)
        ss = torch.empty(b * L, J, device=x.device, dtype=torch.float32)
        gate_args = (z, w_norm, g, ss, z.stride(0), z.stride(1), J)
    else:
        gate_args = (dummy(x.device),) * 4 + (0, 0, 1)
    chunk_scan_fwd_kernel[grid(b * NC * H // heads, cdiv(Q, cfg.scan_m), cdiv(P, cfg.scan_p), cfg.inner_first)](
        CB,
        x,
        dt_p if a2dt is None else a2dt,
        dA_cs,
        C,
        S_in,
        D if D is not None else dummy(x.device),
        seq if seq is not None else dummy(x.device),
        y,
        L,
        Q,
        NC,
        H,
        G,
        P,
        N,
        *x.stride(),
        *C.stride(),
        *y.stride(),
        *gate_args,
        HAS_SEQ=seq is not None,
        HAS_D=D is not None,
        D_HAS_HDIM=D is not None and D.dim() == 2,
        EVEN=whole_tiles(L, Q, P, cfg.scan_p, cfg.scan_m, cfg.scan_k),
        HEADS=heads,
        FOLD_DT=a2dt is not None,
        BLOCK_M=cfg.scan_m,
        BLOCK_K=cfg.scan_k,
        BLOCK_P=cfg.scan_p,
        BLOCK_N=cfg.scan_n,
        INNER_FIRST=cfg.inner_first,
        PREC=dot_precision(x),
        num_warps=cfg.scan_warps,
        num_stages=cfg.scan_stages,
        maxnreg=cfg.scan_maxnreg,
        GATE=gate is not None,
        FAST=gate is not None and gate[2],
    )
    return y if gate is None else (y, g, ss)


def states_a2dt(a2dt, cfg: BlockConfig):
    """What the chunk states' kernels (and dB's) take for their scale: a2dt (dt.py) with config fold_dt_states, else
    None (they then read dt and a)."""
    return a2dt if cfg.fold_dt_states else None


def keeps_states(cfg: BlockConfig) -> bool:
    """Whether the forward hands the entering states to the backward (config keep_states)."""
    return cfg.keep_states


def ssd_forward(x, dt_p, dA_cs, B, C, D, seq, init, cfg: BlockConfig, y_dtype=None, a2dt=None, gate=None):
    """y [b, L, H, P] (y_dtype, default x's), final states [b, H, P, N] (float32) and, when keeps_states(cfg), the
    entering states for the backward ([K, b, NC, H, P, N], state_passing.kept_states_buffer; else None). a2dt (dt.py,
    config fold_dt): the chunk scan kernel's weights with dt in their exponent, and with config fold_dt_states the
    chunk states' scale too."""
    NC, Q = dt_p.shape[2:]
    CB = chunk_cb(x, B, C, seq, Q, NC, cfg)
    states = chained_states if cfg.chained else _staged_states
    S_in, final, kept = states(x, dt_p, dA_cs, B, seq, init, cfg, keep_split=keeps_states(cfg),
                               a2dt=states_a2dt(a2dt, cfg))  # fmt: skip
    return _staged_scan(x, dt_p, dA_cs, C, D, seq, CB, S_in, cfg, y_dtype, a2dt, gate), final, kept


def cb_and_entering_states(x, dt_p, dA_cs, B, C, seq, init, cfg: BlockConfig, a2dt=None):
    """The backward's recompute: CB and CBᵀ [b, NC, G, Q, Q] (float32), S_in [b, NC, H, P, N] in x's dtype (for the
    products that round it to the operand dtype anyway) and in float32 (for the state passing backward's dtot,
    state_passing.py). a2dt: as ssd_forward's, so that the recomputed states are
    the forward's."""
    NC, Q = dt_p.shape[2:]
    CB, CBT = cb_for_backward(x, B, C, seq, Q, NC, cfg)
    states = chained_states if cfg.chained else _staged_states
    S_in, _, S_in32 = states(x, dt_p, dA_cs, B, seq, init, cfg, keep_s32=True, a2dt=states_a2dt(a2dt, cfg))
    return CB, CBT, S_in, S_in32
