"""The chained states and the chunk scan in one launch, their programs interleaved chunk by chunk (config chain_scan).

Why: the chained forward (chained_states.py) is latency-bound. About one chunk's programs fit on the GPU at a time
(512 at the 1.3B shape, four per SM); each computes its chunk's own state in a few microseconds and then waits for
the previous chunk's hand-off, so most of the kernel's ~177 us (H100, docs/performance.md session 51) is SMs
waiting. The chunk scan (chunk_scan.py, ~234 us) needs of the chain only the state entering its chunk. Here one grid
holds both kinds of program, so the scan's tiles run while the chain's programs wait.

Order. Programs take tickets (an atomic counter) and work on the item their ticket names, in rounds: round k holds
the chain's items of chunk k (if k < NC), then the scan's items of chunk k - LAG (if k >= LAG); a scan item first
waits until the chain counters of its heads say that S_in[c] is written, then runs chunk_scan.scan_program as the
chunk scan's own kernel does, so the outputs are bit for bit the two kernels'. Every wait is on items of earlier
rounds (smaller tickets), which are running or done: the launch cannot deadlock (chained_states.py's argument), and
Triton's interpreter, which runs programs in ticket order, never waits.

Counters (launch.zeroed_counters, int64, one set per shape: chunks and programs): never reset. The ticket counter's
value tells a program the launch's epoch (ticket // programs per launch), and every launch adds NC to each chain
counter (kept_chain_step's COUNT_UP: S_in[0] is released too), so "S_in[c] is written" is "counter >= epoch * NC +
1 + c". Only the forward that keeps its entering states for the backward (config keep_states, 16-bit x: the
hand-off is the kept parts) takes this path; forward.py's ``uses_chain_scan`` says when.
"""

import triton
import triton.language as tl

from models.kernels.fast_launch import fast_launch
from models.kernels.pdl import pdl_prologue
from models.kernels.ssd_triton.chained_states import kept_chain_step, wait_chain
from models.kernels.ssd_triton.chunk_scan import scan_program
from models.kernels.ssd_triton.chunk_state import chunk_local_states

__all__ = ["chain_scan_fwd_kernel"]


@triton.jit
def _item(ticket, NC, R_c, R_s, LAG):
    """(is_chain, chunk, index within the chunk's items of its kind) of this launch's ticket (module docstring)."""
    head = LAG * R_c  # rounds 0 ... LAG - 1: the chain's items only
    both = (NC - LAG) * (R_c + R_s)  # rounds LAG ... NC - 1: the chain's items, then the scan's
    if ticket < head:
        is_chain = ticket >= 0
        c = ticket // R_c
        i = ticket % R_c
    elif ticket < head + both:
        t = ticket - head
        w = t % (R_c + R_s)
        is_chain = w < R_c
        c = LAG + t // (R_c + R_s) - tl.where(is_chain, 0, LAG)
        i = tl.where(is_chain, w, w - R_c)
    else:  # rounds NC ... NC + LAG - 1: the scan's items only
        t = ticket - head - both
        is_chain = t < 0
        c = NC - LAG + t // R_s
        i = t % R_s
    return is_chain, c.to(tl.int32), i.to(tl.int32)


