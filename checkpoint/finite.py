"""The last guard before a save: a checkpoint never holds a NaN or an infinity.

The training loop already stops (or skips) a step whose loss or global gradient norm is not finite, before the
optimizer step. This catches what it cannot see: a finite gradient that an optimizer step still turns into an
infinity (a huge learning rate, an overflow in a moment estimate). The check runs only on steps that save, over
this rank's local shards (model parameters, buffers and optimizer state), and every rank learns the global answer,
so all ranks refuse the save together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _first_nonfinite(named: list[tuple[str, torch.Tensor]]) -> str | None:
    floats = [(name, _local(t)) for name, t in named if t.is_floating_point()]
    if not floats:
        return None
    finite = torch.stack([t.isfinite().all() for _, t in floats]).tolist()  # one host sync
    for (name, _), ok in zip(floats, finite):
        if not ok:
            return name
    return None


def first_nonfinite_state(model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> str | None:
    """The name of the first tensor of this rank's training state holding a NaN / inf, or None (local, no comms)."""
    named: list[tuple[str, torch.Tensor]] = []
    for part in model_parts:
        named += list(part.named_parameters()) + list(part.named_buffers())
    names = {p: n for part in model_parts for n, p in part.named_parameters()}
    for opt in optimizers:
        for p, state in opt.state.items():
            named += [
                (f"optimizer state {k} of {names.get(p, '?')}", v)
                for k, v in state.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0
            ]
    return _first_nonfinite(named)


def any_rank_nonfinite(local_culprit: str | None, process_group=None) -> str | None:
    """Agree over ranks: a description of one non-finite tensor on some rank, or None when every rank is clean."""
    if not (dist.is_available() and dist.is_initialized()):
        return local_culprit
    culprits = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(culprits, local_culprit, group=process_group)
    for rank, culprit in enumerate(culprits):
        if culprit is not None:
            return f"{culprit} (on rank {dist.get_global_rank(process_group, rank) if process_group else rank})"
    return None
