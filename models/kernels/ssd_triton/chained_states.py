"""The chunk states and the recurrence between chunks in one kernel each way, chained from chunk to chunk: the
forward here, with the chain's machinery (tickets, counters, hand-offs) both directions share; the backward in
chained_dstates.py.

The staged path (chunk_state.py, then state_passing.py) writes every chunk's own state [B, NC, H, P, N] in float32
and reads it back in a second kernel, twice per layer and step (forward, and the backward's recompute), and the
backward does the same with dS_in. Here one program per (chunk, batch, head or pair of heads: config chained_heads,
chained_bwd_heads; [P, N] tile) computes its chunk's part (the loops of chunk_state.py), then takes the state
entering its chunk from the program of the chunk before, adds its own and hands the result on:

    forward   S_in[c] = H_{c-1} (H_{-1}: the initial state)      H_c = decay_c S_in[c] + states[c]
    backward  dH_c (dH_{NC-1}: dfinal)                          dH_{c-1} = dS_in[c] + decay_c dH_c
              dtot_c = decay_c <dH_c, S_in[c]>                   dinit = dH_{-1}
(state_passing.py defines decay_c, dtot and why S_in must be float32 for dtot). Only the chain's hand-off travels
between programs: in a float32 ring of two slots per tile (the forward; the backward with float32 dy), in S_in32
itself (CARRY_IS_S32: the backward's recompute, which keeps S_in32 anyway), or as high + low parts in the 16-bit
output the chain writes anyway: the kept S_in (CARRY_IS_KEPT, config keep_states) and the backward's dH
(CARRY_IS_DH), which then carry ~16 bits from chunk to chunk, far below the roundings of the chunk states' and dx's
operands (bench_ssd.py's numerics are unchanged: docs/ssd_sessions.md, session 15). Written once instead of beside a
float32 ring, 4 instead of 8 (forward) or 6 (backward) bytes per state element: session 15 (H100, 1.3B) forward
0.221 -> 0.164 ms, backward 0.206 -> 0.196 with keep_states (0.204 -> 0.203 without). The chunk-own states and dS_in
never reach memory.

Ordering. Programs do not start in grid order on the GPU, so each takes a ticket (an atomic counter) and works on
the tile its ticket names, chunk-major: every program a ticket waits for holds a smaller ticket, so it is running
or done, and the chain cannot deadlock (Triton's interpreter runs programs in ticket order anyway). A program
waits (acquire) until its tile's chain counter says the previous chunk's hand-off is written; the writer stores the
tile, synchronises its threads and then bumps the counter (release). Every load a chain step makes stays after its
wait: session 61 moved the loads no program of the chain writes (the decays, the backward's S_in[c] for dtot)
before it, bit for bit the same under the interpreter (programs one after another, no concurrency), and on an H100
the 1.3B's losses changed (5.4997 against 5.5434 after 9 steps, twice) with no time saved; reverted in session 62,
cause not found. A change to the chain's order needs a GPU run of the model next to the old code, not only the
interpreter's tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels.fast_launch import cdiv, fast_launch, next_power_of_2
from models.kernels.pdl import pdl_prologue
from models.kernels.ssd_triton.chunk_state import chunk_local_states
from models.kernels.ssd_triton.config import BlockConfig, heads_per_program, whole_tiles
from models.kernels.ssd_triton.launch import dot_precision, dummy, zeroed_counters
from models.kernels.ssd_triton.state_passing import chunk_decay, kept_states_buffer

__all__ = [
    "chained_states",
    "take_ticket",
    "wait_chain",
    "release_chain",
    "store_heads",
    "load_handoff",
    "entering_states",
    "hand_on",
    "chain_counters",
    "chain_layout",
    "end_chain",
    "head_tiles",
    "load_kept",
    "store_kept",
]


@triton.jit
def take_ticket(sync_ptr, BATCH, NC, H, P, N, HEADS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                REVERSE: tl.constexpr):  # fmt: skip
    """This program's work in the order programs arrive: (chunk c, its tile chain r, and the chain's batch b, first
    head h0, P block and N block). Chunk-major (reversed for the backward), chains in (b, head, P, N) order."""
    n_p = tl.cdiv(P, BLOCK_P)
    n_n = tl.cdiv(N, BLOCK_N)
    HP = H // HEADS
    R = BATCH * HP * n_p * n_n
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    if ticket == NC * R - 1:  # the last ticket: every program holds its own, so the counter goes back to zero
        tl.atomic_xchg(sync_ptr, 0, sem="relaxed")
    c = ticket // R
    if REVERSE:
        c = NC - 1 - c
    r = ticket % R
    return c, r, r // (n_n * n_p * HP), ((r // (n_n * n_p)) % HP) * HEADS, (r // n_n) % n_p, r % n_n


@triton.jit
def wait_chain(counter_ptr, steps):
    """Spin until the chain's counter reaches ``steps`` (acquire: the hand-off written before it is visible)."""
    done = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while done < steps:
        done = tl.atomic_add(counter_ptr, 0, sem="acquire")


