"""The sum of squares of MANY float32 tensors in ONE Triton launch: the global gradient norm's per-layout sums
(parallelisms/grad_norm.py) on CUDA.

Why: torch's `_foreach_norm` launches per group of tensors and writes a norm per tensor, which the caller then
squares and sums: at the 1.3B's 435 gradients it took 2.4-3.0 ms per step against 1.8 for one launch over a table of
the tensors' addresses (H100, benchmarks/bench_optimizer.py, docs/performance.md sessions 21 and 26), the bytes read
at ~3.1 TB/s.

Each program sums BLOCK elements of one tensor into its own float32 partial sum; the partial sums are then summed by
torch (deterministic: no atomics). `partials_into` writes a subset of tensors' partial sums into the slots a launch over
all of them gives them (components/grad_norm_in_backward.py launches it per group of gradients during the backward, and
sums the one buffer after it: bit for bit this one launch).

The block map (tensor and start of every program) is built once per pattern of sizes and kept; the addresses, new
tensors every step, go to the device every call through pinned host buffers taken in turn (address_table.py: the host
never waits for the GPU). Tensors are addressed from a typed base by their element offsets, so that with every address
16-byte aligned and every size a multiple of 4 (ALIGNED, checked on the host) the loads are 16 bytes wide
(adamw_triton.py says why).
Imports triton at import time: import lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from components.address_table import DeviceAddressTable, addresses

__all__ = ["TableSumOfSquares", "applies", "programs"]

BLOCK = 2048  # elements per program
WARPS = 4


@triton.jit
def _block_sumsq(b, tab_ptr, numel_ptr, blk_tensor_ptr, blk_start_ptr, blk_slot_ptr, base, out_ptr, BLOCK: tl.constexpr,
                 ELEM_BYTES: tl.constexpr, ALIGNED: tl.constexpr, SLOTTED: tl.constexpr):  # fmt: skip
    """out[slot] = the sum of x^2 over elements [start, start + BLOCK) of tensor blk_tensor[b], in float32 (every
    tensor of base's dtype, ELEM_BYTES bytes an element); slot = blk_slot[b] if SLOTTED else b."""
    t = tl.load(blk_tensor_ptr + b)
    start = tl.load(blk_start_ptr + b)
    numel = tl.load(numel_ptr + t)
    off = (tl.load(tab_ptr + t) - base.to(tl.int64, bitcast=True)) // ELEM_BYTES
    if ALIGNED:
        start, numel, off = tl.multiple_of(start, BLOCK), tl.multiple_of(numel, 4), tl.multiple_of(off, 4)
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(base + off + offs, mask=offs < numel, other=0.0).to(tl.float32)
    if SLOTTED:
        slot = tl.load(blk_slot_ptr + b)
    else:
        slot = b
    tl.store(out_ptr + slot, tl.sum(x * x, axis=0))


@triton.jit
def _sumsq_kernel(tab_ptr, numel_ptr, blk_tensor_ptr, blk_start_ptr, blk_slot_ptr, base, out_ptr, n_blocks,
                  BLOCK: tl.constexpr, ELEM_BYTES: tl.constexpr, ALIGNED: tl.constexpr, SLOTTED: tl.constexpr,
                  STRIDED: tl.constexpr):  # fmt: skip
    """_block_sumsq of block program_id, or with STRIDED (a grid of fewer programs than the n_blocks) of blocks
    program_id, program_id + programs, ... in turn."""
    if STRIDED:
        for b in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
            _block_sumsq(b, tab_ptr, numel_ptr, blk_tensor_ptr, blk_start_ptr, blk_slot_ptr, base, out_ptr, BLOCK,
                         ELEM_BYTES, ALIGNED, SLOTTED)  # fmt: skip
    else:
        _block_sumsq(tl.program_id(0), tab_ptr, numel_ptr, blk_tensor_ptr, blk_start_ptr, blk_slot_ptr, base, out_ptr,
                     BLOCK, ELEM_BYTES, ALIGNED, SLOTTED)  # fmt: skip


_ELEM_BYTES = {torch.float32: 4, torch.bfloat16: 2}  # the dtypes taken: a float32 model's gradients, bf16 ones


def applies(tensors: list[torch.Tensor]) -> bool:
    """Whether TableSumOfSquares takes these: CUDA, contiguous, all float32 or all bf16 (the gradients of a float32
    model; those training.grad_dtype stores in bf16)."""
    dtype = tensors[0].dtype if tensors else None
    return dtype in _ELEM_BYTES and all(t.is_cuda and t.dtype == dtype and t.is_contiguous() for t in tensors)


def programs(numel: int, block: int = BLOCK) -> int:
    """How many programs (partial sums) a tensor of `numel` elements takes."""
    return -(-numel // block)


class _BlockMap:
    """The launch of one pattern of sizes: sizes, the program -> (tensor, start) map, the partial sums' buffer (or,
    given `first_slots`, each program's slot in a caller's buffer: tensor i's blocks from first_slots[i] on) and the
    per-call address table."""

    def __init__(self, sizes: tuple[int, ...], device: torch.device, block: int, first_slots: tuple[int, ...] = ()):
        self.numel = torch.tensor(sizes, dtype=torch.int64, device=device)
        starts = [(i, s) for i, n in enumerate(sizes) for s in range(0, n, block)]
        self.programs = len(starts)
        self.blk_tensor = torch.tensor([i for i, _ in starts], dtype=torch.int32, device=device)
        self.blk_start = torch.tensor([s for _, s in starts], dtype=torch.int64, device=device)
        self.blk_slot = (
            torch.tensor([first_slots[i] + s // block for i, s in starts], dtype=torch.int64, device=device)
            if first_slots
            else None
        )
        self.partials = None if first_slots else torch.empty(len(starts), dtype=torch.float32, device=device)
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
        m = self._launch(tensors, None, ())
        if m.programs == 0:  # only empty tensors
            return torch.zeros((), dtype=torch.float32, device=tensors[0].device)
        return m.partials.sum()

    def partials_into(self, tensors: list[torch.Tensor], out: torch.Tensor, first_slots: tuple[int, ...],
                      max_programs: int | None = None) -> None:  # fmt: skip
        """Writes tensor i's partial sums (`programs(numel)` of them) into out[first_slots[i]:]: where `__call__` over
        a list holding these tensors at those slots puts them, computed the same way (`out` float32). max_programs:
        at most this many programs, each summing every max_programs-th block in turn (a launch that leaves most of
        the GPU to kernels beside it); None: a program a block."""
        if len(first_slots) != len(tensors):
            raise ValueError(f"{len(tensors)} tensors take {len(tensors)} first slots, not {len(first_slots)}")
        self._launch(tensors, out, first_slots, max_programs)

    def _launch(self, tensors: list[torch.Tensor], out: torch.Tensor | None, first_slots: tuple[int, ...],
                max_programs: int | None = None) -> _BlockMap:  # fmt: skip
        dtype = tensors[0].dtype if tensors else None
        if dtype not in _ELEM_BYTES or any(t.dtype != dtype or not t.is_contiguous() for t in tensors):
            raise ValueError("TableSumOfSquares takes a non-empty list of contiguous tensors, all float32 or all bf16")
        sizes = tuple(t.numel() for t in tensors)
        key = (sizes, tensors[0].device, dtype, first_slots)
        m = self.maps.get(key)
        if m is None:
            m = self.maps[key] = _BlockMap(sizes, tensors[0].device, self.block, first_slots)
        if m.programs == 0:
            return m
        current = addresses(tensors)
        table = m.address_table.update(current)
        aligned = m.sizes_aligned and all(a % 16 == 0 for a in current)
        slotted = m.blk_slot is not None
        grid = m.programs if max_programs is None else min(m.programs, max_programs)
        _sumsq_kernel[(grid,)](
            table, m.numel, m.blk_tensor, m.blk_start, m.blk_slot if slotted else m.blk_start, tensors[0],
            out if slotted else m.partials, m.programs, BLOCK=self.block, ELEM_BYTES=_ELEM_BYTES[dtype],
            ALIGNED=aligned, SLOTTED=slotted, STRIDED=grid < m.programs, num_warps=self.num_warps,
        )  # fmt: skip
        return m
