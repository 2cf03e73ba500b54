"""Expert parallel (EP): each rank of an ep group holds E/ep routed experts; tokens travel to them by all-to-all.

EP borrows its ranks from dp_shard x cp (`ParallelDims.ep_mesh` = (pp, dp_replicate, efsdp, ep), ep innermost):
an ep group is ep consecutive ranks that read different data, so every rank routes its own tokens and the
all-to-all carries each token copy to the rank that owns its expert. Rank r of the group owns the contiguous
experts [r*E/ep, (r+1)*E/ep).

The seam is `MoE.experts` (models/hybrid/moe.py), called once per forward as
    experts(x_sorted_TD [T*K, D], counts_E [E] int64, prefetched) -> y_sorted_TD [T*K, D].
apply_expert_parallel keeps that module (and so its parameter names: checkpoints do not depend on ep), turns
w1 / w2 / w3 into DTensors on the ep mesh with Shard(0) (each rank stores E/ep experts; DCP reshards them to any
other ep, and models/init.py's full-tensor init gives every layout the same experts), and swaps its class for
ExpertParallelGroupedExperts, whose prefetch_counts (called by MoE.forward right after routing) and forward are
    1. all-to-all the counts: counts_E [E] -> recv_counts [ep, E/ep] (rows from source rank i for local expert e),
       and start copying both to the host (HostCounts: pinned memory, non_blocking, an event); MoE.forward then
       queues the shared expert and the sort, which need no count, and forward waits for the copy;
    2. all-to-all the token copies: x_sorted [T*K, D] -> x_recv [sum recv_counts, D], grouped by source rank;
    3. regroup by local expert (each group padded to GROUP_ALIGN rows for the grouped GEMM), run the local
       experts, undo the regrouping (padding dropped);
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
counts of step 1, read once for the splits, the regrouping of step 3, the grouped GEMM's offsets and the local
experts' loop), waited for on its event after the shared expert is queued, so the device is not idle while the host
waits; none in backward. Step 3 is one concatenation of row blocks each way (sizes and zero padding known on the
host), not a gather by a device index, and the grouped GEMM's offsets are one host -> device copy, not the ~25
small ops that build them from device counts (GroupedExperts._forward_grouped_mm, the path without host counts);
the weights and their bf16 casts cost one autograd node.
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
    """weights (DTensors on the ep mesh, or plain tensors) -> their local tensors in `dtype` (None: as stored), in
    one autograd node: what DTensor.to_local() and .to(dtype) do for each (the gradient goes back in the stored
    dtype, as a DTensor of the same spec) and backward multiplies every gradient by `scale` (the 1/ep of the
    module docstring). One node for the three weights and their casts, and the gradient's DTensor reuses the
    forward's spec instead of building one."""

    @staticmethod
    def forward(ctx, scale: float, dtype: torch.dtype | None, *weights: torch.Tensor):
        ctx.scale = scale
        ctx.set_materialize_grads(False)
        ctx.specs = [w._spec if isinstance(w, DTensor) else None for w in weights]
        locals_ = [w._local_tensor if isinstance(w, DTensor) else w for w in weights]
        ctx.local_strides = [t.stride() for t in locals_]
        ctx.local_dtypes = [t.dtype for t in locals_]
        return tuple(t.view_as(t) if dtype in (None, t.dtype) else t.to(dtype) for t in locals_)

    @staticmethod
    def backward(ctx, *grads):
        out = [None, None]
        for grad, spec, stride, dtype in zip(grads, ctx.specs, ctx.local_strides, ctx.local_dtypes, strict=True):
            if grad is not None:
                # upcast first, then scale (as the cast's and the scale's nodes did apart)
                grad = grad.to(dtype).mul_(ctx.scale) if grad.dtype != dtype else grad * ctx.scale
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


def _row_blocks(x_TD: torch.Tensor, sizes: list[int], order: list[int], pads: list[int]) -> torch.Tensor:
    """[sum(sizes), D] -> [sum of the chosen blocks' sizes, D]: x's consecutive row blocks of `sizes` (block j,
    j < len(sizes)) and zero blocks of `pads` rows (block len(sizes) + p), concatenated in `order` (each block at
    most once; a block left out is dropped). One copy kernel, no device index."""
    blocks = x_TD.split(sizes)
    if pads:
        blocks += x_TD.new_zeros(sum(pads), *x_TD.shape[1:]).split(pads)
    return torch.cat([blocks[j] for j in order])


def _inverse_plan(sizes: list[int], order: list[int], pads: list[int]) -> tuple[list[int], list[int], list[int]]:
    """The (sizes, order, pads) of _row_blocks that takes its output back to its input: each of x's blocks from
    where `order` put it, a zero block for a block it dropped, the added zero blocks dropped."""
    all_sizes = [*sizes, *pads]
    out_sizes = [all_sizes[j] for j in order]
    position = dict(zip(order, range(len(order))))
    dropped = [j for j in range(len(sizes)) if j not in position]
    position.update(zip(dropped, range(len(order), len(order) + len(dropped))))
    return out_sizes, [position[j] for j in range(len(sizes))], [sizes[j] for j in dropped]


Plan = tuple[list[int], list[int], list[int]]  # (sizes, order, pads) of _row_blocks


