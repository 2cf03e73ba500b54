"""A prototype for bench_optimizer.py: the gradients' sum of squares over MANY tensors in ONE Triton launch, through a
table of their addresses (the single-launch AdamW it was written with now runs the optimizer step:
components/adamw_triton.py). Not used by the trainer: parallelisms.grad_norm.global_grad_norm takes 2.4 ms per 1.3B
step against this prototype's 1.8 (H100, docs/performance.md session 21), which would need its layouts (DTensor
shards, pipeline stages, expert groups) before it pays.

    sumsq = SumOfSquares(grads)()           # float32 contiguous tensors -> 0-d float32: every element squared, summed

`check()` compares it with torch on small tensors (the CPU test runs it in Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _sumsq_kernel(tab_ptr, numel_ptr, blk_tensor_ptr, blk_start_ptr, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(blk_tensor_ptr + pid)
    offs = tl.load(blk_start_ptr + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numel_ptr + t)
    x_ptr = tl.load(tab_ptr + t).to(tl.pointer_type(tl.float32))
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + pid, tl.sum(x * x, axis=0))


class SumOfSquares:
    """The address table of a list of float32 tensors and the block -> (tensor, start) map of one launch over all of
    them in blocks of `block` elements; valid while the same tensors live."""

    def __init__(self, tensors: list[torch.Tensor], block: int = 2048, num_warps: int = 4):
        if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors):
            raise ValueError("SumOfSquares takes contiguous float32 tensors")
        dev = tensors[0].device
        self.block, self.num_warps = block, num_warps
        sizes = [t.numel() for t in tensors]
        self.table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=dev)
        self.numel = torch.tensor(sizes, dtype=torch.int64, device=dev)
        starts = [(i, s) for i, n in enumerate(sizes) for s in range(0, n, block)]
        self.blk_tensor = torch.tensor([i for i, _ in starts], dtype=torch.int32, device=dev)
        self.blk_start = torch.tensor([s for _, s in starts], dtype=torch.int64, device=dev)
        self.partials = torch.empty(len(starts), dtype=torch.float32, device=dev)

    def __call__(self) -> torch.Tensor:
        _sumsq_kernel[(len(self.partials),)](
            self.table, self.numel, self.blk_tensor, self.blk_start, self.partials, BLOCK=self.block,
            num_warps=self.num_warps,
        )  # fmt: skip
        return self.partials.sum()


def check(device: str = "cpu") -> float:
    """Relative difference from torch's sum of squares over tensors of several sizes (one not a multiple of the
    block, one of several blocks)."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=gen).to(device) for s in [(33,), (16, 5), (300,), (7, 9)]]
    want = sum((t.double() ** 2).sum().item() for t in tensors)
    return abs(SumOfSquares(tensors, block=64, num_warps=1)().item() - want) / want


if __name__ == "__main__":
    print(check("cuda" if torch.cuda.is_available() else "cpu"))
