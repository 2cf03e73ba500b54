"""Tile shapes, warps and pipelining depth of the SSD kernels, chosen per problem shape and per kernel.

Every block size is a power of two >= 16 (tl.dot's minimum); tiles over chunk positions may overhang
the chunk (masked), so any chunk size works. The backward kernels hold all of P (dx, dC, dB) and all
of N (dC, dB) in one program, so those two are padded up to powers of two there. Tile choices change
only speed, never results beyond float rounding (the tests run several).

Removed in session 45, after their measurements (their code is in git at commit 4cb31b8, the last one with all of
them): ``fused`` (fused_scan.py: one program per batch, head and block of P walking the chunks with the
state in registers; 1.3B, H100, 2026-11-23: forward and S_in recompute 1.40 ms against the staged path's 1.04, the
backward recurrence 0.28 against 0.25: 256 programs walking 16 chunks in series leave 132 SMs waiting on latency)
and ``chained_scan`` (chained_scan.py: the chained states and the chunk scan in one kernel, one program per chunk,
batch and head; session 13, H100, 1.3B: 0.453 ms against 0.176 + 0.223 for the two kernels, since one program walks
the chunk's row blocks in series where the chunk scan runs them side by side). Also removed then: the "per_head"
dB / dC backward (block_config says why); dCB's grid of one program per block of rows walking its tiles
(``dcb_tiles`` False: the grid's time is that of its longest program); the state term of dC in several programs
per head block (``dcb_state_split``; session 11, H100, 1.3B: 2 slices 0.494 ms against 0.517 for 1, but 1 slice
the faster since session 17: dCB + bc_finish 0.468 -> 0.453); column sums reduced once per pair of heads
(``dcb_head_pairs``; off since session 24: per head at 3 pipeline stages 0.404-0.406 ms against 0.421-0.423); and
column sums as the row sums of a second, transposed product (``dcb_cols_by_dot``; session 22: dCB 0.428 -> 0.396
ms in every tile, but dA's error 1.13x mamba_ssm's as the diagonal's M_jj no longer cancelled exactly; off the
diagonal only 0.427 -> 0.412, dA up to 1.10x); and dx reading CB transposed instead of a CBᵀ copy
(``dx_reads_cb``; chunk_cb.py says why not). Removed in session 48 (code at commit 828ea41): the dt kernel writing
the chunk states' whole per-position scale for the chained and staged states (the chained forward's loop 273 -> 218
sm_90 instructions); on an H100, 2026-12-05, -0.58% of the SSD's joules against a 1.22% spread of its baselines, and
compiled, its float32 sums re-associate: the final states' error against float64 1.6e-6 against 4.7e-7.
Tried in session 53 and reverted (code at commit d08b15b): ``chain_scan``, the chained states' and the chunk scan's
programs interleaved in one ticketed launch (scan items waiting on the chain's counters), bit for bit the two
kernels' outputs, yet 522-526 us against 468 for the pair (H100, 1.3B with documents and the gate): the chain's
programs do not leave that much idle, and held behind the scan's in the dispatch order its per-chunk latency grows.
Also tried then and reverted (commit 41ea252): ``chained_fwd_chunks`` 2, two consecutive chunks of a tile chain per
program of the chained forward (both own states before the wait): 168.2 us at a 168-register cap, 206.8 uncapped,
against 158.0 with one chunk per program (and not bit for bit the one-chunk kernel's outputs on the GPU).
Tried in session 54, not committed: ``chained_walk``, one program per tile chain walking all its chunks with the state
in registers (no tickets, waits or hand-off reads; bit for bit the ticketed kernels' outputs in the interpreter):
H200, 1.3B with documents and kept states, forward 169.3-169.8 us against 155.7-157.0, backward 311.4-312.2 against
174.3-174.9, end to end -1.4%. A link's time is its loads (x per N tile, B per head: 32 MB a chunk), not the hand-off.
Tried in session 71 and reverted (code at commit db4c865): ``factored_decay``, the chunk scan's and dx's weights off
the diagonal as CB times column factors read from a table (decay_factors.py, one launch each way), the row factors
scaling the accumulators after those blocks, the diagonal blocks in a loop of their own: the loop off the diagonal
compiled without MUFU at 181 / 169 sm_90 instructions against 279 / 276, yet on an H100 (1.3B, documents) the chunk
scan took 0.228 ms against 0.208, dx 0.336 against 0.314, the tables 0.016, and the step 51,088 tokens/s against
51,353; its GPU accuracy test failed its first case. As session 13 found for its form, these loops are not bound by
their instruction count: a second loop's pipeline prologue and the accumulator's wait between the loops cost more.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from models.kernels.fast_launch import next_power_of_2


@dataclass(frozen=True)
class BlockConfig:
    # C·Bᵀ: rows l, columns s, reduction over N.
    cb_m: int
    cb_s: int
    cb_n: int
    cb_warps: int
    cb_stages: int
    # Chunk states and dS_in: [P, N] tiles, reduction over chunk positions.
    state_p: int
    state_n: int
    state_k: int
    state_warps: int
    state_stages: int
    # State passing: elements of the flattened [P*N] state per program.
    pass_block: int
    # Chunk scan forward: positions l, columns of P, inner blocks of s and of N.
    scan_m: int
    scan_p: int
    scan_k: int
    scan_n: int
    scan_warps: int
    scan_stages: int
    # dx / ddt / dD: block of s, inner blocks of l and of N.
    dx_k: int
    dx_m: int
    dx_n: int
    dx_warps: int
    dx_stages: int
    # (dx_heads: heads per dx program, declared with the defaults at the end)
    # dCB, dC's state term and the decay terms (dcb_bwd.py): its square tiles [l, s], and bc_finish's blocks of l.
    dc_m: int
    dc_warps: int
    dc_stages: int
    # dB's state term (db_bwd.py): block of s.
    db_k: int
    db_warps: int
    db_stages: int
    heads_per_prog: int  # dCB / dB: heads one program sums before writing its partial
    # Heads per dx program (1 or 2, consecutive heads of one group): with 2 the group's CBᵀ and B tiles are read once
    # for both heads (chunk_scan_bwd.py). A value that does not divide the heads per group falls back to 1. One head,
    # its state term first and inner blocks of 32 (dx_m) take 128 registers at 4 warps (four programs per SM)
    # against two heads' 255 with spills (two per SM): session 22 (H100), dx 1.3B 0.413 -> 0.366 ms, 370M 0.211 ->
    # 0.189; one head with 64-wide inner blocks 0.454 / 0.233, two heads state first 0.433 / 0.225, 8 warps slower.
    # Two heads again since session 57: after the row sums in the accumulator's layout (dx_row_sums_2d) they compile
    # to 206 registers uncapped and to 168 without spills under dx_maxnreg 168 (Triton 3.6, kernel_resources.py):
    # three programs of 4 warps per SM, the chunk scan forward's shape, against one head's four at 115. H100, with
    # documents and kept states (bench_ssd.py --tune, variant dx_h2_cap168): dx 1.3B 0.330 / 0.326 -> 0.314 ms, 370M
    # 0.169 / 0.171 -> 0.166, bit for bit the one-head outputs; end to end, 1.3B, three alternating rounds on one
    # machine: 49,997 / 49,568 / 49,685 -> 50,349 / 49,844 / 50,014 tokens/s (+0.66% at the medians), memory equal.
    # Two stages (48 KB of shared memory) 0.339.
    dx_heads: int = 2
    # The same for the chunk scan forward (chunk_scan.py): the group's CB and C tiles read once per pair of heads.
    scan_heads: int = 2
    # The same for the chunk states and dS_in (chunk_state.py: the group's B / C read once per pair). Two heads take
    # 242 registers at 4 warps against 168 (2 programs per SM, not 3) and still pay: 1.3B chunk states 0.305 -> 0.251
    # ms, dS_in 0.117 -> 0.111 (H100, docs/ssd_sessions.md, session 10).
    state_heads: int = 2
    # dCB's heads loop software-pipelined over this many stages for all of its loads (tl.range's num_stages), the
    # per-head vectors of the decay (a_m, a_k, dt_k) included: Triton pipelines only loads that feed a product
    # otherwise, so each head waits for those (18 plain global loads per head in Triton 3.6's sm_90 code; with 3
    # stages none, but 96 bytes of spills instead of 72, 64 per head: kernel_resources.py --kernels dcb --loops).
    # None: as Triton decides. Session 24 (H100, bench_ssd.py --tune, two calls; dCB ms at 1.3B / 370M): pairs, as
    # Triton decides 0.421-0.423 / 0.219-0.221; pairs at 2 / 3 stages 0.520 / 0.474, 0.263 / 0.246; per head as
    # Triton decides 0.434 / 0.228; per head at 2 / 3 / 4 stages 0.489 / 0.404-0.406 / 0.402, 0.249 / 0.208-0.212 /
    # 0.210; per head at 3 stages with dcb_cols_by_dot 0.443 / 0.228.
    dcb_heads_stages: int | None = 3
    # dCB's tiles below the diagonal write each head's
    # column sums of M as this many partial sums over groups of dc_m / dcb_col_parts rows (at 4 warps, 4 parts: one
    # per warp, so no reduction across warps, no barrier or shared memory per head), into extra slots of R_part that
    # dt_bwd_kernel adds (dcb_bwd.py). 1: one sum, reduced across the warps, as before. Session 24 (H100, 4 parts,
    # first as a timing-only variant that wrote the parts to scratch slots: dCB 1.3B 0.407 -> 0.371 ms, with documents
    # 0.425 -> 0.387, 370M 0.212 -> 0.192; Triton 3.6's per-head loop 654 -> 585 instructions, 7 -> 3 barriers).
    dcb_col_parts: int = 4
    # ... and on the diagonal too: r alone in its slot, the column sums' parts in dcb_col_parts slots more
    # (dcb_bwd.py; Triton 3.6: the diagonal's per-head loop 667 -> 615 instructions, 7 -> 3 barriers, spills 64 -> 24
    # bytes). Session 25 (H100, bench_ssd.py --tune, one process; dCB / dt_bwd ms, 1.3B: 0.364 / 0.039 -> 0.335 /
    # 0.045, with documents 0.385 -> 0.351; 370M 0.191 -> 0.175, 0.201 -> 0.184; whole SSD 1.3B 1.702 -> 1.679 ms).
    dcb_diag_col_parts: bool = True
    # The forward's entering states S_in kept for the backward (as high + low parts in x's dtype, state_passing.py),
    # which then recomputes only CB instead of CB and the chained (or staged) states; the forward's chain hands its
    # states on through the kept parts themselves. [2, B, NC, H, P, N] held from forward to backward: 128 MiB per
    # layer at 1.3B, 6 GiB over its 48 layers. Session 15 (H100, bench_ssd.py): 1.3B 1.842 -> 1.630 ms, 370M 1.008 ->
    # 0.899 (the model: ModelArgs.ssd_keep_states; end to end 1.3B 41.1k -> 42.4k tokens/s at 54.1 -> 60.1 GiB).
    # Off: mamba_ssm's memory.
    keep_states: bool = False
    # bc_finish (dC, dB from the partial sums and dCB): programs for dC and for dB apart, each over bcf_n columns of N,
    # with bcf_warps warps. Session 14 (H100, 1.3B and 370M alike, 256 row blocks): one program for both outputs and
    # all of N, 8 warps, 0.053 ms; apart, N in blocks of 128 / 64 / 32 at 4 warps 0.043 / 0.036 / 0.033 (8 warps:
    # 0.053 / 0.039).
    bcf_n: int = 32
    bcf_warps: int = 4
    # The chunk states and the recurrence between chunks in one kernel each way, chained from chunk to chunk
    # (chained_states.py: the chunk-own states and dS_in never reach memory); False: the staged kernels
    # (chunk_state.py, then state_passing.py). The chained kernels take state_p, state_k and
    # state_warps, and their own heads per program, N tiles and pipeline depth below. Session 12 (H100, 1.3B; the
    # forward kernel runs twice, in the forward and in the backward's recompute): staged chunk states + state passing
    # 0.452 ms, dS_in + state passing backward 0.234 ms; chained with 2 heads per program 0.439 / 0.398, 1 head 0.407
    # / 0.221, + 3 stages 0.368 / 0.202, + N tiles of 64 in the forward 0.347 / 0.221 (docs/performance.md).
    chained: bool = True
    # Heads per program of the chained forward (chained_heads) and backward (chained_bwd_heads), 1 or 2 (as
    # state_heads): 1 gives twice the chains, so a predecessor is more often done. Apart since session 57: with kept
    # states a pair compiles to 192 registers in the forward (48 bytes of spills under a cap of 168, Triton 3.6) but
    # spills 128-384 bytes in the backward, so each direction can be timed on its own. The forward's pair since
    # session 58, at its own cap (chained_fwd_pair_maxnreg below): H100, bench_ssd.py --tune, documents, kept states,
    # the chained forward 0.163 -> 0.155 ms at the 1.3B, 0.085 -> 0.084 at the 370M (uncapped pairs: 0.175 / 0.092).
    chained_heads: int = 2
    chained_bwd_heads: int = 1
    chained_fwd_n: int = 64
    # The chained dstates in N tiles of 64 at <= 128 registers (chained_bwd_maxnreg): twice the chains, four programs
    # per SM instead of two (255 registers with tiles of 128). Session 26 (H100, with documents, ms): 1.3B 0.208 ->
    # 0.190, 370M 0.109 -> 0.103; tiles of 64 uncapped (168 registers, 3 per SM) 0.209 / 0.112.
    chained_bwd_n: int = 64
    chained_stages: int = 3
    # Grid order of the chunk scan, dx, dCB and dB (launch.program_ids): the programs of one chunk side by side
    # (True), so that what they share (the chunk's x, dy, CB, states) is read from L2, or the chunk index on the
    # grid's first axis (False). Session 12 (H100, 1.3B, ncu): L2 hit rate chunk scan 41% -> 74%, dx 39% -> 69%, dCB
    # 29% -> 49%; time chunk scan 0.279 -> 0.221 ms, dx 0.471 -> 0.439 (state term first in both), dCB 0.438 ->
    # 0.446, dB 0.113 both.
    inner_first: bool = True
    # dx: the chunk-state term first, then the intra-chunk loop into the same accumulator (chunk_scan_bwd.py), so one
    # [dx_k, P] float32 accumulator per head is live at a time: 242 registers and no spills against 255 and 8 bytes
    # (two heads, 4 warps), yet 0.439 ms against 0.432 the other way (session 12). With one head per program and
    # 32-wide inner blocks it is what brings dx to 128 registers (dx_heads above; session 22): on.
    dx_state_first: bool = True
    # dx's row sums (q and ddt) kept [dx_k, 1] in the accumulator's layout and stored through [dx_k, 1] pointers:
    # with 1-D sums Triton 3.6 converts each [dx_k, P] float32 product to a blocked layout through shared memory
    # before reducing it (chunk_scan_bwd.py). Session 25 (kernel_resources.py, 1.3B tiles): 1960 -> 1832
    # instructions, 30 -> 22 barriers, 124 -> 116 registers. Timed in session 26 (H100, bench_ssd.py variant
    # dx_sums_1d is the old code): without documents dx 0.365 -> 0.331 ms at the 1.3B shape, 0.187 -> 0.173 at the
    # 370M; with documents it pays only under dx_maxnreg (below).
    dx_row_sums_2d: bool = True
    # dCB (dcb_bwd.py) on a second CUDA stream, beside the chained dstates, dx and dB, which it does
    # not depend on (backward.py): the chained dstates wait on their chain and draw less than the power limit
    # (~570 W at the 1.3B shape, H200, session 38), so dCB's tiles fill their idle issue slots. Session 42 (H200,
    # bench_energy.py, 1.3B with documents): our SSD forward + backward 987.9 -> 963.1 mJ (-2.5%), 1.424 -> 1.390 ms;
    # results bit for bit the one-stream path's (the 1.3B's losses too), also inside a captured CUDA graph
    # (backward.py). Session 60 (H100, 1.3B end to end): off -0.48%; other fork points and stream priorities measured
    # slower too (backward.py).
    overlap_dcb: bool = True
    # dt folded into the decay's exponent in the chunk scan's and dCB's per-element weights: the dt kernel also writes
    # a2dt = a_s log2(e) - log2(dt_s) ([B, H, NC, Q] float32, kept for the backward: 4 MiB per layer at the 1.3B
    # shape), and exp(a_l - a_s) dt_s becomes 2^(a_l log2(e) - a2dt_s): one multiply per element and head fewer, and
    # no a_s to load. sm_90 (Triton 3.6, kernel_resources.py --set fold_dt=True --loops, 1.3B tiles with documents):
    # the chunk scan's inner loop 334 -> 273 instructions per iteration, dCB's heads loop 584 -> 509 per head below
    # the diagonal and 615 -> 540 on it, spills 24 -> 16 bytes. Session 42 (H200, bench_energy.py): our SSD forward +
    # backward 987.9 -> 973.4 mJ (-1.5%), 1.424 -> 1.398 ms. The exponent's rounding grows by that of log2(dt), far
    # below bf16's: every output and gradient within the float64 reference's tolerances and mamba_ssm's error ratio
    # (tests/gpu/test_ssd_triton_gpu.py). Like the decay's clamp at 0 in every intra-chunk weight (ours and
    # mamba_ssm's), it takes dt >= 0: a2dt is +inf (weight 0) where dt is not positive.
    fold_dt: bool = True
    # With fold_dt, the chunk states' per-position scale exp(a_last - a_s) dt_s as 2^(a_last log2(e) - a2dt_s) too
    # (chunk_state.py; the chained and staged states, forward and recompute): no dt to load or multiply by. sm_90
    # (Triton 3.6, kernel_resources.py --kernels chained_states --loops, 1.3B tiles): the chained forward's loop 307
    # -> 273 instructions with documents, 263 -> 225 without; dB's 251 -> 230. Session 43 (H200, bench_energy.py):
    # our SSD forward + backward 989.3 -> 963.7 mJ (-2.6%), 1.428 -> 1.396 ms; errors against float64 within 1% of
    # mamba_ssm's ratio at every output (bench_ssd.py --numerics_seeds 3).
    fold_dt_states: bool = True
    # Register caps (ptxas .maxnreg) for the backward's latency-bound kernels, None: ptxas's choice. Uncapped, dx,
    # dCB and the chained dstates take 242-255 registers at 4 warps, two programs per SM (12% occupancy, ncu, session
    # 12); at <= 168 registers (and <= ~76 KB of shared memory, so fewer stages) three fit, at the price of spills.
    # Session 13 (H100, 1.3B, ms): capped at 168, dx 0.416 -> 0.597, dCB 0.454 -> 0.467 (0.575 with 2 stages),
    # chained dstates 0.204 -> 0.239, dB 0.112 -> 0.103 (16 bytes of spills): only dB's cap is on.
    # dx and the chained states' forward at 128: with documents and ngroups 1 (Triton specialises G == 1) ptxas gave
    # them 132 and 130-132 registers, over the 128 that lets four 4-warp programs share an SM (ncu, session 26: 3 per
    # SM). Capped, they compile to 115 / 128 registers without spills (Triton 3.6), and with documents at the 1.3B
    # shape dx takes 0.327 ms against 0.368 uncapped, the chained states 0.363 against 0.407 (fwd + bwd launches;
    # H100, bench_ssd.py variant `uncapped`); without documents nothing changes. The chunk scan's forward (158-160
    # registers, 72 KB of shared memory: 3 per SM) was slower capped with 2 stages (scan_maxnreg, None).
    # dx at 168 since session 57, with two heads per program (dx_heads above: no spills); a program of one head
    # (dx_heads 1, or an odd number of heads per group) keeps 128 (dx_one_head_maxnreg): at 168 it would take 139
    # registers, three programs per SM instead of four.
    dx_maxnreg: int | None = 168
    dx_one_head_maxnreg: int | None = 128
    # dCB's state-term programs in a launch of their own, before its tiles' (dcb_bwd.py's PART), so each takes its own
    # cap: dc_maxnreg the tiles', dc_state_maxnreg the state term's. Compiled apart (Triton 3.6, 1.3B tiles, kept
    # states), the tiles at 168 take 48 bytes of spills outside their heads loops (one spill load per head inside
    # them) and 51 KB of shared memory, three programs per SM against two for the one launch (255 registers, 16 bytes
    # of spills; at 168 it spills 336, 77 loads per head in the state term's loop). On since session 58 (H100,
    # bench_ssd.py --tune, documents, kept states): dCB 0.368 -> 0.345 ms at the 1.3B (SSD 1.454 -> 1.425 ms; the
    # chained dstates beside it 0.220 -> 0.214), 0.188 -> 0.189 at the 370M (SSD 0.793 -> 0.787); with the tiles at
    # 168 (dc_maxnreg) slower: 0.391 at the 1.3B.
    dcb_state_apart: bool = True
    dc_state_maxnreg: int | None = None
    dc_maxnreg: int | None = None
    db_maxnreg: int | None = 168
    chained_bwd_maxnreg: int | None = 128  # with chained_bwd_n 64 (above): no spills (Triton 3.6)
    chained_fwd_maxnreg: int | None = 128
    # The chained forward's pair of heads (chained_heads 2): 192 registers uncapped with kept states, 168 with 48
    # bytes of spills at this cap (none without kept states; Triton 3.6), three programs per SM.
    chained_fwd_pair_maxnreg: int | None = 168
    # The chunk scan with the gate (fuse_gate_into_scan, the 1.3B config) loads both heads' x, z, D and norm weight
    # before its first store (chunk_scan.py): ptxas then takes 176 registers, two programs per SM; at 168, 164 and no
    # spills, three (Triton 3.6). Without the gate it takes 159 either way.
    scan_maxnreg: int | None = 168

    def dx_register_cap(self, heads: int) -> int | None:
        """dx's register cap for programs of `heads` heads (1 or 2): dx_maxnreg for pairs, dx_one_head_maxnreg else."""
        return self.dx_maxnreg if heads == 2 else self.dx_one_head_maxnreg

    def chained_fwd_register_cap(self, heads: int) -> int | None:
        """The chained forward's register cap for programs of `heads` heads (1 or 2): chained_fwd_pair_maxnreg for
        pairs, chained_fwd_maxnreg else (an odd number of heads per group runs one head a program)."""
        return self.chained_fwd_pair_maxnreg if heads == 2 else self.chained_fwd_maxnreg

    def __post_init__(self):
        parts = self.dcb_col_parts
        if parts < 1 or parts & (parts - 1) or self.dc_m % parts:
            raise ValueError(
                f"BlockConfig.dcb_col_parts {parts} must be a power of two dividing dc_m {self.dc_m}: 1 for one "
                "column sum per tile, dc_warps (4) for one per warp"
            )


