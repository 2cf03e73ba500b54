"""Plain data parallelism (DDP semantics) when dp_replicate is the only parallelism: whole model on every rank,
one all-reduce of every gradient per optimizer step.

torchtitan applies DDP in the same case (dp_replicate > 1, dp_shard = cp = 1, no pipeline). We reduce ourselves
instead of using torch's DDP / `replicate`, whose reductions are autograd hooks that fire inside backward: a CUDA
graph of the backward (training.cuda_graph) cannot capture those. Every parameter's .grad is a view into one
flat buffer, so the reduction is ONE collective after the last microbatch, outside any graph. It does not
overlap with backward; its cost is 2 (n-1)/n x bytes / bus bandwidth, e.g. ~7 ms for the 370M's 1.5 GB of fp32
gradients on 4 H200s (~340 GB/s at this size, docs/performance.md), against a step of hundreds of ms.

    grads = FlatGradients(params, dp_group)   # after any checkpoint load: .grad become views of one buffer
    ... forward / backward of every microbatch (gradients accumulate into the views) ...
    grads.all_reduce()                        # this rank's gradient -> the mean over the dp ranks
    optimizer.step(); optimizer.zero_grad(set_to_none=False)   # keep the views

Memory: every rank holds the whole model, its gradients and its optimizer state (what FSDP shards); use FSDP
(data_parallel_shard_degree) when they do not fit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn


class FlatGradients:
    """The .grad of `params` as views into one flat buffer, averaged over `group` by one all-reduce."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup):
        params = [p for p in params if p.requires_grad]
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"FlatGradients needs parameters of one dtype; got {sorted(map(str, dtypes))}")
        self.params, self.group = params, group
        self.world = dist.get_world_size(group)
        self.flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            view = self.flat[offset : offset + p.numel()].view_as(p)
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view
            self.views.append(view)
            offset += p.numel()

    @torch.no_grad()
    def all_reduce(self) -> None:
        """flat [N] (this rank's accumulated gradient) -> flat [N] (the mean over the group's ranks), in place.

        FSDP averages gradients over the data-parallel ranks too, so the trainer's loss scaling is the same
        for both.
        """
        for p, view in zip(self.params, self.views):
            if p.grad is not view:
                raise RuntimeError(
                    "a parameter's .grad is no longer its view of the flat gradient buffer (was it "
                    "set to None? zero gradients with optimizer.zero_grad(set_to_none=False))"
                )
        dist.all_reduce(self.flat, group=self.group)
        self.flat.div_(self.world)