class _RowBlocks(torch.autograd.Function):
    """y = _row_blocks(x, *plan) (host sizes); backward applies `inverse` (the plan taking y back to x) to the
    gradient: again one concatenation (blocks back in place, zeros for dropped blocks). One autograd node, no
    device index, no scatter in backward."""

    @staticmethod
    def forward(ctx, x_TD, plan: Plan, inverse: Plan):
        ctx.inverse = inverse
        return _row_blocks(x_TD, *plan)

    @staticmethod
    def backward(ctx, grad_TD):
        return _row_blocks(grad_TD, *ctx.inverse), None, None


def row_blocks(x_TD: torch.Tensor, plan: Plan, inverse: Plan | None = None) -> torch.Tensor:
    """Autograd-aware _row_blocks(x, *plan): x's row blocks of plan's sizes and zero blocks of its pads, in its
    order; `inverse`: _inverse_plan(*plan) when the caller has it already."""
    return _RowBlocks.apply(x_TD, plan, inverse or _inverse_plan(*plan))


def expert_major_plan(recv: list[int], n_local: int, align: int) -> tuple[Plan, list[int]]:
    """recv [ep * n_local] rows received per (source rank i, local expert e), i-major -> the _row_blocks plan
    that orders them e-major (by expert, then source rank), each expert's group followed by zero rows up to a
    multiple of `align` (the grouped GEMM's; 1: none), and each group's padded size."""
    order, pads, group_sizes = [], [], []
    for e in range(n_local):
        n = sum(recv[e::n_local])  # expert e's rows from every source rank
        pad = -n % align
        order += range(e, len(recv), n_local)
        if pad:
            order.append(len(recv) + len(pads))
            pads.append(pad)
        group_sizes.append(n + pad)
    return (recv, order, pads), group_sizes


class HostCounts:
    """Counts on their way to the host: `counts` (any int64 device tensor, flattened) copied into pinned memory by
    a non_blocking copy on the current stream, with an event after it; `wait()` blocks on that event only, so the
    work queued after the copy keeps the device busy while the host waits (`.tolist()` of a device tensor would
    wait for the whole stream, then copy). On the CPU (gloo) the values are read directly."""

    def __init__(self, counts: torch.Tensor):
        counts = counts.reshape(-1)
        self._event = None
        if counts.is_cuda:
            self._host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self._host.copy_(counts, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = counts

    def wait(self) -> list[int]:
        """The counts as Python ints, once the copy has landed (the layer's one host sync)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class ExpertParallelGroupedExperts(GroupedExperts):
    """A GroupedExperts holding this ep rank's E/ep experts; forward takes the GLOBAL sorted rows and counts
    (the seam's signature) and returns the global rows' outputs, exchanging tokens with the other ep ranks."""

    ep_group = None
    ep_size = 1

    def local_weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (w1, w2, w3) [E/ep, ...] in `dtype`, their gradient scaled by 1/ep (see the module
        docstring)."""
        return _LocalWeights.apply(1.0 / self.ep_size, dtype, self.w1, self.w2, self.w3)

    def prefetch_counts(self, num_tokens_per_expert_E: torch.Tensor) -> HostCounts:
        """Steps 1 and the host read: all-to-all the counts and start copying this rank's and the received counts
        ([E] + [ep * E/ep] int64) to the host; forward waits for them (MoE.forward queues other work between)."""
        counts_E = num_tokens_per_expert_E.to(torch.int64)
        if counts_E.numel() != self.num_experts:
            raise ValueError(
                f"expert parallel: got counts for {counts_E.numel()} experts, expected the global {self.num_experts}"
            )
        recv_counts_IE = exchange_counts(counts_E, self.ep_size, self.ep_group)
        return HostCounts(torch.cat([counts_E, recv_counts_IE.reshape(-1)]))

    def forward(
        self, x_sorted_TD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor, prefetched: HostCounts | None = None
    ) -> torch.Tensor:
        ep, group, n_local = self.ep_size, self.ep_group, self.num_experts // self.ep_size
        if prefetched is None:
            prefetched = self.prefetch_counts(num_tokens_per_expert_E)
        host = prefetched.wait()  # the one host sync of the layer
        sent, recv = host[: self.num_experts], host[self.num_experts :]  # recv: (source i, local expert e), i-major
        send_splits = [sum(sent[i * n_local : (i + 1) * n_local]) for i in range(ep)]
        recv_splits = [sum(recv[i * n_local : (i + 1) * n_local]) for i in range(ep)]
        # [T*K, D] -> [sum recv_splits, D]: rows from every ep rank for this rank's experts, by source rank
        x_recv_TD = all_to_all_tokens(x_sorted_TD, send_splits, recv_splits, group)
        # blocks (i, e) i-major -> e-major (by expert, then source rank), each expert's group padded for the
        # grouped GEMM, in one copy; the experts; and back (padding dropped) in one copy
        plan, group_sizes = expert_major_plan(recv, n_local, self.grouped_mm_align(x_recv_TD))
        if plan[1] == list(range(len(recv))):  # already grouped by expert (n_local or ep 1), nothing to pad
            y_recv_TD = self.forward_host_groups(x_recv_TD, group_sizes)
        else:
            back = _inverse_plan(*plan)
            y_local_TD = self.forward_host_groups(row_blocks(x_recv_TD, plan, back), group_sizes)
            y_recv_TD = row_blocks(y_local_TD, back, plan)
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
