"""The MoE layer's host reads on CUDA (one GPU): routing and the counts need no stream sync (torch.bincount made two
per layer), HostCounts starts its copy without one and reads the right values after its event, and
host_to_device copies without one. torch.cuda.set_sync_debug_mode("error") raises on any synchronising call."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_moe_routing_and_count_prefetch_do_not_sync():
    from models.args import build_model_args
    from models.hybrid.moe import MoE, host_to_device
    from parallelisms.expert_parallel import HostCounts

    args = build_model_args("hybrid_moe_debug")
    moe = MoE(args, 0, 4).cuda()
    x_TD = torch.randn(512, args.d_model, device="cuda")
    counts = torch.arange(6, device="cuda", dtype=torch.int64)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        *_, counts_E = moe.route(x_TD)
        pending = HostCounts(torch.cat([counts_E, counts]))
        offs = host_to_device([16, 32, 48], torch.int32, x_TD.device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending.wait() == counts_E.tolist() + list(range(6))
    assert offs.tolist() == [16, 32, 48]
