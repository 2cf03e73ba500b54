"""The optimizer step and the gradient norm on DTensors' local shards (components/optimizer.py ShardLocalAdamW,
parallelisms/grad_norm.py): the same numbers as torch's own AdamW and norm on the DTensors, without DTensor's
per-tensor dispatch. Two gloo processes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from components.optimizer import ShardLocalAdamW, take_optimizer_steps
from components.step_outcome import nonfinite
from parallelisms.grad_norm import clip_grads_, global_grad_norm, local_shard
from tests.dist_utils import run_distributed


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 5), nn.Linear(5, 3, bias=False))


def _torch_norm(params):
    """torch's own global norm over DTensor gradients (DTensor dispatch, made whole)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _train(model, opt, rank, steps=3, max_norm=0.5, device_skip=True, norm_fn=global_grad_norm):
    for step in range(steps):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().sum().backward()
        params = list(model.parameters())
        norm = norm_fn(params)
        skip = nonfinite(torch.tensor(1.0), norm) if device_skip else False
        take_optimizer_steps([opt], params, norm, max_norm, skip)
        opt.zero_grad()
    return norm


def _fsdp_body(rank, world, implementation):
    mesh = init_device_mesh("cpu", (world,))
    flags = dict(fused=True) if implementation in ("fused", "triton") else dict(foreach=True)
    tables = implementation == "triton"  # fused AdamW's update in components/adamw_triton.py (interpreter on the CPU)
    ref, ours = _model(), _model()
    for m in (ref, ours):
        for layer in m:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.1, **flags)  # torch's, on the DTensors
    opt = ShardLocalAdamW(ours.parameters(), lr=0.05, weight_decay=0.1, tables=tables, **flags)
    fused = implementation in ("fused", "triton")
    norm_ref = _train(ref, opt_ref, rank, device_skip=fused, norm_fn=_torch_norm)
    norm = _train(ours, opt, rank, device_skip=fused)
    torch.testing.assert_close(norm, norm_ref, rtol=1e-6, atol=0)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):  # the norms' rounding apart
        torch.testing.assert_close(local_shard(p), local_shard(q), rtol=1e-6, atol=1e-7, msg=name)
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(opt.state[p][key]) is type(p)  # DTensor moments, as DCP expects
            torch.testing.assert_close(local_shard(opt.state[p][key]), local_shard(opt_ref.state[q][key]),
                                       rtol=1e-5, atol=1e-8, msg=lambda m: f"{name} {key}: {m}")  # fmt: skip
    assert opt.state_dict()["state"].keys() == opt_ref.state_dict()["state"].keys()
    return True


@pytest.mark.parametrize("implementation", ["fused", "foreach", "triton"])
def test_shard_local_adamw_equals_torch_adamw_under_fsdp2(implementation, monkeypatch):
    """Weights and moments after 3 clipped steps equal torch's AdamW on the DTensors (to the rounding of the two
    norms), and the gradient norm equals torch's get_total_norm over the DTensors. "triton": our single-launch step
    on the local shards (Triton's interpreter in the spawned ranks) against torch's fused AdamW."""
    if implementation == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the spawned ranks when they import triton
    assert all(run_distributed(_fsdp_body, 2, implementation))


def _norm_body(rank, world):
    torch.manual_seed(1)
    full = [torch.randn(8, 3), torch.randn(5), torch.randn(4, 2)]
    want = torch.stack([t.norm() for t in full]).norm()
    # 1-d mesh sharded; 2-d mesh replicated over the first dim (HSDP's replicate dim: not summed) and sharded
    # over the second of size 1; a plain tensor beside them
    mesh_1d = init_device_mesh("cpu", (world,))
    mesh_2d = init_device_mesh("cpu", (world, 1), mesh_dim_names=("rep", "shard"))
    params = [
        nn.Parameter(distribute_tensor(full[0], mesh_1d, [Shard(0)])),
        nn.Parameter(distribute_tensor(full[1], mesh_2d, [Replicate(), Shard(0)])),
        nn.Parameter(full[2].clone()),
    ]
    for p, t in zip(params, full, strict=True):
        p.grad = distribute_tensor(t, p.device_mesh, p.placements) if hasattr(p, "placements") else t.clone()
    norm = global_grad_norm(params)
    torch.testing.assert_close(norm, want, rtol=1e-6, atol=0)
    clip_grads_(params, 0.5 * want.item(), norm)
    torch.testing.assert_close(global_grad_norm(params), 0.5 * want, rtol=1e-5, atol=0)
    return True


def test_global_grad_norm_sums_shards_not_replicas():
    assert all(run_distributed(_norm_body, 2))


def test_plain_tensors_take_the_same_path():
    ref, ours = _model(), copy.deepcopy(_model())
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.05, fused=True)
    opt = ShardLocalAdamW(ours.parameters(), lr=0.05, fused=True)
    _train(ref, opt_ref, 0)
    _train(ours, opt, 0)
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)
    assert dist.is_available()


def _zero_grad_body(rank, world):
    """FSDP's DTensor gradients beside plain ones (the parameters FSDP leaves whole): zeroed in place, the same
    tensors kept (a captured CUDA graph adds into them), where torch's own zero_grad(set_to_none=False) refuses."""
    mesh = init_device_mesh("cpu", (world,))
    sharded = nn.Parameter(distribute_tensor(torch.randn(8, 3), mesh, [Shard(0)]))
    whole = nn.Parameter(torch.randn(5))
    params = [sharded, whole]
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        torch.optim.AdamW(params, lr=0.1, fused=True).zero_grad(set_to_none=False)
    opt = ShardLocalAdamW(params, lr=0.1, fused=True)
    kept = [p.grad for p in params]
    local = [local_shard(g) for g in kept]
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is g for p, g in zip(params, kept)) and all(torch.count_nonzero(t) == 0 for t in local)
    opt.zero_grad()  # set_to_none: torch's
    assert all(p.grad is None for p in params)
    return True


def test_zero_grad_in_place_over_dtensor_and_plain_gradients():
    assert all(run_distributed(_zero_grad_body, 2))
