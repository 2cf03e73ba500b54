"""parallelisms/distributed_optimizer.ShardedDataParallel: whole weights and gradients on every rank, the moments
sharded by rows; its steps equal plain data parallel's (one AdamW over the whole averaged gradient)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from components.optimizer import ShardLocalAdamW, take_optimizer_steps
from parallelisms.distributed_optimizer import ShardedDataParallel
from parallelisms.grad_norm import global_grad_norm
from tests.dist_utils import run_distributed


def _model() -> nn.Module:
    # rows 5, 3, 1 and 7: none a multiple of 2 or 3 ranks, one parameter shorter than the ranks (empty shards)
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1), nn.Linear(1, 7))


def _groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": [p for p in model.parameters() if p.dim() < 2]}]


def _data(rank: int, step: int, micro: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(1000 * step + 10 * rank + micro))


def _train(model, rank: int, steps: int, before_step, norm_fn, after_step):
    """`steps` steps of two microbatches of this rank's own data; max_norm 0.05 clips every step."""
    opt = ShardLocalAdamW(_groups(model), lr=1e-2, fused=True)
    before_step(opt)
    norms = []
    for step in range(steps):
        for micro in range(2):
            model(_data(rank, step, micro)).square().sum().backward()
        after_step("reduce")
        norm = norm_fn()
        take_optimizer_steps([opt], list(model.parameters()), norm, 0.05, torch.zeros(()))
        after_step("gather")
        opt.zero_grad(set_to_none=False)
        norms.append(norm.item())
    return opt, norms


def _sharded(rank, world_size):
    model = _model()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = ShardedDataParallel(list(model.parameters()), mesh["dp"])

    def before(opt):
        ddp.shard_optimizer_state(opt)
        ddp.make_gradient_views()

    def after(phase):
        ddp.reduce_scatter_gradients() if phase == "reduce" else ddp.all_gather_weights()

    opt, norms = _train(model, rank, 3, before, ddp.grad_norm, after)
    moments = {}
    for i, p in enumerate(model.parameters()):
        m = opt.state[p]["exp_avg_sq"]
        assert isinstance(m, DTensor)
        moments[i] = m.full_tensor().tolist()  # lists: see tests/test_data_parallel.py
        assert p.data_ptr() == ddp.padded_weights[i].data_ptr()  # still a view of the padded storage
    return [p.detach().tolist() for p in model.parameters()], moments, norms


def _reference(world: int):
    """One process: each step's gradient the mean of every rank's two microbatches, one AdamW (as DDP)."""
    model = _model()
    opt = ShardLocalAdamW(_groups(model), lr=1e-2, fused=True)
    norms = []
    for step in range(3):
        for x in [_data(r, step, m) for r in range(world) for m in range(2)]:
            model(x).square().sum().backward()
        for p in model.parameters():
            p.grad.div_(world)
        norm = global_grad_norm(list(model.parameters()))
        take_optimizer_steps([opt], list(model.parameters()), norm, 0.05, torch.zeros(()))
        opt.zero_grad(set_to_none=False)
        norms.append(norm.item())
    moments = {i: opt.state[p]["exp_avg_sq"] for i, p in enumerate(model.parameters())}
    return list(model.parameters()), moments, norms


def test_steps_equal_one_adamw_over_the_averaged_gradient():
    for world in (2, 3):
        got = run_distributed(_sharded, world)
        weights, moments, norms = _reference(world)
        for rank_weights, rank_moments, rank_norms in got:
            for w, ref in zip(rank_weights, weights):  # every rank holds the whole, equal weights
                torch.testing.assert_close(torch.tensor(w), ref.detach(), rtol=1e-5, atol=1e-7)
            for i, ref in moments.items():
                torch.testing.assert_close(torch.tensor(rank_moments[i]), ref, rtol=1e-5, atol=1e-12)
            torch.testing.assert_close(torch.tensor(rank_norms), torch.tensor(norms), rtol=1e-5, atol=0)


def _dropped_view(rank, world_size):
    import pytest

    model = _model()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    ddp = ShardedDataParallel(list(model.parameters()), mesh["dp"])
    ddp.make_gradient_views()
    model(torch.randn(2, 4)).sum().backward()
    model[0].weight.grad = None
    with pytest.raises(RuntimeError, match=r"set_to_none=False"):
        ddp.reduce_scatter_gradients()
    return dist.get_world_size()


def test_a_dropped_gradient_view_is_an_error():
    assert run_distributed(_dropped_view, 2) == [2, 2]
