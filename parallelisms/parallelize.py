"""The one build path: the model on the meta device -> this rank's parts (pipeline stages or the whole model),
each parallelised, materialised and initialised. train.py, evaluate.py and generation all call
`build_model_parts`, so a model is never built two ways.

Order per part (torchtitan's): context parallel hooks, expert parallel, activation checkpointing, torch.compile,
FSDP2; then `to_empty` on the device and initialisation, whose values depend only on the seed and each
parameter's name, never on the layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from models import build_model_on_meta
from models.args import ModelArgs
from models.init import init_weights
from parallelisms.activation_checkpoint import apply_activation_checkpoint
from parallelisms.compile import apply_compile
from parallelisms.context_parallel import apply_context_parallel
from parallelisms.expert_parallel import apply_expert_parallel
from parallelisms.fsdp import ReplicatedGradients, apply_fsdp
from parallelisms.pipeline import pipeline_model


def parallelize_part(part: nn.Module, cfg, pdims, mesh, param_dtype: torch.dtype) -> nn.Module:
    """Apply, in this order, to one model part (the whole model, or one pipeline stage) still on the meta
    device: context parallel hooks, expert parallel, activation checkpointing, torch.compile, FSDP2."""
    if pdims.cp_enabled:
        p = cfg.parallelism
        apply_context_parallel(
            part, mesh["cp"].get_group(), p.context_parallel_load_balance, overlap=p.context_parallel_overlap
        )
    if pdims.ep_enabled:
        apply_expert_parallel(part, pdims)
    apply_activation_checkpoint(part, cfg.activation_checkpoint)
    if cfg.compile.enable:
        apply_compile(part)
    if pdims.fsdp_enabled:
        reduce_dtype = torch.bfloat16 if cfg.training.mixed_precision_reduce == "bfloat16" else torch.float32
        apply_fsdp(part, mesh, cfg.parallelism, param_dtype=param_dtype, reduce_dtype=reduce_dtype, pdims=pdims)
    return part


@dataclass
class ModelParts:
    """This rank's share of the model, ready to run.

    parts: the modules this rank holds (one, or one per pipeline stage it runs), materialised and initialised;
    schedule: the pipeline schedule under pipeline parallel (else None); has_first_stage / has_last_stage: whether
    this rank embeds tokens / produces the loss (both True without pipeline parallel); replicated_grads: under FSDP,
    the all-reduce of the small parameters' gradients that FSDP leaves whole on every rank (parallelisms/fsdp.py),
    for the trainer to run after a step's last microbatch (None where there are none).
    """

    parts: list[nn.Module]
    schedule: object | None
    has_first_stage: bool
    has_last_stage: bool
    replicated_grads: ReplicatedGradients | None = None


def build_model_parts(
    cfg,
    pdims,
    mesh,
    model_args: ModelArgs,
    device: torch.device,
    param_dtype: torch.dtype,
    n_microbatches: int = 1,
    pipeline_loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> ModelParts:
    """Build, split (pipeline), parallelise, materialise and initialise this rank's model parts.

    Under pipeline parallel `pipeline_loss_fn(last stage's output, labels_BS)` is the schedule's loss (already scaled,
    see components/step_loss.py; the trainer's stages output their summed token loss) and `n_microbatches` its
    microbatches per step. Parts are left in train mode.
    """
    model = build_model_on_meta(model_args)
    model.set_kernel_backend(cfg.model.kernels)
    parallelize = functools.partial(parallelize_part, cfg=cfg, pdims=pdims, mesh=mesh, param_dtype=param_dtype)
    if pdims.pp_enabled:
        if pipeline_loss_fn is None:
            raise ValueError("pipeline parallel needs the schedule's loss function (pipeline_loss_fn)")
        schedule, parts, has_first, has_last = pipeline_model(
            model, mesh, pdims, cfg, device, pipeline_loss_fn, parallelize, n_microbatches
        )
    else:
        schedule, parts, has_first, has_last = None, [parallelize(model)], True, True
    for part in parts:
        part.to_empty(device=device)
        if not pdims.fsdp_enabled:  # FSDP keeps the tie through to_empty; plain modules lose it
            part.tie_weights()
        init_weights(part, seed=cfg.training.seed, init_std=model_args.initializer_range)
        part.train()
    replicated = ReplicatedGradients(parts, mesh["dp_cp"].get_group()) if pdims.fsdp_enabled else None
    return ModelParts(parts, schedule, has_first, has_last, replicated if replicated else None)
