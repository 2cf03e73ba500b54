"""What the launchers of the SSD kernels share: stand-ins for absent tensors, zeroed counters the kernels leave
zeroed, the dot precision per dtype, and the grid order (with its decoding in the kernels)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DUMMIES: dict[torch.device, torch.Tensor] = {}


def dummy(device) -> torch.Tensor:
    """Stand-in pointer for an absent optional tensor (its kernel branch is compiled out, so it is never read or
    written): one per device, kept, since a layer's launches ask for ~12 of them and each allocation costs host time
    (the 370M step is host-bound, docs/performance.md). Not kept when first asked for inside a CUDA graph capture
    (it would live in the graph's memory pool)."""
    t = _DUMMIES.get(device)
    if t is None:
        t = torch.empty(1, device=device, dtype=torch.float32)
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            _DUMMIES[t.device] = t
            _DUMMIES[device] = t
    return t


_COUNTERS: dict[tuple, torch.Tensor] = {}


def zeroed_counters(n: int, device, purpose: str) -> torch.Tensor:
    """n int32 counters, zero, for a kernel that leaves them zero when it ends (every counter it counts up is reset
    by the program that reads it last: chained_states.py's tickets and chains, dt_bwd_kernel's finished programs).
    Kept per (purpose, size, device, stream), so that a launch needs no fill kernel before it (three per layer and
    step: ~0.4 ms of a 1.3B step on an H100, docs/ssd_sessions.md session 51); the stream in the key keeps launches
    that could overlap (other streams) on their own counters. A buffer first asked for inside a CUDA graph capture is
    zeroed in the graph and not kept (it lives in the graph's memory pool)."""
    dev = torch.device(device)
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    key = (purpose, n, dev, stream)
    t = _COUNTERS.get(key)
    if t is None:
        t = torch.zeros(n, device=dev, dtype=torch.int32)
        if not (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            _COUNTERS[key] = t
    return t


def dot_precision(x: torch.Tensor) -> str:
    # float32 inputs: full-precision dots (tf32 keeps 10 mantissa bits; float32 runs are for checking, not speed);
    # bf16 / fp16 operands are exact products on the tensor cores anyway.
    return "ieee" if x.dtype == torch.float32 else "tf32"


def grid(outer: int, n1: int, n2: int, inner_first: bool) -> tuple[int, ...]:
    """The launch grid that program_ids decodes (config ``inner_first``)."""
    return (outer * n1 * n2,) if inner_first else (outer, n1, n2)


@triton.jit
def program_ids(n1, n2, INNER_FIRST: tl.constexpr):
    """This program's (outer, i1, i2) ids. INNER_FIRST: a 1-D grid of outer * n1 * n2 programs with i2 varying
    fastest, then i1, so that the programs of one outer index (one batch, chunk and heads: the tiles of one chunk)
    run side by side and read the inputs they share (the chunk's x, dy, states) from L2 rather than DRAM; else the
    grid is (outer, n1, n2), whose programs of one chunk are outer programs apart (the launch order is x first)."""
    if INNER_FIRST:
        pid = tl.program_id(0)
        i2 = pid % n2
        i1 = (pid // n2) % n1
        outer = pid // (n1 * n2)
    else:
        outer = tl.program_id(0)
        i1 = tl.program_id(1)
        i2 = tl.program_id(2)
    return outer, i1, i2
