"""A tied weight's gradient handed from the fused loss's backward to the token embedding's, which adds its rows in
place instead of making a second [V, D] gradient for autograd to add.

The contract (GradHandoff, one per forward that both embeds and takes the fused loss with the head's weight tied):
- the loss's backward (cross_entropy_triton.py) computes the head's weight gradient dW as always, returns it to
  autograd and also `give`s it here;
- the embedding's backward (always later in the same backward: its incoming gradient comes through every layer,
  which starts from the loss's dh) `take`s dW, adds the rows' gradients into it in place
  (embedding_triton.embedding_grad_add_) and returns no gradient for the weight.
Why in place is safe: autograd runs the weight's AccumulateGrad only after every node with an edge into it has run,
the embedding's included (a None gradient still counts), so dW is read into .grad (or written there, on a step's
first microbatch) only once it holds both parts, exactly the sum autograd would have formed (in another order of
float32 additions). If nothing was given (the head's weight needs no gradient), the embedding returns its own.

Measured: docs/ssd_sessions.md, session 52 (the embedding's backward on the 1.3B).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["GradHandoff", "embedding_with_handoff"]


class GradHandoff:
    """Holds the tied weight's gradient between the loss's backward (give) and the embedding's (take)."""

    __slots__ = ("_grad",)

    def __init__(self) -> None:
        self._grad: torch.Tensor | None = None

    def give(self, grad: torch.Tensor) -> None:
        self._grad = grad

    def take(self) -> torch.Tensor | None:
        grad, self._grad = self._grad, None
        return grad


class _EmbeddingIntoTiedGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight_VD, handoff):
        ctx.save_for_backward(ids)
        ctx.handoff = handoff
        ctx.weight_meta = (weight_VD.shape, weight_VD.dtype, weight_VD.device)
        return F.embedding(ids, weight_VD)

    @staticmethod
    def backward(ctx, grad_out):
        from models.kernels.embedding_triton import embedding_grad_add_  # lazy: imports triton

        (ids,) = ctx.saved_tensors
        target = ctx.handoff.take()
        if target is not None:
            embedding_grad_add_(target, ids, grad_out.contiguous())
            return None, None, None
        shape, dtype, device = ctx.weight_meta
        own = embedding_grad_add_(torch.zeros(shape, dtype=dtype, device=device), ids, grad_out.contiguous())
        return None, own, None


def embedding_with_handoff(ids: torch.Tensor, weight_VD: torch.Tensor, handoff: GradHandoff) -> torch.Tensor:
    """F.embedding(ids, weight) whose weight gradient is added into the tensor the fused loss's backward gives
    `handoff` (module docstring); our Triton kernel in the backward (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    return _EmbeddingIntoTiedGrad.apply(ids, weight_VD, handoff)
