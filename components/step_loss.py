"""The step's loss normalisation, in one place, for the plain path, the pipeline schedule and validation.

The training loss is the mean over every labelled token of the global batch (all data-parallel and context-
parallel ranks, all microbatches), whatever the layout. Each rank backpropagates its microbatches' summed token
losses times `backward_scale` = dp_cp / global_tokens: FSDP / DDP average gradients over the dp_cp ranks, and the
factor dp_cp turns that average back into the sum, so the accumulated gradient is exactly that of the global mean.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from models.loss import IGNORE_INDEX


class StepLoss:
    def __init__(self, dp_cp: int, dp_cp_group=None):
        self.grad_scale = float(dp_cp)
        self.group = dp_cp_group
        self.global_tokens: torch.Tensor | None = None  # labelled tokens of the global batch, a device tensor
        self._unscaled = False

    def begin_step(self, labels_BS: torch.Tensor) -> None:
        """Count the step's labelled tokens over dp_cp: [B, S] labels per rank -> one scalar summed over dp_cp
        (all-reduce of a 0-d tensor; no host sync)."""
        tokens = (labels_BS != IGNORE_INDEX).sum().float()
        if self.group is not None:
            dist.all_reduce(tokens, group=self.group)
        self.global_tokens = tokens

    @property
    def backward_scale(self) -> torch.Tensor:
        """Multiply a microbatch's summed token loss by this before backward."""
        return self.grad_scale / self.global_tokens

    def pipeline_loss_fn(self, loss_sum: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
        """The pipeline schedule's loss_fn (scale_grads=False), on the last stage's output: the microbatch's summed
        token loss, which that stage computes itself from the labels it is given as a keyword input (train.py's
        pipeline_step, validation's PipelineEval; the model's loss path, so the fused loss on CUDA). Returns it
        scaled, or plain inside `unscaled()` (validation's forward-only pass)."""
        return loss_sum if self._unscaled else loss_sum * self.backward_scale

    def pipeline_loss_sum(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The schedule's per-microbatch scaled losses -> their plain token-loss sum (for logging)."""
        return torch.stack([loss.detach().float() for loss in losses]).sum() / self.backward_scale

    @contextlib.contextmanager
    def unscaled(self):
        """Inside: pipeline_loss_fn returns plain sums (validation)."""
        self._unscaled = True
        try:
            yield
        finally:
            self._unscaled = False

    def mean(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """The global token mean from the loss sum over every rank."""
        return loss_sum / self.global_tokens
