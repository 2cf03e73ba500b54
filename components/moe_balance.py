"""MoE load balancing across the step, in one place: the auxiliary losses' share per microbatch, and after the
optimizer step the global expert loads, the auxiliary-loss-free bias update and the load metric."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from models.hybrid.moe import MoE


class MoEBalancer:
    """Every MoE layer of this rank's model parts. Collective in `after_step` (dp_cp, then pp)."""

    def __init__(self, model_parts: list[nn.Module], model_has_moe: bool, dp_cp_group=None, pp_group=None):
        # model_has_moe: of the whole model. A pipeline stage without MoE layers still joins the pp reduction.
        self.layers = [m for part in model_parts for m in part.modules() if isinstance(m, MoE)]
        self.model_has_moe = model_has_moe
        self.dp_cp_group, self.pp_group = dp_cp_group, pp_group

    def set_microbatches(self, n: int) -> None:
        """The aux / z losses are means over the step's n microbatches (and, by FSDP's average, over ranks)."""
        for moe in self.layers:
            moe.aux_loss_scale = 1.0 / n

    def after_step(self, skip: torch.Tensor | bool = False) -> torch.Tensor | None:
        """After the optimizer step: the global expert loads, the bias update, the load metric.

        Each MoE layer counted the tokens routed to each expert on this rank; the sum over dp x cp (all-reduce of
        [E] counts) is the global batch's load, identical on every rank, so the bias update keeps the replicas
        equal. A skipped step (`skip` True, or 1.0 in a 0-d device tensor when the optimizer skips on the device):
        the counts are dropped and the bias is left as it is. Returns the
        busiest expert's load over the mean, worst over the model's MoE layers (max over pipeline stages: a 0-d
        all-reduce), as a device tensor read only on logging steps; None without MoE layers.
        """
        if not self.model_has_moe:
            return None
        if self.layers and self._batchable():
            worst = self._after_step_batched(skip)
        else:
            worst = self._after_step_per_layer(skip)
        if self.pp_group is not None:  # stages hold different layers: report the worst of the whole model
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.pp_group)
        return worst

    def _batchable(self) -> bool:
        """Every layer has the same number of experts, balance coefficient and device (one [L, E] tensor)."""
        first = self.layers[0]
        return all(
            moe.num_experts == first.num_experts
            and moe.load_balance_coeff == first.load_balance_coeff
            and moe.tokens_per_expert.device == first.tokens_per_expert.device
            for moe in self.layers
        )

    def _after_step_batched(self, skip: torch.Tensor | bool) -> torch.Tensor:
        """The per-layer math of `_after_step_per_layer` / MoE.update_expert_bias on all layers at once ([L, E]
        rows, each reduced on its own: the same values), in a fixed number of launches instead of ~17 per layer
        (a host-bound step pays each launch)."""
        counts = torch.stack([moe.tokens_per_expert for moe in self.layers])  # [L, E] int64
        if self.dp_cp_group is not None:
            dist.all_reduce(counts, group=self.dp_cp_group)  # every layer's counts in one all-reduce
        load = counts.float()
        mean = load.mean(1, keepdim=True)
        worst = torch.cat([load.new_zeros(1), (load.amax(1, keepdim=True) / mean.clamp(min=1)).view(-1)]).max()
        coeff = self.layers[0].load_balance_coeff
        if coeff and (isinstance(skip, torch.Tensor) or not skip):
            delta = coeff * torch.sign(mean - load)
            update = delta - delta.mean(1, keepdim=True)
            if isinstance(skip, torch.Tensor):
                update = update * (1.0 - skip).to(update.dtype)
            torch._foreach_add_([moe.expert_bias for moe in self.layers], list(update.unbind(0)))
        torch._foreach_zero_([moe.tokens_per_expert for moe in self.layers])
        return worst

    def _after_step_per_layer(self, skip: torch.Tensor | bool) -> torch.Tensor:
        ratios = [torch.zeros((), device=self._device())]
        if self.dp_cp_group is not None and self.layers:
            # every layer's [E] counts in one all-reduce (one per layer was 30 NCCL launches per step for EP2 on the
            # hybrid MoE 1B, 26 ms of exposed int64 all-reduces in a profiled step: docs/performance.md, issue 14)
            counts = torch.cat([moe.tokens_per_expert for moe in self.layers])
            dist.all_reduce(counts, group=self.dp_cp_group)
            sizes = [moe.tokens_per_expert.numel() for moe in self.layers]
            for moe, summed in zip(self.layers, counts.split(sizes), strict=True):
                moe.tokens_per_expert.copy_(summed)
        for moe in self.layers:
            load = moe.tokens_per_expert.float()
            ratios.append(load.max() / load.mean().clamp(min=1))
            if isinstance(skip, torch.Tensor):
                moe.update_expert_bias(apply=1.0 - skip)
            elif not skip:
                moe.update_expert_bias()
            else:
                moe.tokens_per_expert.zero_()
        return torch.stack(ratios).max()

    def _device(self) -> torch.device:
        if self.layers:
            return self.layers[0].tokens_per_expert.device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
