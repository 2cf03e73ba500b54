"""The backward's chain: dS_in's chunk parts and the recurrence of the states' gradient between chunks in one
kernel, chained from the last chunk to the first (chained_states.py has the forward, the chain's machinery both
directions share, and why the chunk-own parts never reach memory):

    dH_c (dH_{NC-1}: dfinal)      dH_{c-1} = dS_in[c] + decay_c dH_c      dtot_c = decay_c <dH_c, S_in[c]>
    dinit = dH_{-1}

One program per (chunk, batch, head or pair of heads: config chained_bwd_heads; [P, N] tile), in the order of its
ticket (chunk-major from the last chunk), computes its chunk's dS_in part (chunk_state.chunk_local_dstates), waits
for dH_c from the program of the chunk after, stores it, adds dtot's partial sum and hands dH_{c-1} on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels.fast_launch import fast_launch
from models.kernels.pdl import pdl_prologue
from models.kernels.ssd_triton.chained_states import (
    chain_counters,
    chain_layout,
    end_chain,
    head_tiles,
    load_handoff,
    load_kept,
    release_chain,
    store_heads,
    store_kept,
    take_ticket,
    wait_chain,
)
from models.kernels.ssd_triton.chunk_state import chunk_local_dstates
from models.kernels.ssd_triton.config import BlockConfig
from models.kernels.ssd_triton.launch import dummy
from models.kernels.ssd_triton.state_passing import chunk_decay, entering_state32

__all__ = ["chained_dstates", "chained_dstates_bwd_kernel"]


@fast_launch
@triton.jit
def chained_dstates_bwd_kernel(
    dy_ptr,
    C_ptr,
    dA_ptr,
    seq_ptr,
    S32_ptr,
    S_lo_ptr,
    dfinal_ptr,
    sync_ptr,
    carry_ptr,
    dH_ptr,
    dinit_ptr,
    dtot_ptr,
    L,
    Q,
    NC,
    H,
    G,
    P,
    N,
    BATCH,
    s_y_b,
    s_y_l,
    s_y_h,
    s_y_p,
    s_c_b,
    s_c_l,
    s_c_g,
    s_c_n,
    HAS_SEQ: tl.constexpr,
    HAS_DFINAL: tl.constexpr,
    SPLIT: tl.constexpr,
    CARRY_IS_DH: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    c, r, b, h0, pid_p, pid_n = take_ticket(sync_ptr, BATCH, NC, H, P, N, HEADS, BLOCK_P, BLOCK_N, True)
    g = h0 // (H // G)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    own0, own1 = chunk_local_dstates(
        dy_ptr, C_ptr, dA_ptr, seq_ptr, b, c, h0, g, offs_p, offs_n, L, Q, NC, H, P, N, s_y_b, s_y_l, s_y_h, s_y_p,
        s_c_b, s_c_l, s_c_g, s_c_n, HAS_SEQ, EVEN, PREC, HEADS, BLOCK_P, BLOCK_N, BLOCK_K,
    )  # fmt: skip

    PN = P * N
    tile = offs_p[:, None] * N + offs_n[None, :]
    mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    counter = sync_ptr + 1 + r
    if CARRY_IS_DH:
        _dh_chain_step(dfinal_ptr, dH_ptr, carry_ptr, dinit_ptr, dtot_ptr, S32_ptr, S_lo_ptr, dA_ptr, seq_ptr, counter,
                       own0, own1, b, h0, c, pid_p, pid_n, tile, mask, L, Q, NC, H, N, PN, BATCH, HAS_DFINAL, HAS_SEQ,
                       SPLIT, HEADS, BLOCK_P, BLOCK_N)  # fmt: skip
    else:  # (not a return above: Triton would compile what follows it too, with carry_ptr 16-bit there)
        # dH_c, the gradient of the state leaving chunk c, in float32.
        if c == NC - 1:
            d0, d1 = head_tiles(dfinal_ptr, b, h0, tile, mask, PN, H, HAS_DFINAL, HEADS, BLOCK_P, BLOCK_N)
        else:
            wait_chain(counter, NC - 1 - c)
            slot = carry_ptr + ((b.to(tl.int64) * 2 + c % 2) * H + h0) * PN + tile
            d0, d1 = load_handoff(slot, PN, mask, HEADS)
        at_c = ((b.to(tl.int64) * NC + c) * H + h0) * PN + tile
        store_heads(dH_ptr + at_c, d0, d1, PN, mask, HEADS)

        # dtot's partial sums, then dH_{c-1} handed on (or dinit).
        d0, d1 = _dtot_and_step(dtot_ptr, S32_ptr, S_lo_ptr, dA_ptr, seq_ptr, d0, d1, own0, own1, b, h0, c,
                                pid_p, pid_n, at_c, mask, L, Q, NC, H, N, PN, BATCH, HAS_SEQ, SPLIT, HEADS,
                                BLOCK_N)  # fmt: skip
        if c > 0:
            prv = carry_ptr + ((b.to(tl.int64) * 2 + (c - 1) % 2) * H + h0) * PN + tile
            store_heads(prv, d0, d1, PN, mask, HEADS)
            release_chain(counter)
        else:
            fin = dinit_ptr + (b.to(tl.int64) * H + h0) * PN + tile
            store_heads(fin, d0, d1, PN, mask, HEADS)
            end_chain(counter)


@triton.jit
def _dtot_and_step(dtot_ptr, S32_ptr, S_lo_ptr, dA_ptr, seq_ptr, d0, d1, own0, own1, b, h0, c, pid_p, pid_n, at_c, mask,
                   L, Q, NC, H, N, PN, BATCH, HAS_SEQ: tl.constexpr, SPLIT: tl.constexpr, HEADS: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """Given dH_c (d0, d1): dtot's partial sums, [n_p * n_n, BATCH, H, NC] (summed by dt_bwd_kernel), stored, and
    dH_{c-1} = own + decay_c dH_c returned."""
    dtot = dtot_ptr + ((((pid_p * tl.cdiv(N, BLOCK_N) + pid_n).to(tl.int64) * BATCH + b) * H + h0) * NC + c)
    decay0 = chunk_decay(dA_ptr, seq_ptr, b, h0, c, L, Q, NC, H, HAS_SEQ)
    s0 = entering_state32(S32_ptr, S_lo_ptr, at_c, mask, SPLIT)
    tl.store(dtot, decay0 * tl.sum(tl.sum(d0 * s0, axis=1), axis=0))
    d0 = own0 + decay0 * d0
    if HEADS == 2:
        decay1 = chunk_decay(dA_ptr, seq_ptr, b, h0 + 1, c, L, Q, NC, H, HAS_SEQ)
        s1 = entering_state32(S32_ptr, S_lo_ptr, at_c + PN, mask, SPLIT)
        tl.store(dtot + NC, decay1 * tl.sum(tl.sum(d1 * s1, axis=1), axis=0))
        d1 = own1 + decay1 * d1
    return d0, d1


@triton.jit
def _dh_chain_step(dfinal_ptr, hi_ptr, lo_ptr, dinit_ptr, dtot_ptr, S32_ptr, S_lo_ptr, dA_ptr, seq_ptr, counter, own0,
                   own1, b, h0, c, pid_p, pid_n, tile, mask, L, Q, NC, H, N, PN, BATCH, HAS_DFINAL: tl.constexpr,
                   HAS_SEQ: tl.constexpr, SPLIT: tl.constexpr, HEADS: tl.constexpr, BLOCK_P: tl.constexpr,
                   BLOCK_N: tl.constexpr):  # fmt: skip
    """The backward's chain step with 16-bit dy (CARRY_IS_DH): dH_{c-1} is handed on as its stored high part (dH,
    what dx and dB read) and a low part (lo_ptr, a buffer of the launch's own), instead of a float32 ring beside dH:
    4 instead of 6 bytes written per element. The chain then carries ~16 bits (the forward's kept chain says why
    that is below the other roundings); dinit is the float32 sum."""
    at_c = ((b.to(tl.int64) * NC + c) * H + h0) * PN + tile
    if c == NC - 1:
        d0, d1 = head_tiles(dfinal_ptr, b, h0, tile, mask, PN, H, HAS_DFINAL, HEADS, BLOCK_P, BLOCK_N)
        d0, d1 = store_kept(hi_ptr + at_c, lo_ptr + at_c, d0, d1, PN, mask, HEADS)
    else:
        wait_chain(counter, NC - 1 - c)
        d0 = load_kept(hi_ptr + at_c, lo_ptr + at_c, mask)
        d1 = d0
        if HEADS == 2:
            d1 = load_kept(hi_ptr + at_c + PN, lo_ptr + at_c + PN, mask)
    d0, d1 = _dtot_and_step(dtot_ptr, S32_ptr, S_lo_ptr, dA_ptr, seq_ptr, d0, d1, own0, own1, b, h0, c, pid_p, pid_n,
                            at_c, mask, L, Q, NC, H, N, PN, BATCH, HAS_SEQ, SPLIT, HEADS, BLOCK_N)  # fmt: skip
    if c > 0:
        store_kept(hi_ptr + at_c - H * PN, lo_ptr + at_c - H * PN, d0, d1, PN, mask, HEADS)
        release_chain(counter)
    else:
        store_heads(dinit_ptr + (b.to(tl.int64) * H + h0) * PN + tile, d0, d1, PN, mask, HEADS)
        end_chain(counter)


def chained_dstates(dy, dfinal, dA_cs, C, seq, S_in32, cfg: BlockConfig, S_lo=None):
    """staged_dstates' contract in one kernel: dH (dy's dtype), dinit (float32), dtot partial sums
    [n_tiles, b, H, NC]. S_lo: the low part of kept states (S_in32 then their high part), else None."""
    b, L, H, P = dy.shape
    G, N = C.shape[2:]
    NC, Q = dA_cs.shape[2:]
    dev = dy.device
    n_tiles, per_row, meta = chain_layout(cfg, dy, L, Q, H, G, P, N, cfg.chained_bwd_n, cfg.chained_bwd_heads)
    n_chains = b * per_row
    dH = torch.empty(b, NC, H, P, N, device=dev, dtype=dy.dtype)
    dinit = torch.empty(b, H, P, N, device=dev, dtype=torch.float32)
    dtot = torch.empty(n_tiles, b, H, NC, device=dev, dtype=torch.float32)
    # 16-bit dy: dH's low parts carry the chain with dH itself (_dh_chain_step); float32 dy: a float32 ring.
    carry_is_dh = dy.dtype != torch.float32
    carry = torch.empty_like(dH) if carry_is_dh else torch.empty(b, 2, H, P, N, device=dev, dtype=torch.float32)
    chained_dstates_bwd_kernel[(NC * n_chains,)](
        dy,
        C,
        dA_cs,
        seq if seq is not None else dummy(dev),
        S_in32,
        S_lo if S_lo is not None else dummy(dev),
        dfinal if dfinal is not None else dummy(dev),
        chain_counters(n_chains, dev, "chained_dstates_bwd"),
        carry,
        dH,
        dinit,
        dtot,
        L,
        Q,
        NC,
        H,
        G,
        P,
        N,
        b,
        *dy.stride(),
        *C.stride(),
        HAS_SEQ=seq is not None,
        HAS_DFINAL=dfinal is not None,
        SPLIT=S_lo is not None,
        CARRY_IS_DH=carry_is_dh,
        maxnreg=cfg.chained_bwd_maxnreg,
        **meta,
    )
    return dH, dinit, dtot
