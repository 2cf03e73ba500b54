"""torchtitan's build_loss_fn for Mamba-2: models/loss.py's token cross-entropy SUM (torchtitan divides by the global
token count), compiled when torchtitan's compile.components names "loss"."""

from __future__ import annotations

import torch

from models.loss import cross_entropy_sum


def build_mamba2_loss(job_config, **kwargs):
    del kwargs  # torchtitan also passes parallel_dims; the loss needs nothing from it
    if job_config.compile.enable and "loss" in job_config.compile.components:
        return torch.compile(cross_entropy_sum, backend=job_config.compile.backend)
    return cross_entropy_sum
