"""Tied embeddings under pipeline parallel: one logical weight, held by the first and the last stage.

The first stage embeds with `tok_embeddings.weight`; the last stage keeps its own copy under the same name as the
head's weight (models/mamba2/model.py, `embeds_tokens = False`). Invariants, each kept by one mechanism:
    equal at start     init seeds every parameter by its name (models/init.py), the same on both stages
    equal gradients    `sum_tied_embedding_grads`, called after the pipeline's backward and before clipping, sums
                       the copies' gradients: on the rank when one pp rank holds both stages (V schedules), else
                       over a group of exactly the two pp ranks holding them. Under FSDP both copies are sharded
                       the same way over the same dp_shard x cp mesh, so summing local shards is exact.
    counted once       the last stage's copy is left out of the global gradient norm (parallelisms/grad_norm.py)
    equal steps        same value, gradient, clip factor and optimizer state: both copies stay bit-identical
    saved once         both stages write the key "tok_embeddings.weight" with equal values (DCP keeps one writer;
                       the optimizer state likewise), and checkpoint/export.py drops the head's alias
                       "lm_head.weight", so a checkpoint loads under any layout, PP or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from parallelisms.grad_norm import count_in_norm_elsewhere

# The attribute of a stage module that holds a copy of the tied embedding: a TiedEmbeddingCopy.
TIED_COPY_ATTR = "tied_embedding_copy"


@dataclass
class TiedEmbeddingCopy:
    """group: the two pp ranks holding the copies (this rank's pp column); None when this rank holds both."""

    group: dist.ProcessGroup | None


def build_tied_embedding_group(world_mesh, pp: int, holders: list[int]) -> dist.ProcessGroup | None:
    """The process group over the pp ranks in `holders` within this rank's pp column; None for a single holder.

    Collective over the whole world (every rank creates every column's group, in the same order), so call it on
    every rank. With pp = 2 the pp group is exactly that pair and is reused."""
    if len(holders) < 2:
        return None
    if pp == 2:
        return world_mesh["pp"].get_group()
    columns = world_mesh.mesh.reshape(pp, -1)  # [pp, dp_replicate * dp_shard * cp] global ranks
    mine = None
    for col in range(columns.shape[1]):
        ranks = [int(columns[r, col]) for r in holders]
        g = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = g
    return mine


def mark_tied_copy(part: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Record on a stage module (first or last stage of a tied model) that it holds a copy of the tied weight."""
    setattr(part, TIED_COPY_ATTR, TiedEmbeddingCopy(group))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def sum_tied_embedding_grads(model_parts: list[nn.Module]) -> None:
    """Sum the gradients of the tied embedding's copies on this rank's stages (and across the two pp ranks holding
    them), so that every copy's .grad is the whole weight's gradient. A no-op for parts without a copy (no PP, or
    untied). Also leaves the last stage's copy out of the gradient norm (it is marked here, each step, since
    materialisation and FSDP replace the parameter objects built with the stages)."""
    holders = [part for part in model_parts if getattr(part, TIED_COPY_ATTR, None) is not None]
    if not holders:
        return
    weights = [part.tok_embeddings.weight for part in holders]
    for part, w in zip(holders, weights):
        if w.grad is None:
            raise RuntimeError(
                "the tied embedding's copy has no gradient after the pipeline's backward; the "
                "gradient sum must run after schedule.step and before the optimizer's zero_grad"
            )
        if not part.embeds_tokens:  # the head's copy: the first stage's copy stands for both in the norm
            count_in_norm_elsewhere(w)
    grads = [_local(w.grad) for w in weights]
    total = grads[0]
    for g in grads[1:]:  # V schedules: the first and the last stage on this rank
        total.add_(g)
    group = getattr(holders[0], TIED_COPY_ATTR).group
    if group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    for g in grads[1:]:
        g.copy_(total)
