"""Expert parallel (EP): each rank of an ep group holds E/ep routed experts; tokens travel to them by all-to-all.

EP borrows its ranks from dp_shard x cp (`ParallelDims.ep_mesh` = (pp, dp_replicate, efsdp, ep), ep innermost):
an ep group is ep consecutive ranks that read different data, so every rank routes its own tokens and the
all-to-all carries each token copy to the rank that owns its expert. Rank r of the group owns the contiguous
experts [r*E/ep, (r+1)*E/ep).

The seam is `MoE.experts` (models/hybrid/moe.py), called once per forward as
    experts(x_sorted_TD [T*K, D], counts_E [E] int64) -> y_sorted_TD [T*K, D].
apply_expert_parallel keeps that module (and so its parameter names: checkpoints do not depend on ep), turns
w1 / w2 / w3 into DTensors on the ep mesh with Shard(0) (each rank stores E/ep experts; DCP reshards them to any
other ep, and models/init.py's full-tensor init gives every layout the same experts), and swaps its class for
ExpertParallelGroupedExperts, whose forward is
    1. all-to-all the counts: counts_E [E] -> recv_counts [ep, E/ep] (rows from source rank i for local expert e);
    2. all-to-all the token copies: x_sorted [T*K, D] -> x_recv [sum recv_counts, D], grouped by source rank;
    3. regroup by local expert, run the local experts, undo the regrouping;
    4. all-to-all the outputs back: [sum recv_counts, D] -> [T*K, D], the caller's order.
Dropless: splits are the true counts (one host sync per layer for the split sizes).

Gradients: each rank's loss is multiplied by dp_cp (train.py) so that an FSDP average over dp_cp ranks is the
exact sum. An expert's local gradient already sums the token gradients of all ep ranks of its group (the
backward all-to-all brings them home); FSDP then averages it over the efsdp x dp_replicate = dp_cp / ep replicas
of that expert, which would leave a factor ep too many. The forward therefore hands the experts their local
weights through `_ScaleGrad` (identity forward, gradient x 1/ep). Doing it in autograd rather than with FSDP's
set_gradient_divide_factor keeps gloo working (that uses ReduceOp.PREMUL_SUM, which gloo lacks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from models.hybrid.moe import GroupedExperts, MoE


# ---------------------------------------------------------------------------------------------------- checks
def validate_expert_parallel(model_args, pdims) -> list[str]:
    """Problems with expert parallel for these sizes, each naming the key and the fix (empty when fine)."""
    if pdims.ep <= 1:
        return []
    errs = []
    if "E" not in model_args.layer_types:
        errs.append(
            f"parallelism.expert_parallel_degree={pdims.ep} but the model has no MoE ('E') layers; "
            "set expert_parallel_degree 1"
        )
    elif model_args.moe_num_experts % pdims.ep:
        errs.append(
            f"parallelism.expert_parallel_degree={pdims.ep} must divide model.moe_num_experts="
            f"{model_args.moe_num_experts} (each ep rank holds the same number of experts)"
        )
    if (pdims.dp_shard * pdims.cp) % pdims.ep:
        errs.append(
            f"parallelism.expert_parallel_degree={pdims.ep} must divide data_parallel_shard_degree x "
            f"context_parallel_degree = {pdims.dp_shard * pdims.cp} (EP borrows those ranks)"
        )
    return errs


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale` (the 1/ep of the module docstring)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


# ------------------------------------------------------------------------------------------------ all-to-all
class _AllToAll(torch.autograd.Function):
    """y = all_to_all(x): x [sum(send_splits), D] -> y [sum(recv_splits), D]; row block i of x goes to rank i of
    `group`, row block j of y came from rank j. Backward: the inverse all-to-all of the gradient,
    [sum(recv_splits), D] -> [sum(send_splits), D]."""

    @staticmethod
    def forward(ctx, x_TD, send_splits: list[int], recv_splits: list[int], group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return _all_to_all(x_TD, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad_TD):
        return _all_to_all(grad_TD, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


def _all_to_all(x_TD: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """[sum(send_splits), D] -> [sum(recv_splits), D] (no autograd)."""
    x_TD = x_TD.contiguous()
    out = x_TD.new_empty((sum(recv_splits), *x_TD.shape[1:]))
    dist.all_to_all_single(out, x_TD, output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group)
    return out


def all_to_all_tokens(x_TD: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Autograd-aware all-to-all of rows: [sum(send_splits), D] -> [sum(recv_splits), D]."""
    return _AllToAll.apply(x_TD, send_splits, recv_splits, group)


def exchange_counts(counts_E: torch.Tensor, ep: int, group) -> torch.Tensor:
    """counts_E [E] int64 (this rank's rows per global expert) -> recv_counts [ep, E/ep] int64, where
    recv_counts[i, e] = rows rank i sends to this rank's local expert e. Sent first, so that the token all-to-all
    knows its split sizes."""
    recv = torch.empty_like(counts_E)
    dist.all_to_all_single(recv, counts_E.contiguous(), group=group)
    return recv.view(ep, -1)


