"""Parallelisms, each one file touching the model through documented seams; `parallelize_part` applies them."""

from __future__ import annotations

import torch
from torch import nn


def parallelize_part(part: nn.Module, cfg, pdims, mesh, param_dtype: torch.dtype) -> nn.Module:
    """Apply, in this order, to one model part (the whole model, or one pipeline stage) still on the meta
    device: context parallel hooks, expert parallel, activation checkpointing, torch.compile, FSDP2."""
    if pdims.cp_enabled:
        from parallelisms.context_parallel import apply_context_parallel

        apply_context_parallel(part, mesh["cp"].get_group(), cfg.parallelism.context_parallel_load_balance)
    if pdims.ep_enabled:
        from parallelisms.expert_parallel import apply_expert_parallel

        apply_expert_parallel(part, pdims)
    from parallelisms.activation_checkpoint import apply_activation_checkpoint

    apply_activation_checkpoint(part, cfg.activation_checkpoint)
    if cfg.compile.enable:
        from parallelisms.compile import apply_compile

        apply_compile(part)
    if pdims.fsdp_enabled:
        from parallelisms.fsdp import apply_fsdp

        apply_fsdp(part, mesh, cfg.parallelism, param_dtype=param_dtype, pdims=pdims)
    return part
