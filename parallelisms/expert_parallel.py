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
weights through `_LocalWeights` (DTensor.to_local of w1 / w2 / w3 in one autograd node, gradient x 1/ep). Doing
it in autograd rather than with FSDP's set_gradient_divide_factor keeps gloo working (that uses
ReduceOp.PREMUL_SUM, which gloo lacks).

Host cost per MoE layer (the step of a model of ~1B waits for the host): one device -> host copy in forward (the
counts of step 1, read once for the splits, the regrouping of step 3 and the local experts' loop), none in
backward; step 3 is one concatenation of row blocks each way (sizes known on the host), not a gather by a device
index; the weights cost one autograd node, not a to_local and a scale per weight.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_global_tensor_info

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


class _LocalWeights(torch.autograd.Function):
    """weights (DTensors on the ep mesh, or plain tensors) -> their local tensors, in one autograd node: what
    DTensor.to_local() does for each (a fresh view of the local tensor; the gradient goes back as a DTensor of the
    same spec) and backward multiplies every gradient by `scale` (the 1/ep of the module docstring). One node
    for the three weights, and the gradient's DTensor reuses the forward's spec instead of building one."""

    @staticmethod
    def forward(ctx, scale: float, *weights: torch.Tensor):
        ctx.scale = scale
        ctx.set_materialize_grads(False)
        ctx.specs = [w._spec if isinstance(w, DTensor) else None for w in weights]
        locals_ = [w._local_tensor if isinstance(w, DTensor) else w for w in weights]
        ctx.local_strides = [t.stride() for t in locals_]
        return tuple(t.view_as(t) for t in locals_)

    @staticmethod
    def backward(ctx, *grads):
        out = [None]
        for grad, spec, stride in zip(grads, ctx.specs, ctx.local_strides, strict=True):
            if grad is not None:
                grad = grad * ctx.scale
                if spec is not None:
                    grad = _grad_as_dtensor(grad, spec, stride)
            out.append(grad)
        return tuple(out)


def _grad_as_dtensor(grad: torch.Tensor, spec, local_stride) -> DTensor:
    """The local gradient of a DTensor with `spec` as a DTensor (as DTensor.to_local's backward builds it)."""
    if grad.stride() == local_stride and not any(p.is_partial() for p in spec.placements):
        return DTensor(grad, copy.copy(spec), requires_grad=False)
    _, stride = compute_global_tensor_info(grad, spec.mesh, spec.placements)
    placements = [Replicate() if p.is_partial() else p for p in spec.placements]
    return DTensor.from_local(grad, spec.mesh, placements, run_check=False, shape=spec.shape, stride=tuple(stride))


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


def _permute_blocks(x_TD: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """x's consecutive row blocks of `sizes`, concatenated in `order` (one copy kernel, no index)."""
    blocks = x_TD.split(sizes)
    return torch.cat([blocks[j] for j in order])


class _PermuteBlocks(torch.autograd.Function):
    """y = x's row blocks (host sizes `sizes`) in `order`; backward puts the gradient's blocks back (the inverse
    permutation, again one concatenation). One autograd node, no device index and no scatter in backward."""

    @staticmethod
    def forward(ctx, x_TD, sizes: list[int], order: list[int]):
        ctx.sizes, ctx.order = sizes, order
        return _permute_blocks(x_TD, sizes, order)

    @staticmethod
    def backward(ctx, grad_TD):
        return _permute_blocks(grad_TD, [ctx.sizes[j] for j in ctx.order], _inverse(ctx.order)), None, None


def permute_blocks(x_TD: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """Autograd-aware: x's row blocks of `sizes` (on the host), concatenated in `order`."""
    return _PermuteBlocks.apply(x_TD, sizes, order)


class ExpertParallelGroupedExperts(GroupedExperts):
    """A GroupedExperts holding this ep rank's E/ep experts; forward takes the GLOBAL sorted rows and counts
    (the seam's signature) and returns the global rows' outputs, exchanging tokens with the other ep ranks."""

    ep_group = None
    ep_size = 1

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (w1, w2, w3) [E/ep, ...], their gradient scaled by 1/ep (see the module docstring)."""
        return _LocalWeights.apply(1.0 / self.ep_size, self.w1, self.w2, self.w3)

    def forward(self, x_sorted_TD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        ep, group = self.ep_size, self.ep_group
        counts_E = num_tokens_per_expert_E.to(torch.int64)
        if counts_E.numel() != self.num_experts:
            raise ValueError(
                f"expert parallel: got counts for {counts_E.numel()} experts, expected the global {self.num_experts}"
            )
        n_local = self.num_experts // ep
        recv_counts_IE = exchange_counts(counts_E, ep, group)
        # the one host sync of the layer: this rank's counts and the received ones, [E] + [ep * E/ep]
        host = torch.cat([counts_E, recv_counts_IE.reshape(-1)]).tolist()
        sent, recv = host[: self.num_experts], host[self.num_experts :]  # recv: (source i, local expert e), i-major
        send_splits = [sum(sent[i * n_local : (i + 1) * n_local]) for i in range(ep)]
        recv_splits = [sum(recv[i * n_local : (i + 1) * n_local]) for i in range(ep)]
        local_counts = [sum(recv[i * n_local + e] for i in range(ep)) for e in range(n_local)]
        # [T*K, D] -> [sum recv_splits, D]: rows from every ep rank for this rank's experts, by source rank
        x_recv_TD = all_to_all_tokens(x_sorted_TD, send_splits, recv_splits, group)
        local_counts_dev = recv_counts_IE.sum(0)
        if n_local > 1 and ep > 1:
            # blocks (i, e) i-major -> e-major (by expert, then source rank), run the experts, and back
            by_expert = [i * n_local + e for e in range(n_local) for i in range(ep)]
            y_local_TD = self._forward_local(permute_blocks(x_recv_TD, recv, by_expert), local_counts_dev, local_counts)
            y_recv_TD = permute_blocks(y_local_TD, [recv[j] for j in by_expert], _inverse(by_expert))
        else:
            y_recv_TD = self._forward_local(x_recv_TD, local_counts_dev, local_counts)
        # [sum recv_splits, D] -> [T*K, D]: outputs back to the ranks (and rows) their tokens came from
        return all_to_all_tokens(y_recv_TD, recv_splits, send_splits, group)


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for pos, j in enumerate(order):
        inverse[j] = pos
    return inverse


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
