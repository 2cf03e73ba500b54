"""training.grad_dtype: the dtype the blocks' linear weights keep their gradients in.

float32 (the default): the products' weight gradients come from cuBLAS in float32 (models/kernels/autocast_linear.py),
more precise than torch autocast's. bfloat16: each such weight gets torch's per-tensor `grad_dtype`, and the products
write its gradient in bf16 — the value torch autocast gives a float32 weight (its bf16 gradient, cast up), which is what
mamba_ssm's own training loop optimizes with. The gradient norm and AdamW then read 2 bytes per element instead of 4
(the 1.3B's in_proj and out_proj hold 1.24 of its 1.34B parameters), and the products write half the bytes. The other
parameters (embedding and lm_head, norms, conv, A_log, D, dt_bias, experts) keep float32 gradients from their kernels.
Where it applies (configs/checks.py says why, with the fix): one process, one microbatch per step (a sum of
microbatches would round at every add), and a fused optimizer (it clips and upcasts inside its kernel). A CUDA graph
(training.cuda_graph: on one GPU the step's one microbatch replays a graph whose backward writes the gradients)
captures the bf16 gradients as eager autograd makes them.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["GRAD_DTYPES", "set_linear_weight_grad_dtype"]

GRAD_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def linear_weights(model_parts: list[nn.Module]) -> list[nn.Parameter]:
    """The float32 weights of every nn.Linear inside the model parts' blocks (`layers`): the Mamba mixers' in_proj and
    out_proj, the hybrids' attention and MLP products. Not lm_head (the loss sums its gradient over chunks in float32,
    and a tied one is the embedding's)."""
    weights = []
    for part in model_parts:
        layers = getattr(part, "layers", None)
        if layers is None:
            continue
        for module in layers.modules():
            if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32:
                weights.append(module.weight)
    return weights


def set_linear_weight_grad_dtype(model_parts: list[nn.Module], name: str) -> int:
    """Give the blocks' linear weights (linear_weights) gradients of dtype GRAD_DTYPES[name]; returns how many
    weights that concerns (0 for float32, which leaves torch's default)."""
    dtype = GRAD_DTYPES[name]
    if dtype == torch.float32:
        return 0
    weights = linear_weights(model_parts)
    for w in weights:
        w.grad_dtype = dtype
    return len(weights)
