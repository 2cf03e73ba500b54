"""Activation checkpointing per block: full (every block) or selective (every n-th block)."""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from configs.job_config import ActivationCheckpoint


def apply_activation_checkpoint(model: nn.Module, ac: ActivationCheckpoint) -> None:
    """Wrap blocks in place; the ModuleDict keys stay, and checkpoint_wrapper keeps state-dict names clean."""
    if ac.mode == "none":
        return
    every = 1 if ac.mode == "full" else int(ac.selective_ac_option)
    for name, block in list(model.layers.items()):
        if int(name) % every == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