def _source_major_to_expert_major(recv_counts_IE: torch.Tensor, total: int) -> torch.Tensor:
    """Row indices that reorder the received rows (blocks (source i, local expert e), i-major) into e-major
    order (stable within a block): x_by_expert = x_recv[index]. `total` = recv_counts_IE.sum(), known on the host
    already (the all-to-all's split sizes), so that building the index needs no second host sync."""
    ep, n_local = recv_counts_IE.shape
    flat = recv_counts_IE.reshape(-1)
    start = flat.cumsum(0) - flat  # block (i, e) starts here in the received buffer
    order = torch.arange(ep * n_local, device=flat.device).view(ep, n_local).t().reshape(-1)  # e-major blocks
    sizes, starts = flat[order], start[order]
    block_of_row = torch.repeat_interleave(torch.arange(order.numel(), device=flat.device), sizes, output_size=total)
    offset_in_block = torch.arange(total, device=flat.device) - (sizes.cumsum(0) - sizes)[block_of_row]
    return starts[block_of_row] + offset_in_block


class ExpertParallelGroupedExperts(GroupedExperts):
    """A GroupedExperts holding this ep rank's E/ep experts; forward takes the GLOBAL sorted rows and counts
    (the seam's signature) and returns the global rows' outputs, exchanging tokens with the other ep ranks."""

    ep_group = None
    ep_size = 1

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (w1, w2, w3) [E/ep, ...], their gradient scaled by 1/ep (see the module docstring)."""
        return tuple(_ScaleGrad.apply(w, 1.0 / self.ep_size) for w in super().local_weights())

    def forward(self, x_sorted_TD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        ep, group = self.ep_size, self.ep_group
        counts_E = num_tokens_per_expert_E.to(torch.int64)
        if counts_E.numel() != self.num_experts:
            raise ValueError(
                f"expert parallel: got counts for {counts_E.numel()} experts, expected the global {self.num_experts}"
            )
        recv_counts_IE = exchange_counts(counts_E, ep, group)
        splits = torch.cat([counts_E.view(ep, -1).sum(1), recv_counts_IE.sum(1)]).tolist()  # one host sync
        send_splits, recv_splits = splits[:ep], splits[ep:]
        # [T*K, D] -> [sum recv_splits, D]: rows from every ep rank for this rank's experts, by source rank
        x_recv_TD = all_to_all_tokens(x_sorted_TD, send_splits, recv_splits, group)
        if recv_counts_IE.shape[1] > 1 and ep > 1:
            index = _source_major_to_expert_major(recv_counts_IE, sum(recv_splits))
            y_local_TD = super().forward(x_recv_TD[index], recv_counts_IE.sum(0))
            y_recv_TD = torch.empty_like(y_local_TD).index_copy(0, index, y_local_TD)
        else:
            y_recv_TD = super().forward(x_recv_TD, recv_counts_IE.sum(0))
        # [sum recv_splits, D] -> [T*K, D]: outputs back to the ranks (and rows) their tokens came from
        return all_to_all_tokens(y_recv_TD, recv_splits, send_splits, group)


# --------------------------------------------------------------------------------------------------- apply
def _shard_over_ep(param: nn.Parameter, ep_mesh) -> nn.Parameter:
    """[E, ...] parameter -> DTensor on `ep_mesh` with Shard(0) (local [E/ep, ...]); works on the meta device."""
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    n_local = param.shape[0] // ep
    local = param.detach()[rank * n_local : (rank + 1) * n_local].clone()
    dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())
    return nn.Parameter(dt, requires_grad=param.requires_grad)


def apply_expert_parallel(model: nn.Module, pdims) -> list[GroupedExperts]:
    """Split every MoE layer's routed experts over pdims.ep_mesh["ep"] (before activation checkpointing, compile
    and FSDP; the model may be on the meta device). Returns the converted expert modules."""
    if pdims.ep <= 1:
        return []
    ep_mesh = pdims.ep_mesh["ep"]
    group = ep_mesh.get_group()
    converted = []
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if not isinstance(module, MoE) or not isinstance(experts, GroupedExperts):
            continue
        if isinstance(experts, ExpertParallelGroupedExperts):
            continue
        # ep divides num_experts: validate_expert_parallel, from configs/checks.py
        for pname in ("w1", "w2", "w3"):
            setattr(experts, pname, _shard_over_ep(getattr(experts, pname), ep_mesh))
        experts.__class__ = ExpertParallelGroupedExperts
        experts.ep_group, experts.ep_size = group, pdims.ep
        experts.num_local_experts = experts.num_experts // pdims.ep
        converted.append(experts)
    return converted


def expert_modules(model: nn.Module) -> list[ExpertParallelGroupedExperts]:
    """The expert-parallel expert modules of `model` (for FSDP to shard over the EP mesh)."""
    return [m for m in model.modules() if isinstance(m, ExpertParallelGroupedExperts)]
