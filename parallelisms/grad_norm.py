"""Gradient clipping by the global L2 norm over every shard, stage and expert group."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# Set on a parameter whose gradient equals one that the norm already counts on another stage (the last stage's copy
# of a tied embedding, parallelisms/tied_weights.py): it is clipped but not counted.
_COUNTED_ELSEWHERE = "_grad_norm_counted_elsewhere"


def count_in_norm_elsewhere(param: torch.Tensor) -> None:
    """Leave `param` out of the global norm (it is still clipped): its gradient is a copy of a counted one."""
    setattr(param, _COUNTED_ELSEWHERE, True)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip in place; return the total norm (a device tensor, the same value on every rank; no host sync).

    Gradients may be DTensors on different meshes (dense parameters on the FSDP mesh, experts on the EP
    mesh): each mesh's squared norm is reduced by DTensor, the groups are added, and the sum of squares is
    all-reduced over pipeline stages, each of which holds different parameters (a tied embedding's second copy,
    marked by `count_in_norm_elsewhere`, is clipped but left out of the sum). Clipping then runs once per
    mesh, since a foreach multiply cannot mix DTensors of different meshes. An infinite norm scales the
    gradients to zero; a NaN one propagates (the trainer stops on the NaN loss before saving).
    """
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    counted_by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    device = torch.device("cpu")
    for p in parameters:
        if p.grad is not None:
            is_dtensor = isinstance(p.grad, DTensor)
            mesh = p.grad.device_mesh if is_dtensor else None
            by_mesh[mesh].append(p)
            if not getattr(p, _COUNTED_ELSEWHERE, False):
                counted_by_mesh[mesh].append(p)
            device = p.grad.to_local().device if is_dtensor else p.grad.device
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for params in counted_by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0:
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
