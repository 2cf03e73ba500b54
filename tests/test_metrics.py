"""components/metrics.py's FLOP count against the parameters the model actually builds."""

from __future__ import annotations

import pytest
from torch import nn

from components.metrics import model_flops_per_token
from models import build_model_args, build_model_on_meta
from models.hybrid.moe import GroupedExperts


def _active_matmul_params(model: nn.Module, top_k: int, num_experts: int) -> int:
    """Matmul weights one token multiplies by: every Linear (lm_head included, tied or not) and top_k of the
    routed experts."""
    n = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            n += m.weight.numel()
        elif isinstance(m, GroupedExperts):
            n += sum(p.numel() for p in m.parameters()) * top_k // num_experts
    return n


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # every hidden size given explicitly
        {"d_model": 112, "mlp_hidden_dim": 0, "moe_hidden_dim": 0},  # the default formulas (8/3 * d rounded to 64)
        # fewer MLP units than top_k: the experts are 0 wide; metrics' old copy of the formula counted 1
        {"mlp_hidden_dim": 3, "moe_hidden_dim": 0, "moe_top_k": 4, "moe_shared_experts": 0},
    ],
    ids=["explicit", "default-formulas", "tiny-mlp"],
)
def test_six_n_counts_the_matmul_parameters_the_model_builds(overrides):
    args = build_model_args("hybrid_moe_debug", overrides)
    assert set(args.layer_types) == set("M*-E")
    _, six_n = model_flops_per_token(args, seq_len=64)
    assert six_n == 6 * _active_matmul_params(build_model_on_meta(args), args.moe_top_k, args.moe_num_experts)
