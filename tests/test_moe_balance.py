"""components/moe_balance.py: the batched after-step update (all MoE layers as one [L, E] tensor) gives the same
bits as the per-layer update, and its launch count does not grow with the number of layers."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from components.moe_balance import MoEBalancer
from models.args import build_model_args
from models.hybrid.moe import MoE


def _layers(n_layers: int, n_experts: int, coeff: float, seed: int) -> list[MoE]:
    args = build_model_args(
        "hybrid_moe_debug",
        {"d_model": 16, "moe_num_experts": n_experts, "moe_hidden_dim": 8, "moe_load_balance_coeff": coeff},
    )
    g = torch.Generator().manual_seed(seed)
    layers = []
    for i in range(n_layers):
        moe = MoE(args, i, n_layers)
        moe.expert_bias.copy_(torch.randn(n_experts, generator=g) * 1e-2)
        moe.tokens_per_expert.copy_(torch.randint(0, 70_000, (n_experts,), generator=g))
        if i == 1:
            moe.tokens_per_expert[: n_experts // 2] = 0  # ties and idle experts
        layers.append(moe)
    return layers


@pytest.mark.parametrize("n_experts", [2, 6, 8, 64, 160])
@pytest.mark.parametrize("coeff", [1e-3, 0.0, 3.3e-4])
@pytest.mark.parametrize("skip", [False, True, 0.0, 1.0])
def test_batched_after_step_matches_per_layer_bitwise(n_experts, coeff, skip):
    skip_arg = torch.tensor(skip) if isinstance(skip, float) else skip
    batched, per_layer = (MoEBalancer([torch.nn.ModuleList(_layers(5, n_experts, coeff, 0))], True) for _ in "ab")
    assert batched._batchable()
    got = batched._after_step_batched(skip_arg)
    want = per_layer._after_step_per_layer(skip_arg)
    assert torch.equal(got, want)
    for a, b in zip(batched.layers, per_layer.layers, strict=True):
        assert torch.equal(a.expert_bias, b.expert_bias)
        assert not a.tokens_per_expert.any() and not b.tokens_per_expert.any()


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_after_step_launches_do_not_grow_with_layers():
    counts = []
    for n_layers in (2, 12):
        balancer = MoEBalancer([torch.nn.ModuleList(_layers(n_layers, 8, 1e-3, 1))], True)
        with _CountOps() as ops:
            balancer.after_step(skip=torch.tensor(0.0))
        counts.append(ops.n)
    assert counts[0] == counts[1], counts
