"""float32 2^x, 1 / x and the sigmoid from single MUFU instructions, for the element-wise Triton kernels (the conv,
the gated norm, the optimizer's AdamW update).

With FAST (on the GPU; the kernels' launchers pass it false under TRITON_INTERPRET=1, whose numpy has no PTX):
ex2.approx.ftz and rcp.approx.ftz, one MUFU instruction each. Otherwise tl.exp2 and Triton's division, the same
formulas: on sm_90 the division (PTX div.full.f32) wraps the same MUFU.RCP in range checks and scalings, ~5
instructions where the MUFU alone is 1 (benchmarks/kernel_resources.py), and gave the gated norm's outputs bit for bit
(H200, session 38). rcp.approx is within 1 ulp of 1 / x; ftz flushes denormal inputs and results to 0, which only a
sigmoid's far tails (|x| > 87) reach, where the sigmoid is 0 or 1 to float32 precision anyway.
Imports triton at import time: import lazily.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["exp2", "rcp", "sigmoid", "prefetch_l2", "fast_on_this_backend"]


def fast_on_this_backend() -> bool:
    """Whether FAST may be passed: not under Triton's interpreter (no inline PTX there)."""
    return os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def exp2(x, FAST: tl.constexpr):
    """2^x in float32: with FAST one MUFU.EX2 (ex2.approx.ftz), else tl.exp2."""
    if FAST:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    return tl.exp2(x)


@triton.jit
def rcp(x, FAST: tl.constexpr):
    """1 / x in float32: with FAST one MUFU.RCP (rcp.approx.ftz, 1 ulp), else Triton's division."""
    if FAST:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    return 1.0 / x


@triton.jit
def sigmoid(x, FAST: tl.constexpr):
    """1 / (1 + 2^(-x log2 e)) in float32; the same formula either way (FAST: the approximate MUFU instructions)."""
    return rcp(1.0 + exp2(x * -1.4426950408889634, FAST), FAST)


@triton.jit
def prefetch_l2(ptrs, FAST: tl.constexpr):
    """A hint to bring the lines at ptrs into L2 (prefetch.global.L2, one instruction per element, no register
    waiting on it); nothing without FAST. ptrs must point into the allocation: the hint is not masked."""
    if FAST:
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )
