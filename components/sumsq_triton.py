"""The sum of squares of MANY float32 tensors in ONE Triton launch: the global gradient norm's per-layout sums
(parallelisms/grad_norm.py) on CUDA.

Why: torch's `_foreach_norm` launches per group of tensors and writes a norm per tensor, which the caller then
squares and sums: at the 1.3B's 435 gradients it took 2.4-3.0 ms per step against 1.8 for one launch over a table of
the tensors' addresses (H100, benchmarks/bench_optimizer.py, docs/ssd_sessions.md sessions 21 and 26), the bytes read
at ~3.1 TB/s.

Each program sums BLOCK elements of one tensor into its own float32 partial sum; the partial sums are then summed by
torch (deterministic: no atomics). The block map (tensor and start of every program) is built once per pattern of
sizes and kept; the addresses, new tensors every step, go to the device every call through pinned host buffers taken
in turn (address_table.py: the host never waits for the GPU). Tensors are addressed from a typed base by
their element offsets, so that with every address 16-byte aligned and every size a multiple of 4 (ALIGNED, checked
on the host) the loads are 16 bytes wide (adamw_triton.py says why).
Imports triton at import time: import lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from components.address_table import DeviceAddressTable, addresses

__all__ = ["TableSumOfSquares", "applies"]

BLOCK = 2048  # elements per program
WARPS = 4


@triton.jit
def _sumsq_kernel(tab_ptr, numel_ptr, blk_tensor_ptr, blk_start_ptr, base, out_ptr, BLOCK: tl.constexpr,
                  ELEM_BYTES: tl.constexpr, ALIGNED: tl.constexpr):  # fmt: skip
    """out[pid] = the sum of x^2 over elements [start, start + BLOCK) of tensor blk_tensor[pid], in float32 (every
    tensor of base's dtype, ELEM_BYTES bytes an element)."""
    pid = tl.program_id(0)
    t = tl.load(blk_tensor_ptr + pid)
    start = tl.load(blk_start_ptr + pid)
    numel = tl.load(numel_ptr + t)
    off = (tl.load(tab_ptr + t) - base.to(tl.int64, bitcast=True)) // ELEM_BYTES
    if ALIGNED:
        start, numel, off = tl.multiple_of(start, BLOCK), tl.multiple_of(numel, 4), tl.multiple_of(off, 4)
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(base + off + offs, mask=offs < numel, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(x * x, axis=0))


_ELEM_BYTES = {torch.float32: 4, torch.bfloat16: 2}  # the dtypes taken: a float32 model's gradients, bf16 ones


def applies(tensors: list[torch.Tensor]) -> bool:
    """Whether TableSumOfSquares takes these: CUDA, contiguous, all float32 or all bf16 (the gradients of a float32
    model; those training.grad_dtype stores in bf16)."""
    dtype = tensors[0].dtype if tensors else None
    return dtype in _ELEM_BYTES and all(t.is_cuda and t.dtype == dtype and t.is_contiguous() for t in tensors)


class _BlockMap:
    """The launch of one pattern of sizes: sizes, the program -> (tensor, start) map, the partial sums' buffer and
    the per-call address table."""

    def __init__(self, sizes: tuple[int, ...], device: torch.device, block: int):
        self.numel = torch.tensor(sizes, dtype=torch.int64, device=device)
        starts = [(i, s) for i, n in enumerate(sizes) for s in range(0, n, block)]
        self.blk_tensor = torch.tensor([i for i, _ in starts], dtype=torch.int32, device=device)
        self.blk_start = torch.tensor([s for _, s in starts], dtype=torch.int64, device=device)
        self.partials = torch.empty(len(starts), dtype=torch.float32, device=device)
        self.sizes_aligned = all(n % 4 == 0 for n in sizes)
        self.address_table = DeviceAddressTable(len(sizes), device)


class TableSumOfSquares:
    """Callable: a list of contiguous CUDA tensors, all float32 or all bf16 -> the 0-d float32 sum of all their
    elements squared (summed in float32)."""

    def __init__(self, block: int = BLOCK, num_warps: int = WARPS):
        self.block, self.num_warps = block, num_warps
        self.maps: dict[tuple, _BlockMap] = {}

    def __call__(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        # (CPU tensors too, for Triton's interpreter in the tests; `applies` is what the trainer asks.)
        dtype = tensors[0].dtype if tensors else None
        if dtype not in _ELEM_BYTES or any(t.dtype != dtype or not t.is_contiguous() for t in tensors):
            raise ValueError("TableSumOfSquares takes a non-empty list of contiguous tensors, all float32 or all bf16")
        sizes = tuple(t.numel() for t in tensors)
        key = (sizes, tensors[0].device, dtype)
        m = self.maps.get(key)
        if m is None:
            m = self.maps[key] = _BlockMap(sizes, tensors[0].device, self.block)
        if len(m.partials) == 0:  # only empty tensors
            return torch.zeros((), dtype=torch.float32, device=tensors[0].device)
        current = addresses(tensors)
        table = m.address_table.update(current)
        aligned = m.sizes_aligned and all(a % 16 == 0 for a in current)
        _sumsq_kernel[(len(m.partials),)](
            table, m.numel, m.blk_tensor, m.blk_start, tensors[0], m.partials, BLOCK=self.block,
            ELEM_BYTES=_ELEM_BYTES[dtype], ALIGNED=aligned, num_warps=self.num_warps,
        )  # fmt: skip
        return m.partials.sum()
