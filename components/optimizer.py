"""AdamW with decoupled weight decay on matrices only, and the warmup / stable / decay LR schedule."""

from __future__ import annotations

import functools
import importlib.util
import math
import os

import torch
from torch import nn
from torch.optim.adamw import adamw  # the functional AdamW that torch.optim.AdamW.step calls

from configs.job_config import LRScheduler, Optimizer
from parallelisms.grad_norm import clip_divisor, clip_grads_, local_shard


def build_optimizer(
    model_parts: list[nn.Module], cfg: Optimizer, device_type: str, copies_dtype: torch.dtype | None = None
) -> torch.optim.Optimizer:
    """One AdamW over every model part of this rank. Vectors (biases, norms, A_log, D, dt_bias) get no decay.
    copies_dtype: the 16-bit dtype autocast runs the products in over float32 weights, where the weights' copies
    may be kept (None: none); with implementation triton and cfg.weight_copies, the optimizer keeps them current
    (models/kernels/weight_copies.py)."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for part in model_parts:
        for p in part.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                (decay if p.dim() >= 2 else no_decay).append(p)
    impl = cfg.implementation
    # Where the parameters (and so the moments) live: FSDP2's CPU offload keeps them on the host of a CUDA run.
    on_gpu = device_type == "cuda" and all(local_shard(p).is_cuda for p in decay + no_decay)
    fp32 = all(p.dtype == torch.float32 for p in decay + no_decay)  # what our kernel takes
    if impl == "auto":  # fused AdamW's update (it alone skips and clips on the device): ours on CUDA, torch's elsewhere
        impl = "triton" if on_gpu and fp32 and importlib.util.find_spec("triton") is not None else "fused"
    if impl == "triton" and not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"optimizer.implementation 'triton' needs the parameters on CUDA (this run: {device_type}, or FSDP's CPU "
            "offload); use 'auto' or 'fused'"
        )
    if impl == "triton" and not fp32:
        raise ValueError("optimizer.implementation 'triton' takes float32 parameters only; use 'auto' or 'fused'")
    flags = {
        "fused": dict(fused=True),
        "triton": dict(fused=True, tables=True),  # fused AdamW's state and checkpoints, our single-launch step
        "foreach": dict(foreach=True),
        "for-loop": dict(foreach=False),
    }[impl]
    if impl == "triton" and cfg.weight_copies and copies_dtype in (torch.bfloat16, torch.float16):
        flags["weight_copies"] = copies_dtype
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return ShardLocalAdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **flags)


class ShardLocalAdamW(torch.optim.AdamW):
    """torch's AdamW (same arguments, state and state_dict, so checkpoints are interchangeable), whose step runs on
    the local shards of DTensor parameters, gradients and moments (FSDP2, HSDP, EP) instead of on the DTensors.

    Why: AdamW is element-wise, so each rank updating its own shard is the whole update; but a fused / foreach
    kernel called on DTensors goes through DTensor's sharding propagation for every tensor of its lists, every
    step: ~150 ms of host time per step for the 370M's ~400 parameters under FSDP2 (cProfile, CPU; the GPU's host
    pays the same Python), more than the 1-GPU step takes on an H200 (docs/performance.md, issue 14). Plain
    tensors (one GPU, DDP) take the same path unchanged. The moments stay DTensors in the state (lazily created by
    torch's own _init_group), so DCP saves and reshards them as before.

    tables=True (optimizer.implementation "triton", with fused=True): each group's step is components/adamw_triton.py's
    single launch over tables of addresses instead of torch's multi-tensor kernels: the same update and state.
    weight_copies (a 16-bit dtype, with tables): the same launch also writes the current copies of the weights that
    models/kernels/weight_copies.py keeps in that dtype for the products (switched on here, for the process).
    """

    def __init__(self, params, *, tables: bool = False, weight_copies: torch.dtype | None = None, **kwargs):
        super().__init__(params, **kwargs)
        self._tables = None
        self._shards: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        if weight_copies is not None and not tables:
            raise ValueError("ShardLocalAdamW(weight_copies=...) needs tables=True: only that kernel writes them")
        if tables:
            if not self.defaults.get("fused"):
                raise ValueError("ShardLocalAdamW(tables=True) keeps fused AdamW's state: pass fused=True")
            from components.adamw_triton import TableAdamW  # lazy: imports triton

            self._tables = TableAdamW(weight_copies)

    def use_shards(self, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """The distributed optimizer (parallelisms/distributed_optimizer.py): each step updates, for the parameter
        p, shards[id(p)] = (this rank's rows of p, of its averaged gradient) instead of p and p.grad (whole on every
        rank); the moments are already shards (DTensors)."""
        self._shards = shards

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, except that set_to_none=False zeroes every gradient's local shard in one plain foreach: torch's
        own groups gradients by device and dtype only, and refuses a list that holds FSDP's DTensor gradients beside
        the plain ones of the parameters FSDP leaves whole (parallelism.fsdp_replicate_params_below). Zeroing in place
        keeps the .grad tensors a captured CUDA graph adds into (training.cuda_graph under FSDP2)."""
        if set_to_none:
            super().zero_grad(set_to_none=True)
            return
        grads = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                grads.append(local_shard(p.grad))
        if grads:
            torch._foreach_zero_(grads)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardLocalAdamW.step takes no closure")
        for index, group in enumerate(self.param_groups):
            lists: tuple[list[torch.Tensor], ...] = ([], [], [], [], [], [])
            has_complex = self._init_group(group, *lists)  # torch's: lazy state, the tensors that have a gradient
            params, grads, exp_avgs, exp_avg_sqs, max_sqs, steps = ([local_shard(t) for t in ts] for ts in lists)
            if self._shards is not None:
                params, grads = [self._shards[id(p)][0] for p in lists[0]], [self._shards[id(p)][1] for p in lists[0]]
            if self._tables is not None:
                if has_complex or group["amsgrad"] or group["maximize"]:
                    raise ValueError("optimizer.implementation 'triton' has no complex, amsgrad, maximize: use 'fused'")
                grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
                self._tables.step(index, group, params, grads, exp_avgs, exp_avg_sqs, steps, grad_scale, found_inf)
                continue
            # Gradients stored in bf16 (training.grad_dtype) go to torch's kernels as float32 copies: they take a
            # parameter's own dtype only. Our triton tables read them as they are.
            grads = [g if g.dtype == p.dtype else g.to(p.dtype) for p, g in zip(params, grads)]
            beta1, beta2 = group["betas"]
            adamw(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                max_sqs,
                steps,
                foreach=group["foreach"],
                capturable=group["capturable"],
                differentiable=group["differentiable"],
                fused=group["fused"],
                grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None),
                has_complex=has_complex,
                amsgrad=group["amsgrad"],
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
            )


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` can skip a step and clip its gradients inside its own kernels (fused AdamW's found_inf
    and grad_scale), so that the host never waits for the gradient norm (components/step_outcome.py)."""
    return bool(optimizer.defaults.get("fused"))


def take_optimizer_steps(
    optimizers: list[torch.optim.Optimizer],
    params: list[torch.Tensor],
    grad_norm: torch.Tensor,
    max_norm: float,
    skip: torch.Tensor | bool,
) -> None:
    """Every optimizer's step on gradients clipped to `max_norm` by the global `grad_norm`, or none when `skip`.

    `skip` a 0-d float32 device tensor (1.0: a non-finite step; every optimizer `skips_on_device`): the optimizers
    divide the gradients by the clipping divisor and leave parameters, moments and step counts untouched on a skip,
    all inside fused AdamW's kernels: no host sync and no clipping pass over the gradients. `skip` a bool (read on
    the host): the gradients are clipped in place, then the optimizers step unless it is True.
    """
    if isinstance(skip, torch.Tensor):
        divisor = clip_divisor(max_norm, grad_norm)
        for opt in optimizers:
            opt.grad_scale, opt.found_inf = divisor, skip  # read by torch.optim.Adam(W).step, as GradScaler sets them
            opt.step()
    elif not skip:
        clip_grads_(params, max_norm, grad_norm)
        for opt in optimizers:
            opt.step()


def lr_factor(
    step_index: int, total_steps: int, warmup: int, decay_ratio: float, decay_type: str, min_lr_factor: float
) -> float:
    """Multiplier of the peak LR for the optimizer step with 0-based index `step_index`.

    Linear warmup over `warmup` steps, a stable phase, then a decay over the last
    round((total - warmup) * decay_ratio) steps (every post-warmup step when decay_ratio = -1).
    """
    if step_index < warmup:
        return (step_index + 1) / (warmup + 1)
    post = max(total_steps - warmup, 1)
    decay_steps = post if decay_ratio < 0 else max(round(post * decay_ratio), 0)
    decay_start = total_steps - decay_steps
    if step_index < decay_start or decay_steps == 0:
        return 1.0
    progress = min((step_index - decay_start + 1) / decay_steps, 1.0)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "sqrt":
        shape = 1.0 - math.sqrt(progress)
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, total_steps: int):
    fn = functools.partial(
        lr_factor,
        total_steps=total_steps,
        warmup=cfg.warmup_steps,
        decay_ratio=cfg.decay_ratio,
        decay_type=cfg.decay_type,
        min_lr_factor=cfg.min_lr_factor,
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
