"""Gradient clipping by the global L2 norm over every shard, stage and expert group."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

# Set on a parameter whose gradient equals one that the norm already counts on another stage (the last stage's copy
# of a tied embedding, parallelisms/tied_weights.py): it is clipped but not counted.
_COUNTED_ELSEWHERE = "_grad_norm_counted_elsewhere"


def count_in_norm_elsewhere(param: torch.Tensor) -> None:
    """Leave `param` out of the global norm (it is still clipped): its gradient is a copy of a counted one."""
    setattr(param, _COUNTED_ELSEWHERE, True)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip in place; return the total norm (a device tensor, the same value on every rank; no host sync).

    global_grad_norm, then clip_grads_ with it. An infinite norm scales the gradients to zero; a NaN one propagates
    (the trainer skips or stops on a non-finite norm before any optimizer update).
    """
    parameters = list(parameters)
    total = global_grad_norm(parameters, pp_group)
    clip_grads_(parameters, max_norm, total)
    return total


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (its own storage: updating it in place updates the DTensor), a plain tensor as it is.
    The attribute, not to_local(): that is an autograd Function call, ~10 us each, and a step makes ~4 per parameter
    (the optimizer's parameters, gradients and moments, the norm's gradients)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _grads_by_layout(parameters, counted_only: bool):
    """{(mesh, placements) or None: local gradient shards}, and their device (cpu without gradients)."""
    by_layout: dict[object, list[torch.Tensor]] = defaultdict(list)
    device = torch.device("cpu")
    for p in parameters:
        g = p.grad
        if g is None or (counted_only and getattr(p, _COUNTED_ELSEWHERE, False)):
            continue
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        local = local_shard(g)
        by_layout[key].append(local)
        device = local.device
    return by_layout, device


_table_sumsq = None  # components.sumsq_triton.TableSumOfSquares, made at the first CUDA call


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 0-d float32 sum of every element of `grads` squared, in float32: on CUDA contiguous tensors one Triton
    launch per gradient dtype (float32; bf16 with training.grad_dtype) over them all (components/sumsq_triton.py: 1.8
    against 2.4-3.0 ms at the 1.3B), else torch's per-tensor norms in float32, squared and summed."""
    global _table_sumsq
    if grads[0].is_cuda:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            by_dtype[g.dtype].append(g)
        try:
            from components import sumsq_triton  # lazy: imports triton
        except ImportError:  # no Triton: torch's norms
            sumsq_triton = None
        if sumsq_triton is not None and all(sumsq_triton.applies(gs) for gs in by_dtype.values()):
            if _table_sumsq is None:
                _table_sumsq = sumsq_triton.TableSumOfSquares()
            sums = [_table_sumsq(gs) for gs in by_dtype.values()]
            return sums[0] if len(sums) == 1 else torch.stack(sums).sum()
    return torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum()


@torch.no_grad()
def global_grad_norm(parameters, pp_group=None) -> torch.Tensor:
    """The L2 norm of every gradient of the model: a 0-d float32 device tensor, the same on every rank; no host sync.

    Gradients may be DTensors of different layouts (dense parameters sharded over the FSDP mesh, experts over the EP
    mesh, replicated over HSDP's replicate dim): per layout, the squared norm of the local shards, summed over the
    mesh dims the gradient is sharded on (a 0-d DTensor, Partial there, made whole: one all-reduce per layout, no
    DTensor dispatch per gradient). Then the sum over pipeline stages, each of which holds different parameters (a
    tied embedding's second copy, marked by `count_in_norm_elsewhere`, is left out of the sum).
    """
    by_layout, device = _grads_by_layout(parameters, counted_only=True)
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for layout, grads in by_layout.items():
        local_sq = _sum_of_squares(grads)
        if layout is not None:
            mesh, placements = layout
            partial = [Partial() if p.is_shard() else Replicate() for p in placements]
            local_sq = DTensor.from_local(local_sq, mesh, partial, run_check=False).full_tensor()
        total_sq = total_sq + local_sq
    if pp_group is not None:
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=pp_group)
    return total_sq.sqrt()


@torch.no_grad()
def clip_grads_(parameters, max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / (total + 1e-6)) in place (nothing for max_norm <= 0), on the local
    shards (one foreach multiply whatever their layouts; the norm already counted every shard)."""
    grads = [local_shard(p.grad) for p in parameters if p.grad is not None]
    if max_norm > 0 and grads:
        torch._foreach_mul_(grads, (max_norm / (total + 1e-6)).clamp(max=1.0))


def clip_divisor(max_norm: float, total: torch.Tensor) -> torch.Tensor | None:
    """What the gradients are divided by to clip them to max_norm: max(1, (total + 1e-6) / max_norm), a 0-d device
    tensor (None for max_norm <= 0). Fused AdamW takes it as `grad_scale` and divides inside its kernel, so that the
    clipping costs no pass over the gradients of its own (clip_grads_ multiplies by the inverse: the same clipping,
    rounded differently)."""
    if max_norm <= 0:
        return None
    return ((total + 1e-6) / max_norm).clamp(min=1.0)
