"""Tile shapes, warps and pipelining depth of the SSD kernels, chosen per problem shape and per kernel.

Every block size is a power of two >= 16 (tl.dot's minimum); tiles over chunk positions may overhang
the chunk (masked), so any chunk size works. The backward kernels hold all of P (dx, dC, dB) and all
of N (dC, dB) in one program, so those two are padded up to powers of two there. Tile choices change
only speed, never results beyond float rounding (the tests run several).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton


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
    # dC (+ decay terms): block of l, inner blocks of s.
    dc_m: int
    dc_k: int
    dc_warps: int
    dc_stages: int
    # dB: block of s, inner blocks of l.
    db_k: int
    db_m: int
    db_warps: int
    db_stages: int
    heads_per_prog: int  # dC / dB: heads one program sums before writing its partial
    # "grouped": dCB summed over the heads first, then one product per group (dcb_bwd.py); "per_head": the dC, dB
    # kernels multiply each head's dCB by B / C (bc_bwd.py). Same results up to rounding.
    bc_mode: str = "grouped"


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def block_config(chunk_size: int, headdim: int, dstate: int) -> BlockConfig:
    """Tiles for one (chunk, P, N) shape.

    Measured on an H100 at the 1.3B shape (chunk 256, P 64, N 128, bf16; benchmarks/bench_ssd.py --tune,
    docs/performance.md): 64-row tiles with 32-wide inner loops, 4 warps and 3 pipeline stages beat 128-wide
    tiles and 8 warps for every kernel; the chunk states prefer all of N (128) in one tile. The "grouped" dB / dC
    backward with 8 heads per program: 3.905 ms for the whole forward + backward against 4.443 ms for the best
    "per_head" one (4 heads per program). Smaller chunks shrink the tiles to fit.
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
        dc_k=q_inner,
        dc_warps=4,
        dc_stages=3,
        db_k=q,
        db_m=q_inner,
        db_warps=4,
        db_stages=3,
        heads_per_prog=8,
        bc_mode="grouped",
    )
