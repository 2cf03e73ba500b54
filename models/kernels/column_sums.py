"""Column sums of the float32 partial-sum buffers our backward kernels leave: [R, C] -> [C], one or two buffers of
the same R in one launch.

Why not `t.sum(0)`: the norms' and the conv's weight gradients are summed by their programs into [programs, C]
buffers of ~2 MB (R 32-264, C 2048-17408 at the 1.3B shape), which PyTorch's reduction kernel took 5.4-10.9 us
each to sum, four launches per layer and step (the conv's weight and bias apart): ~1.4 ms of a 1.3B step on an
H100, most of it latency, not bytes (docs/ssd_sessions.md, session 51). Here one program sums all R rows of a block of
columns, in a fixed order (deterministic, like the reduction it replaces), and the conv's two buffers share one
launch. Imports triton at import time: import this module lazily (the kernels' launchers do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from models.kernels.fast_launch import cdiv, fast_launch, next_power_of_2
from models.kernels.pdl import pdl_prologue

__all__ = ["column_sums"]

# Columns per program (fewer for narrow buffers, so that the grid still spreads over the SMs) and rows per step of
# a program's loop.
_MAX_BLOCK_C = 256
_MIN_PROGRAMS = 128
_BLOCK_R = 16


@triton.jit
def _sum_block(X, OUT, R, C, stride_r, pid, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    cols = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = cols < C
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        mask = (rows < R)[:, None] & mask_c[None, :]
        acc += tl.load(X + rows.to(tl.int64)[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0), mask=mask_c)


@fast_launch
@triton.jit
def _column_sums_kernel(X1, OUT1, C1, stride1, X2, OUT2, C2, stride2, R, TWO: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    """Programs 0 .. cdiv(C1, BLOCK_C) - 1 sum X1's columns, the rest X2's (TWO)."""
    pdl_prologue(PDL)  # first: fast_launch.py's programmatic dependent launch
    pid = tl.program_id(0)
    n1 = tl.cdiv(C1, BLOCK_C)
    if TWO and pid >= n1:
        _sum_block(X2, OUT2, R, C2, stride2, pid - n1, BLOCK_R, BLOCK_C)
    else:
        _sum_block(X1, OUT1, R, C1, stride1, pid, BLOCK_R, BLOCK_C)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[R, ...] float32 with contiguous trailing dims -> its [R, C] view (never a copy)."""
    if t.dtype != torch.float32 or t.dim() < 2:
        raise ValueError(f"column_sums takes float32 [R, C, ...] buffers, got {t.dtype} {tuple(t.shape)}")
    rows = t.view(t.shape[0], -1)
    if rows.stride(1) != 1:
        raise ValueError(f"column_sums needs each row contiguous, got strides {t.stride()}")
    return rows


def column_sums(first: torch.Tensor, second: torch.Tensor | None = None):
    """first.sum(0) (and second.sum(0), in the same launch): float32, each in its buffer's trailing shape. Both
    buffers must have the same number of rows."""
    a = _as_rows(first)
    b = _as_rows(second) if second is not None else None
    R = a.shape[0]
    if b is not None and b.shape[0] != R:
        raise ValueError(f"column_sums: both buffers need the same rows, got {R} and {b.shape[0]}")
    widest = max(a.shape[1], 0 if b is None else b.shape[1])
    block_c = min(_MAX_BLOCK_C, max(16, next_power_of_2(cdiv(widest, _MIN_PROGRAMS))))
    out1 = torch.empty(first.shape[1:], device=first.device, dtype=torch.float32)
    out2 = torch.empty(second.shape[1:], device=first.device, dtype=torch.float32) if b is not None else None
    programs = cdiv(a.shape[1], block_c) + (cdiv(b.shape[1], block_c) if b is not None else 0)
    _column_sums_kernel[(programs,)](
        a, out1, a.shape[1], a.stride(0),
        b if b is not None else a, out2 if out2 is not None else out1, b.shape[1] if b is not None else 0,
        b.stride(0) if b is not None else 0, R,
        TWO=b is not None, BLOCK_R=_BLOCK_R, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    return out1 if second is None else (out1, out2)