@fast_launch
@triton.jit
def chain_scan_fwd_kernel(x_ptr, B_ptr, dt_chain_ptr, dA_ptr, seq_ptr, init_ptr, sync_ptr, S_in_ptr, S_lo_ptr,
                          final_ptr, CB_ptr, dt_scan_ptr, C_ptr, D_ptr, y_ptr, z_ptr, w_ptr, g_ptr, ss_ptr,
                          L, Q, NC, H, G, P, N, BATCH, LAG, J,
                          s_x_b, s_x_l, s_x_h, s_x_p, s_b_b, s_b_l, s_b_g, s_b_n, s_c_b, s_c_l, s_c_g, s_c_n,
                          s_y_b, s_y_l, s_y_h, s_y_p, s_z_b, s_z_l,
                          HAS_SEQ: tl.constexpr, HAS_INIT: tl.constexpr, HAS_D: tl.constexpr,
                          D_HAS_HDIM: tl.constexpr, PREC: tl.constexpr,
                          CHAIN_EVEN: tl.constexpr, CHAIN_HEADS: tl.constexpr, CHAIN_P: tl.constexpr,
                          CHAIN_N: tl.constexpr, CHAIN_K: tl.constexpr, CHAIN_FOLD_DT: tl.constexpr,
                          SCAN_EVEN: tl.constexpr, SCAN_HEADS: tl.constexpr, SCAN_FOLD_DT: tl.constexpr,
                          SCAN_M: tl.constexpr, SCAN_K: tl.constexpr, SCAN_P: tl.constexpr, SCAN_N: tl.constexpr,
                          GATE: tl.constexpr, FAST: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """One program: a chain item (chained_states_fwd_kernel's work with kept states for one chunk and tile chain) or
    a scan item (chunk_scan_fwd_kernel's for one chunk, head block, block of positions and of P). sync_ptr: int64
    [1 + chains] (the ticket, then one counter per tile chain)."""
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    n_p_c = tl.cdiv(P, CHAIN_P)
    n_n_c = tl.cdiv(N, CHAIN_N)
    HP = H // CHAIN_HEADS
    R_c = BATCH * HP * n_p_c * n_n_c
    n_m = tl.cdiv(Q, SCAN_M)
    n_p_s = tl.cdiv(P, SCAN_P)
    HS = H // SCAN_HEADS
    R_s = BATCH * HS * n_m * n_p_s
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    per_launch = NC * (R_c + R_s)
    base = (ticket // per_launch) * NC + 1  # the chain counters' value once S_in[0] is written, this launch
    is_chain, c, i = _item(ticket % per_launch, NC, R_c, R_s, LAG)
    if is_chain:  # chain r's step at chunk c (take_ticket's order of chains)
        b = i // (n_n_c * n_p_c * HP)
        h0 = ((i // (n_n_c * n_p_c)) % HP) * CHAIN_HEADS
        offs_p = ((i // n_n_c) % n_p_c) * CHAIN_P + tl.arange(0, CHAIN_P)
        offs_n = (i % n_n_c) * CHAIN_N + tl.arange(0, CHAIN_N)
        own0, own1 = chunk_local_states(
            x_ptr, B_ptr, dt_chain_ptr, dA_ptr, seq_ptr, b, c, h0, h0 // (H // G), offs_p, offs_n, L, Q, NC, H, P, N,
            s_x_b, s_x_l, s_x_h, s_x_p, s_b_b, s_b_l, s_b_g, s_b_n, HAS_SEQ, CHAIN_EVEN, PREC, CHAIN_HEADS, CHAIN_P,
            CHAIN_N, CHAIN_K, CHAIN_FOLD_DT,
        )  # fmt: skip
        tile = offs_p[:, None] * N + offs_n[None, :]
        mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
        kept_chain_step(init_ptr, S_in_ptr, S_lo_ptr, final_ptr, dA_ptr, seq_ptr, sync_ptr + 1 + i, own0, own1, b, h0,
                        c, tile, mask, L, Q, NC, H, P * N, HAS_INIT, HAS_SEQ, CHAIN_HEADS, CHAIN_P, CHAIN_N, base,
                        True)  # fmt: skip
    else:  # the scan's program (chunk c; programs of one chunk in program_ids' inner-first order)
        pid_p = i % n_p_s
        pid_m = (i // n_p_s) % n_m
        h0 = ((i // (n_p_s * n_m)) % HS) * SCAN_HEADS
        b = i // (n_p_s * n_m * HS)
        # S_in[c] of its heads, every [P, N] tile chain of them, written (acquire: visible to the loads below)
        for hh in tl.static_range(SCAN_HEADS):
            first = (b * HP + (h0 + hh) // CHAIN_HEADS) * (n_p_c * n_n_c)
            for tile_chain in range(first, first + n_p_c * n_n_c):
                wait_chain(sync_ptr + 1 + tile_chain, base + c)
        scan_program(b, c, h0, pid_m, pid_p, CB_ptr, x_ptr, dt_scan_ptr, dA_ptr, C_ptr, S_in_ptr, D_ptr, seq_ptr,
                     y_ptr, L, Q, NC, H, G, P, N, s_x_b, s_x_l, s_x_h, s_x_p, s_c_b, s_c_l, s_c_g, s_c_n, s_y_b, s_y_l,
                     s_y_h, s_y_p, z_ptr, w_ptr, g_ptr, ss_ptr, s_z_b, s_z_l, J, HAS_SEQ, HAS_D, D_HAS_HDIM,
                     SCAN_EVEN, PREC, SCAN_HEADS, SCAN_FOLD_DT, SCAN_M, SCAN_K, SCAN_P, SCAN_N, GATE,
                     FAST)  # fmt: skip
