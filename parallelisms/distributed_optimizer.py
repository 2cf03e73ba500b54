"""Plain data parallel with the optimizer state sharded over the data-parallel ranks: Megatron-LM's distributed
optimizer (ZeRO stage 2). `parallelism.distributed_optimizer` with data_parallel_replicate_degree = NGPU.

Why: FSDP2 runs Python hooks per parameter and unit every step, on a step that the host already limits at 370M
(0.73-0.88 of one GPU's tokens/s per GPU on 2 H200s), and its collectives live inside forward / backward, so a CUDA
graph cannot capture them. Here the forward + backward touch nothing distributed: every rank holds the whole model
in float32 and its whole gradient, as under DDP, and training.cuda_graph captures them as on one GPU (0.93 of one
GPU with the graph, per GPU: docs/multi_gpu_sessions.md, session 28). Only the optimizer's moments (2 x 4 bytes per
parameter, the largest share of a small model's state) are sharded.

Rank k of W owns rows [k c, (k + 1) c) of dim 0 of every parameter, c = ceil(rows / W): DTensor's Shard(0), as
FSDP2 shards, so the moments are DTensors on the "dp" mesh and checkpoints move between this, FSDP2 and DDP (DCP
reshards them). Per step, outside any graph:

    reduce_scatter_gradients():  every .grad [rows_i, ...] (a view of W c_i rows of zero-padded storage)
        -> chunk-cat [W, S] (row k: rank k's rows of every gradient, S = sum_i c_i x row numel_i)
        -> reduce-scatter, / W -> shard [S]: this rank's rows of every averaged gradient (the optimizer's)
    optimizer.step():            this rank's rows of every weight and of their moments, updated in place
    all_gather_weights():        this rank's rows of every weight packed [S] -> all-gather -> [W, S]
        -> copied into every weight (zero-padded storage of W c_i rows: one split_with_sizes_copy)

Costs against DDP: the same bytes on the wire (a reduce-scatter + an all-gather is an all-reduce), a chunk-cat of the
gradients and a copy of the weights (each one pass over 4 bytes per parameter), 1/W of the optimizer's work, and
memory: whole weights and gradients on every rank plus one [W, S] buffer (4 bytes per parameter), moments / W. For
models that do not fit that way, use FSDP (data_parallel_shard_degree).

    ddp = ShardedDataParallel(params, mesh["dp"])   # re-homes the weights in padded storage; before the optimizer
    ddp.shard_optimizer_state(optimizer)            # moments as DTensors of this rank's rows; before a checkpoint load
    ddp.make_gradient_views()                       # .grad as views of padded storage; after the checkpoint load
    ... forward / backward of every microbatch (eager or a CUDA graph) ...
    ddp.reduce_scatter_gradients(); norm = ddp.grad_norm()
    optimizer.step() (fused: clipping and skipping inside its kernel); ddp.all_gather_weights()
    optimizer.zero_grad(set_to_none=False)          # keep the views
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

# torch 2.13 renamed the two collectives (the old names warn there); the GPU machines' 2.11 has only the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class ShardedDataParallel:
    """The buffers and collectives of the distributed optimizer for `params` over the 1-D `mesh`; see the module
    docstring. The optimizer must be components.optimizer.ShardLocalAdamW with fused=True (shard_optimizer_state)."""

    def __init__(self, params: list[nn.Parameter], mesh: DeviceMesh):
        unique: dict[int, nn.Parameter] = {}
        for p in params:
            if p.requires_grad:
                unique.setdefault(id(p), p)
        self.params = list(unique.values())
        scalars = [tuple(p.shape) for p in self.params if p.dim() == 0]
        if scalars:
            raise ValueError(f"the distributed optimizer shards dim 0 of every parameter; got 0-d parameters {scalars}")
        if len({p.dtype for p in self.params}) != 1:
            raise ValueError("the distributed optimizer needs parameters of one dtype (float32 weights)")
        self.mesh, self.group = mesh, mesh.get_group()
        self.world, self.rank = mesh.size(), mesh.get_local_rank()
        W, k = self.world, self.rank
        p0 = self.params[0]
        self.rows_per_rank = [math.ceil(p.shape[0] / W) for p in self.params]  # c_i
        self.chunk_numel = [c * p[0].numel() for c, p in zip(self.rows_per_rank, self.params)]  # c_i x row numel
        self.shard_numel = sum(self.chunk_numel)  # S
        # Each weight re-homed in zero-padded storage of W c_i rows (values unchanged), so that the gathered [W, S]
        # copies into every weight with one kernel.
        self.padded_weights: list[torch.Tensor] = []
        with torch.no_grad():
            for p, c in zip(self.params, self.rows_per_rank):
                padded = torch.zeros((W * c, *p.shape[1:]), dtype=p.dtype, device=p.device)
                padded[: p.shape[0]].copy_(p)
                p.data = padded[: p.shape[0]]
                self.padded_weights.append(padded)
        self.exchange_WS = torch.empty((W, self.shard_numel), dtype=p0.dtype, device=p0.device)  # chunk-cat / gather
        self.grad_shard_S = torch.zeros(self.shard_numel, dtype=p0.dtype, device=p0.device)
        self.padded_grads: list[torch.Tensor] | None = None
        # This rank's rows of each weight and of its averaged gradient, as the optimizer updates them.
        self.weight_shards, self.grad_shards, offset = [], [], 0
        for p, padded, c, n in zip(self.params, self.padded_weights, self.rows_per_rank, self.chunk_numel):
            own = max(0, min(c, p.shape[0] - k * c))  # rows of dim 0 this rank owns (0 for a short parameter)
            self.weight_shards.append(padded[k * c : k * c + own])
            self.grad_shards.append(self.grad_shard_S[offset : offset + n].view(c, *p.shape[1:])[:own])
            offset += n

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Give `optimizer` (ShardLocalAdamW, fused) the moments of this rank's rows, as DTensors Shard(0) over the
        mesh with each parameter's global shape (what DCP saves and reshards, as FSDP2's), and point its step at
        the weight and gradient shards. Call before loading a checkpoint into the optimizer."""
        if not optimizer.defaults.get("fused") or not hasattr(optimizer, "use_shards"):
            raise ValueError(
                "the distributed optimizer needs the fused AdamW (optimizer.implementation auto, fused or triton)"
            )
        ours = {id(p) for p in self.params}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in ours:
                    raise ValueError("the optimizer holds a parameter the distributed optimizer does not shard")
        for p, shard in zip(self.params, self.weight_shards):
            state = optimizer.state[p]
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)  # fused AdamW's step tensor
            for name in ("exp_avg", "exp_avg_sq"):
                state[name] = DTensor.from_local(
                    torch.zeros_like(shard), self.mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()
                )
        optimizer.use_shards({id(p): (w, g) for p, w, g in zip(self.params, self.weight_shards, self.grad_shards)})

    def make_gradient_views(self) -> None:
        """Every .grad becomes a view of zero-padded storage of W c_i rows (backward and CUDA graphs add into it;
        zero it with optimizer.zero_grad(set_to_none=False)). After any checkpoint load."""
        self.padded_grads = []
        for p, c in zip(self.params, self.rows_per_rank):
            padded = torch.zeros((self.world * c, *p.shape[1:]), dtype=p.dtype, device=p.device)
            if p.grad is not None:
                padded[: p.shape[0]].copy_(p.grad)
            p.grad = padded[: p.shape[0]]
            self.padded_grads.append(padded)

    @torch.no_grad()
    def reduce_scatter_gradients(self) -> None:
        """.grad of every parameter on every rank (this rank's sum over its microbatches) -> grad_shards: this rank's
        rows of the mean over the ranks. [rows_i, ...] each -> chunk-cat [W, S] -> reduce-scatter -> [S] / W."""
        if self.padded_grads is None:
            raise RuntimeError("call make_gradient_views() before the first backward")
        for p, padded in zip(self.params, self.padded_grads):
            if p.grad is None or p.grad.data_ptr() != padded.data_ptr():
                raise RuntimeError(
                    "a parameter's .grad is no longer its view of the distributed optimizer's gradient storage (was "
                    "it set to None? zero gradients with optimizer.zero_grad(set_to_none=False))"
                )
        torch._chunk_cat(self.padded_grads, dim=0, num_chunks=self.world, out=self.exchange_WS)
        _reduce_scatter(self.grad_shard_S, self.exchange_WS.view(-1), group=self.group)
        self.grad_shard_S.div_(self.world)  # the mean over the ranks, as FSDP and DDP average

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The L2 norm of the whole averaged gradient (a 0-d float32 device tensor, equal on every rank): the shards'
        squared norms summed over the ranks (the padding rows are zero)."""
        sq = torch.linalg.vector_norm(self.grad_shard_S, dtype=torch.float32).square()
        dist.all_reduce(sq, group=self.group)
        return sq.sqrt()

    @torch.no_grad()
    def all_gather_weights(self) -> None:
        """This rank's rows of every weight (just updated by the optimizer) -> every rank's whole weights:
        [S] packed -> all-gather [W, S] -> each weight's padded [W, c_i x row numel_i]."""
        own_S = self.exchange_WS[self.rank]
        torch.cat([padded.view(self.world, -1)[self.rank] for padded in self.padded_weights], out=own_S)
        _all_gather(self.exchange_WS.view(-1), own_S, group=self.group)
        torch.split_with_sizes_copy(
            self.exchange_WS,
            self.chunk_numel,
            dim=1,
            out=[padded.view(self.world, -1) for padded in self.padded_weights],
        )