@triton.jit
def end_chain(counter_ptr):
    """Called by the chain's last program, after its wait: every other program of the chain is past its own wait,
    so the counter goes back to zero for the next launch (launch.zeroed_counters)."""
    tl.atomic_xchg(counter_ptr, 0, sem="relaxed")


@triton.jit
def release_chain(counter_ptr):
    """Every thread's stores of the hand-off first, then one increment of the chain's counter (release)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release")


@triton.jit
def store_heads(ptrs, t0, t1, PN, mask, HEADS: tl.constexpr):
    """Head h0's tile at ptrs and, with HEADS 2, head h0 + 1's one state further on (in ptrs' dtype)."""
    tl.store(ptrs, t0.to(ptrs.dtype.element_ty), mask=mask)
    if HEADS == 2:
        tl.store(ptrs + PN, t1.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def load_handoff(ptrs, PN, mask, HEADS: tl.constexpr):
    """The float32 tiles another program handed on, for heads h0 (and h0 + 1; else the first twice), read past L1."""
    t0 = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    t1 = t0
    if HEADS == 2:
        t1 = tl.load(ptrs + PN, mask=mask, other=0.0, cache_modifier=".cg")
    return t0, t1


@triton.jit
def head_tiles(ptr, b, h0, tile, mask, PN, H, PRESENT: tl.constexpr, HEADS: tl.constexpr, BLOCK_P: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """The float32 [P, N] tiles of heads h0 (and h0 + 1; else the first twice) from a [B, H, P, N] tensor (the
    initial states, dfinal), or zeros when it is not PRESENT."""
    if PRESENT:
        t0 = tl.load(ptr + (b.to(tl.int64) * H + h0) * PN + tile, mask=mask, other=0.0)
        t1 = tl.load(ptr + (b.to(tl.int64) * H + h0 + 1) * PN + tile, mask=mask & (HEADS == 2), other=0.0)
    else:
        t0 = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
        t1 = t0
    return t0, t1


@triton.jit
def entering_states(init_ptr, carry_ptr, counter, b, h0, c, tile, mask, PN, H, N_SLOTS, HAS_INIT: tl.constexpr,
                    HEADS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The float32 [P, N] tiles of the states entering chunk c for heads h0 (and h0 + 1): the initial states (or
    zeros) for chunk 0, else the previous chunk's hand-off from slot c % N_SLOTS once its chain counter says so."""
    if c == 0:
        s0, s1 = head_tiles(init_ptr, b, h0, tile, mask, PN, H, HAS_INIT, HEADS, BLOCK_P, BLOCK_N)
    else:
        wait_chain(counter, c)
        slot = carry_ptr + ((b.to(tl.int64) * N_SLOTS + c % N_SLOTS) * H + h0) * PN + tile
        s0, s1 = load_handoff(slot, PN, mask, HEADS)
    return s0, s1


@triton.jit
def hand_on(carry_ptr, final_ptr, counter, b, h0, c, tile, mask, s0, s1, PN, H, NC, N_SLOTS, HEADS: tl.constexpr):
    """The states leaving chunk c: into slot (c + 1) % N_SLOTS for the next chunk's program (then released), or,
    after the last chunk, the final states."""
    if c + 1 < NC:
        store_heads(carry_ptr + ((b.to(tl.int64) * N_SLOTS + (c + 1) % N_SLOTS) * H + h0) * PN + tile, s0, s1, PN,
                    mask, HEADS)  # fmt: skip
        release_chain(counter)
    else:
        store_heads(final_ptr + (b.to(tl.int64) * H + h0) * PN + tile, s0, s1, PN, mask, HEADS)
        end_chain(counter)


@fast_launch
@triton.jit
def chained_states_fwd_kernel(
    x_ptr,
    B_ptr,
    dt_ptr,
    dA_ptr,
    seq_ptr,
    init_ptr,
    sync_ptr,
    carry_ptr,
    S_in_ptr,
    S_lo_ptr,
    final_ptr,
    L,
    Q,
    NC,
    H,
    G,
    P,
    N,
    BATCH,
    N_SLOTS,
    s_x_b,
    s_x_l,
    s_x_h,
    s_x_p,
    s_b_b,
    s_b_l,
    s_b_g,
    s_b_n,
    HAS_SEQ: tl.constexpr,
    HAS_INIT: tl.constexpr,
    CARRY_IS_S32: tl.constexpr,
    CARRY_IS_KEPT: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FOLD_DT: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    c, r, b, h0, pid_p, pid_n = take_ticket(sync_ptr, BATCH, NC, H, P, N, HEADS, BLOCK_P, BLOCK_N, False)
    g = h0 // (H // G)  # HEADS divides H // G (the launcher checks): both heads are in group g
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    own0, own1 = chunk_local_states(
        x_ptr, B_ptr, dt_ptr, dA_ptr, seq_ptr, b, c, h0, g, offs_p, offs_n, L, Q, NC, H, P, N, s_x_b, s_x_l, s_x_h,
        s_x_p, s_b_b, s_b_l, s_b_g, s_b_n, HAS_SEQ, EVEN, PREC, HEADS, BLOCK_P, BLOCK_N, BLOCK_K, FOLD_DT,
    )  # fmt: skip

    PN = P * N
    tile = offs_p[:, None] * N + offs_n[None, :]
    mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    counter = sync_ptr + 1 + r
    if CARRY_IS_KEPT:
        _kept_chain_step(init_ptr, S_in_ptr, S_lo_ptr, final_ptr, dA_ptr, seq_ptr, counter, own0, own1, b, h0, c,
                         tile, mask, L, Q, NC, H, PN, HAS_INIT, HAS_SEQ, HEADS, BLOCK_P, BLOCK_N)  # fmt: skip
    else:
        # The state entering chunk c, in float32.
        s0, s1 = entering_states(init_ptr, carry_ptr, counter, b, h0, c, tile, mask, PN, H, N_SLOTS, HAS_INIT, HEADS,
                                 BLOCK_P, BLOCK_N)  # fmt: skip
        if CARRY_IS_S32 and c == 0:  # S_in32[0]: no program hands it on
            store_heads(carry_ptr + (b.to(tl.int64) * N_SLOTS * H + h0) * PN + tile, s0, s1, PN, mask, HEADS)
        at_c = ((b.to(tl.int64) * NC + c) * H + h0) * PN + tile
        store_heads(S_in_ptr + at_c, s0, s1, PN, mask, HEADS)

        # The state leaving chunk c: handed on, or the final state.
        s0 = chunk_decay(dA_ptr, seq_ptr, b, h0, c, L, Q, NC, H, HAS_SEQ) * s0 + own0
        if HEADS == 2:
            s1 = chunk_decay(dA_ptr, seq_ptr, b, h0 + 1, c, L, Q, NC, H, HAS_SEQ) * s1 + own1
        hand_on(carry_ptr, final_ptr, counter, b, h0, c, tile, mask, s0, s1, PN, H, NC, N_SLOTS, HEADS)


@triton.jit
def _kept_chain_step(init_ptr, hi_ptr, lo_ptr, final_ptr, dA_ptr, seq_ptr, counter, own0, own1, b, h0, c, tile, mask,
                     L, Q, NC, H, PN, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, HEADS: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The forward's chain step when it keeps the entering states for the backward (CARRY_IS_KEPT, 16-bit x): the
    hand-off is the kept high + low parts of S_in[c + 1] themselves (state_passing.py), written once, instead of
    a float32 ring and the kept parts besides. The state entering chunk c is then what the backward's dtot will
    read (hi + lo, ~16 bits; the chunk states' own rounding to the operand dtype, ~8 bits, dominates the final
    states' error). The final states are the float32 sum."""
    at_c = ((b.to(tl.int64) * NC + c) * H + h0) * PN + tile
    if c == 0:
        s0, s1 = head_tiles(init_ptr, b, h0, tile, mask, PN, H, HAS_INIT, HEADS, BLOCK_P, BLOCK_N)
        s0, s1 = store_kept(hi_ptr + at_c, lo_ptr + at_c, s0, s1, PN, mask, HEADS)
    else:
        wait_chain(counter, c)
        s0 = load_kept(hi_ptr + at_c, lo_ptr + at_c, mask)
        s1 = s0
        if HEADS == 2:
            s1 = load_kept(hi_ptr + at_c + PN, lo_ptr + at_c + PN, mask)
    s0 = chunk_decay(dA_ptr, seq_ptr, b, h0, c, L, Q, NC, H, HAS_SEQ) * s0 + own0
    if HEADS == 2:
        s1 = chunk_decay(dA_ptr, seq_ptr, b, h0 + 1, c, L, Q, NC, H, HAS_SEQ) * s1 + own1
    if c + 1 < NC:
        store_kept(hi_ptr + at_c + H * PN, lo_ptr + at_c + H * PN, s0, s1, PN, mask, HEADS)
        release_chain(counter)
    else:
        store_heads(final_ptr + (b.to(tl.int64) * H + h0) * PN + tile, s0, s1, PN, mask, HEADS)
        end_chain(counter)


@triton.jit
def load_kept(hi_ptrs, lo_ptrs, mask):
    """high + low parts of a kept state tile, in float32, read past L1 (another program wrote them)."""
    hi = tl.load(hi_ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return hi + tl.load(lo_ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def store_kept(hi_ptrs, lo_ptrs, t0, t1, PN, mask, HEADS: tl.constexpr):
    """Float32 tiles as high + low parts (hi_ptrs' dtype); returns the tiles as stored (hi + lo in float32)."""
    hi_dtype: tl.constexpr = hi_ptrs.dtype.element_ty
    h0, h1 = t0.to(hi_dtype), t1.to(hi_dtype)
    l0, l1 = (t0 - h0.to(tl.float32)).to(hi_dtype), (t1 - h1.to(tl.float32)).to(hi_dtype)
    store_heads(hi_ptrs, h0, h1, PN, mask, HEADS)
    store_heads(lo_ptrs, l0, l1, PN, mask, HEADS)
    return h0.to(tl.float32) + l0.to(tl.float32), h1.to(tl.float32) + l1.to(tl.float32)


def chain_layout(cfg: BlockConfig, x, L: int, Q: int, H: int, G: int, P: int, N: int, want_n: int, want_heads: int):
    """The chain layout of one launch: ([P, N] tiles per head, tile chains per batch row, the kernel's tile
    constexprs and launch options, its heads per program among them)."""
    heads = heads_per_program(H // G, min(want_heads, 2))
    block_n = min(want_n, max(16, next_power_of_2(N)))
    n_tiles = cdiv(P, cfg.state_p) * cdiv(N, block_n)
    meta = dict(
        EVEN=whole_tiles(L, Q, P, cfg.state_p, cfg.state_k) and N % block_n == 0,
        PREC=dot_precision(x),
        HEADS=heads,
        BLOCK_P=cfg.state_p,
        BLOCK_N=block_n,
        BLOCK_K=cfg.state_k,
        num_warps=cfg.state_warps,
        num_stages=cfg.chained_stages,
    )
    return n_tiles, (H // heads) * n_tiles, meta


def chain_counters(n_chains: int, device, purpose: str) -> torch.Tensor:
    """The ticket counter and one chain counter per tile chain, zero (int32), which the kernels leave zero:
    take_ticket's last ticket and each chain's last program (end_chain) reset them."""
    return zeroed_counters(1 + n_chains, device, purpose)


def chained_states(x, dt_p, dA_cs, B, seq, init, cfg: BlockConfig, keep_s32: bool = False, keep_split: bool = False,
                   a2dt=None):  # fmt: skip
    """_staged_states' contract in one kernel: S_in (x's dtype), final (float32) and, with keep_s32, S_in in
    float32, with keep_split the kept states (state_passing.kept_states_buffer: S_in is its first slab), else None.
    a2dt (dt.py; config fold_dt_states): the chunk states' scale with dt in its exponent (chunk_state.py)."""
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    NC, Q = dt_p.shape[2:]
    dev = x.device
    _, per_row, meta = chain_layout(cfg, x, L, Q, H, G, P, N, cfg.chained_fwd_n, cfg.chained_heads)
    n_chains = b * per_row
    kept = kept_states_buffer(x, NC, H, P, N) if keep_split else None
    S_in = torch.empty(b, NC, H, P, N, device=dev, dtype=x.dtype) if kept is None else kept[0]
    store_lo = kept is not None and kept.shape[0] == 2  # 16-bit x: the chain carries the kept parts
    final = torch.empty(b, H, P, N, device=dev, dtype=torch.float32)
    n_slots = NC if keep_s32 else 2
    # With the kept high / low parts the chain hands states on through them (_kept_chain_step): no float32 carry.
    carry = dummy(dev) if store_lo else torch.empty(b, n_slots, H, P, N, device=dev, dtype=torch.float32)
    chained_states_fwd_kernel[(NC * n_chains,)](
        x,
        B,
        dt_p if a2dt is None else a2dt,
        dA_cs,
        seq if seq is not None else dummy(dev),
        init if init is not None else dummy(dev),
        chain_counters(n_chains, dev, "chained_states_fwd"),
        carry,
        S_in,
        kept[1] if store_lo else dummy(dev),
        final,
        L,
        Q,
        NC,
        H,
        G,
        P,
        N,
        b,
        n_slots,
        *x.stride(),
        *B.stride(),
        HAS_SEQ=seq is not None,
        HAS_INIT=init is not None,
        CARRY_IS_S32=keep_s32,
        CARRY_IS_KEPT=store_lo,
        FOLD_DT=a2dt is not None,
        maxnreg=cfg.chained_fwd_register_cap(meta["HEADS"]),
        **meta,
    )
    return S_in, final, carry if keep_s32 else kept
