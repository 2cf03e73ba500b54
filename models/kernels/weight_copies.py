"""16-bit copies of float32 weights that the optimizer keeps current, so that a step's products read each weight in
the compute dtype without casting it first.

Why: under bf16 autocast with float32 weights (one GPU, DDP), every product casts its weight: at the 1.3B shape
in_proj in the forward, out_proj in the forward and again in the backward, lm_head once, 147 cast kernels and 3.9 ms
of a 359 ms step (H100, docs/ssd_sessions.md session 25). Our AdamW kernel (components/adamw_triton.py) reads every
weight anyway: writing its bf16 copy beside the float32 update costs 2 bytes per element (~1 ms at 1.3B), and the
casts go away. Megatron keeps 16-bit parameters beside float32 main weights for the same reason.

Contract: `compute_weight(w, dtype)` is `w.to(dtype)`, the same values (round to nearest even), served from w's copy
when the copy is current: made from w at w's present version (`w._version`, which every in-place torch op on w bumps:
a checkpoint load, an init, torch's own optimizers). The optimizer kernel updates a weight and its current copy
together without a torch op, so the version stays and the copy stays current; a copy that is not current is left
alone by it and remade (in place) by the next `compute_weight`. So a stale copy is never read.

Copies are made only after `enable(dtype)` (the optimizer that keeps them current calls it: with any other optimizer
a copy would be remade every step and only cost memory), for float32 nn.Parameters on CUDA, outside torch.compile's
tracing (the compiled block keeps the cast it traced; the version check is host Python). Under CUDA-graph capture
(training.cuda_graph) a current copy is read and none is made (the graph would own it, unseen by the optimizer): the
graph reads the copies at their addresses, and components/cuda_graph.py remakes a stale one in place before a replay.
The copies hold 2 bytes per weight element for the life of the run (2.5 GB at 1.3B), against casts that lived from a
product's forward to its backward.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["enable", "compute_weight", "copy_of", "current_copies", "copies_dtype"]

_DTYPE: torch.dtype | None = None  # the copies' dtype; None: no copies are made
# Parameter -> (copy, the weight's version when it was made); keyed by identity (a tensor's == is elementwise)
_COPIES = WeakIdKeyDictionary()


def enable(dtype: torch.dtype | None) -> None:
    """Make copies in `dtype` (bf16 or fp16) from now on; None stops making them and drops every copy."""
    global _DTYPE
    if dtype not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"weight copies are kept in bfloat16 or float16, not {dtype}")
    if dtype != _DTYPE:
        _COPIES.clear()
    _DTYPE = dtype


def copies_dtype() -> torch.dtype | None:
    return _DTYPE


def _wants_copy(w: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        _DTYPE is not None
        and dtype == _DTYPE
        and type(w) is torch.nn.Parameter
        and w.dtype == torch.float32
        and w.is_cuda
        and not torch.compiler.is_compiling()
    )


def copy_of(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """w's current copy in `dtype` (made or remade now if needed), or None where no copy is kept (then cast)."""
    if not _wants_copy(w, dtype):
        return None
    entry = _COPIES.get(w)
    if entry is not None and entry[1] == w._version:
        return entry[0]
    if torch.cuda.is_current_stream_capturing():  # a copy made now would be the graph's, unseen by the optimizer
        return None
    with torch.no_grad():
        if entry is None or entry[0].shape != w.shape:
            copy = w.detach().to(dtype)
        else:  # remade in place: its address stays (the optimizer's tables hold it)
            copy = entry[0]
            copy.copy_(w.detach())
    _COPIES[w] = (copy, w._version)
    return copy


def compute_weight(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w in `dtype` (no autograd history): its current copy where one is kept, else a cast."""
    copy = copy_of(w, dtype)
    return copy if copy is not None else w.detach().to(dtype)


def current_copies(params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """For the optimizer that keeps them: each parameter's copy if it is current, else None (not to be written)."""
    out = []
    for p in params:
        entry = _COPIES.get(p)
        out.append(entry[0] if entry is not None and entry[1] == p._version else None)
    return out
