"""Tile shapes, warps and pipelining depth of the SSD kernels, chosen per problem shape.

Every block size is a power of two >= 16 (tl.dot's minimum); tiles over chunk positions may overhang
the chunk (masked), so any chunk size works. The backward kernels hold all of P (dx, dC, dB) and all
of N (dC, dB) in one program, so those two are padded up to powers of two there.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class BlockConfig:
    cb_m: int  # C·Bᵀ: rows (l), columns (s), reduction over N
    cb_s: int
    cb_n: int
    cb_warps: int
    state_p: int  # chunk states / dS_in: [P, N] tiles, reduction over chunk positions
    state_n: int
    state_k: int
    state_warps: int
    pass_block: int  # state passing: elements of the flattened [P*N] state per program
    scan_m: int  # chunk scan forward: positions l, columns of P, inner blocks of s and N
    scan_p: int
    scan_k: int
    scan_n: int
    scan_warps: int
    bwd_m: int  # backward (dx, dC, dB): blocks of l and s, N blocks of dx's chunk-state term
    bwd_k: int
    bwd_n: int
    bwd_warps: int
    heads_per_prog: int  # dC / dB: heads one program sums before writing its partial
    stages: int


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def block_config(chunk_size: int, headdim: int, dstate: int) -> BlockConfig:
    """Tiles for one (chunk, P, N) shape: 64-wide where the chunk allows, smaller for small problems."""
    q = min(64, _pow2_at_least_16(chunk_size))
    p = min(64, _pow2_at_least_16(headdim))
    n = min(64, _pow2_at_least_16(dstate))
    return BlockConfig(
        cb_m=q, cb_s=q, cb_n=n, cb_warps=4,
        state_p=p, state_n=n, state_k=q, state_warps=4,
        pass_block=min(1024, _pow2_at_least_16(headdim * dstate)),
        scan_m=q, scan_p=p, scan_k=q, scan_n=n, scan_warps=4,
        bwd_m=q, bwd_k=q, bwd_n=n, bwd_warps=4,
        heads_per_prog=8, stages=2,
    )