def whole_tiles(L: int, Q: int, P: int, block_p: int, *position_blocks: int) -> bool:
    """True when every tile lies wholly inside the data: whole chunks (L a multiple of Q), chunk-position blocks that
    divide Q, and blocks of P that divide P (P itself where a program holds all of it). Kernels then load without masks
    (their EVEN constexpr): at 64 x 64 tiles the per-element mask and address arithmetic otherwise outnumbers the
    products."""
    return L % Q == 0 and P % block_p == 0 and all(Q % blk == 0 for blk in position_blocks)


def heads_per_program(heads_per_group: int, want: int) -> int:
    """The largest divisor of the heads per group that is <= want (at least 1): a program takes heads of one group
    only (dCB's head blocks; the pairs of dx, the chunk scan and the chunk states, whose kernels take 1 or 2)."""
    return max(d for d in range(1, max(1, min(heads_per_group, want)) + 1) if heads_per_group % d == 0)


def _pow2_at_least_16(n: int) -> int:
    return max(16, next_power_of_2(n))


@functools.cache  # a pure function of three ints, asked for by every layer's forward
def block_config(chunk_size: int, headdim: int, dstate: int) -> BlockConfig:
    """Tiles for one (chunk, P, N) shape.

    Measured on an H100 at the 1.3B shape (chunk 256, P 64, N 128, bf16; benchmarks/bench_ssd.py --tune,
    docs/performance.md): 64-row tiles, 4 warps and 3 pipeline stages beat 128-wide tiles and 8 warps for every
    kernel; the inner loops over positions are 64 wide in the backward (dC / dCB, dB: 3.26 ms for the whole
    forward + backward against 3.54 ms with 32; dx too until session 22's one head per program, config dx_heads) and
    32 wide in the chunk scan (0.40 ms against 0.43); the chunk states prefer all of N (128) in one tile. The
    "grouped" dB / dC backward (dCB summed over the heads first, then one product per group: dcb_bwd.py,
    bc_finish.py) with 8 heads per program beat the best "per_head" one (each head's dCB times B and C in the
    kernels; 3.905 against 4.443 ms; removed in session 45); after the mask-free inner loops, more heads per program
    won each time (whole forward + backward: 8 heads 2.527 ms, 16 2.424, 32 2.363-2.374, 64 2.332): fewer partial
    sums over head blocks to reduce (with ngroups 1, 64 means none). Smaller chunks shrink the tiles to fit.
    """
    q = min(64, _pow2_at_least_16(chunk_size))
    q_inner = min(32, q)
    p = min(64, _pow2_at_least_16(headdim))
    n = min(64, _pow2_at_least_16(dstate))
    return BlockConfig(
        cb_m=q,
        cb_s=q,
        cb_n=n,
        cb_warps=4,
        cb_stages=2,
        state_p=p,
        state_n=min(128, _pow2_at_least_16(dstate)),
        state_k=q,
        state_warps=4,
        state_stages=2,
        pass_block=min(512, _pow2_at_least_16(headdim * dstate)),
        scan_m=q,
        scan_p=p,
        scan_k=q_inner,
        scan_n=n,
        scan_warps=4,
        scan_stages=3,
        dx_k=q,
        dx_m=q_inner,
        dx_n=n,
        dx_warps=4,
        dx_stages=3,
        dc_m=q,
        dc_warps=4,
        dc_stages=3,
        db_k=q,
        db_warps=4,
        db_stages=3,
        heads_per_prog=64,
    )
