"""Gradient clipping by the global L2 norm over every shard, stage and expert group."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """Clip in place; return the total norm (same value on every rank).

    Gradients may be DTensors on different meshes (dense parameters on the FSDP mesh, experts on the EP
    mesh): each mesh's squared norm is reduced by DTensor, the groups are added, and the sum of squares is
    all-reduced over pipeline stages, each of which holds different parameters.
    """
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    device = torch.device("cpu")
    for g in grads:
        by_mesh[g.device_mesh if isinstance(g, DTensor) else None].append(g)
        device = g.to_local().device if isinstance(g, DTensor) else g.device
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for group_grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group_grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=pp_group)
    total = total_sq.sqrt()
    if max_norm > 0 and math.isfinite(total.item()):
        # One call per mesh: a foreach multiply cannot mix DTensors of different meshes.
        params_by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
        for p in parameters:
            if p.grad is not None:
                params_by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
        for group_params in params_by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group_params, max_norm, total)
    return total
