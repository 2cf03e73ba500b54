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

    global_grad_norm, then clip_grads_ with it. An infinite norm scales the gradients to zero; a NaN one propagates
    (the trainer skips or stops on a non-finite norm before any optimizer update).
    """
    parameters = list(parameters)
    total = global_grad_norm(parameters, pp_group)
    clip_grads_(parameters, max_norm, total)
    return total


def _grads_by_mesh(parameters, counted_only: bool) -> tuple[dict[object, list[torch.Tensor]], torch.device]:
    """Parameters with a gradient grouped by their gradient's mesh (None: plain tensors), and the device."""
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    device = torch.device("cpu")
    for p in parameters:
        if p.grad is not None:
            is_dtensor = isinstance(p.grad, DTensor)
            device = p.grad.to_local().device if is_dtensor else p.grad.device
            if not (counted_only and getattr(p, _COUNTED_ELSEWHERE, False)):
                by_mesh[p.grad.device_mesh if is_dtensor else None].append(p)
    return by_mesh, device


@torch.no_grad()
def global_grad_norm(parameters, pp_group=None) -> torch.Tensor:
    """The L2 norm of every gradient of the model: a 0-d float32 device tensor, the same on every rank; no host sync.

    Gradients may be DTensors on different meshes (dense parameters on the FSDP mesh, experts on the EP mesh): each
    mesh's squared norm is reduced by DTensor, the groups are added, and the sum of squares is all-reduced over
    pipeline stages, each of which holds different parameters (a tied embedding's second copy, marked by
    `count_in_norm_elsewhere`, is left out of the sum).
    """
    counted_by_mesh, device = _grads_by_mesh(parameters, counted_only=True)
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for params in counted_by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float() ** 2
    if pp_group is not None:
        dist.all_reduce(total_sq, op=dist.ReduceOp.SUM, group=pp_group)
    return total_sq.sqrt()


@torch.no_grad()
def clip_grads_(parameters, max_norm: float, total: torch.Tensor) -> None:
    """Scale every gradient by min(1, max_norm / (total + 1e-6)) in place (nothing for max_norm <= 0); once per mesh,
    since a foreach multiply cannot mix DTensors of different meshes."""
    if max_norm <= 0:
        return
    by_mesh, _ = _grads_by_mesh(parameters, counted_only=False)
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)


def clip_divisor(max_norm: float, total: torch.Tensor) -> torch.Tensor | None:
    """What the gradients are divided by to clip them to max_norm: max(1, (total + 1e-6) / max_norm), a 0-d device
    tensor (None for max_norm <= 0). Fused AdamW takes it as `grad_scale` and divides inside its kernel, so that the
    clipping costs no pass over the gradients of its own (clip_grads_ multiplies by the inverse: the same clipping,
    rounded differently)."""
    if max_norm <= 0:
        return None
    return ((total + 1e-6) / max_norm).clamp(min=1.0)
