"""parallelisms/data_parallel.FlatGradients (plain data parallel): .grad become views of one buffer, one
all-reduce averages them, and the trainer selects it exactly when dp_replicate is the only parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from configs.job_config import Parallelism
from parallelisms.data_parallel import FlatGradients
from parallelisms.mesh import ParallelDims
from tests.dist_utils import run_distributed


def _two_microbatches_on_each_rank(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    grads = FlatGradients(list(model.parameters()), dist.group.WORLD)
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own data
    for _ in range(2):
        model(torch.randn(5, 4, generator=gen)).square().sum().backward()
    assert all(p.grad is v for p, v in zip(model.parameters(), grads.views))  # accumulated into the views
    grads.all_reduce()
    # lists, not tensors: torch's queue would share tensor storage with a process that is about to exit
    return [p.grad.tolist() for p in model.parameters()]


def test_all_reduce_is_the_mean_of_every_ranks_accumulated_gradient():
    got = run_distributed(_two_microbatches_on_each_rank, 3)
    # the same gradients computed in one process: each rank's two microbatches, summed, then averaged
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    for rank in range(3):
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(2):
            model(torch.randn(5, 4, generator=gen)).square().sum().backward()
    want = [p.grad / 3 for p in model.parameters()]
    for rank_grads in got:
        for g, w in zip(rank_grads, want):
            torch.testing.assert_close(torch.tensor(g), w, rtol=1e-6, atol=1e-7)


def _grad_set_to_none(rank, world_size):
    model = nn.Linear(2, 2)
    grads = FlatGradients(list(model.parameters()), dist.group.WORLD)
    torch.optim.SGD(model.parameters(), lr=0.1).zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match=r"set_to_none=False"):
        grads.all_reduce()
    return True


def test_a_dropped_view_is_an_error_not_a_silent_unreduced_step():
    assert run_distributed(_grad_set_to_none, 2) == [True, True]


@pytest.mark.parametrize(
    "replicate, shard, cp, pp, ddp",
    [
        (2, 1, 1, 1, True),
        (4, 1, 1, 1, True),
        (2, 2, 1, 1, False),
        (2, 1, 2, 1, False),
        (2, 1, 1, 2, False),
        (1, 1, 1, 1, False),
        (1, 4, 1, 1, False),
    ],
)
def test_ddp_exactly_when_dp_replicate_is_the_only_parallelism(replicate, shard, cp, pp, ddp):
    p = Parallelism(
        data_parallel_replicate_degree=replicate,
        data_parallel_shard_degree=shard,
        context_parallel_degree=cp,
        pipeline_parallel_degree=pp,
    )
    dims = ParallelDims.from_config(p, replicate * shard * cp * pp)
    assert dims.ddp_enabled is ddp
    assert dims.fsdp_enabled is (not ddp and replicate * shard * cp > 1)


def _units_after_fsdp(rank, world_size, blocks_per_unit):
    from torch.distributed.fsdp import fully_shard

    from models import build_model_args, build_model_on_meta
    from parallelisms.fsdp import apply_fsdp

    dims = ParallelDims.from_config(Parallelism(data_parallel_shard_degree=2), 2)
    args = build_model_args("debug", {"n_layers": 5, "d_model": 32, "headdim": 16, "d_state": 8})
    model = build_model_on_meta(args)
    apply_fsdp(
        model, dims.build_mesh("cpu"), Parallelism(fsdp_blocks_per_unit=blocks_per_unit), torch.float32, pdims=dims
    )
    states = [fully_shard.state(layer) for layer in model.layers.values()]
    distinct = []
    for s in states:
        if not any(s is d for d in distinct):
            distinct.append(s)
    return [sum(1 for s in states if s is d) for d in distinct]  # blocks per FSDP unit, in order


@pytest.mark.parametrize("k, sizes", [(1, [1, 1, 1, 1, 1]), (2, [2, 2, 1]), (5, [5])])
def test_fsdp_blocks_per_unit_groups_consecutive_blocks(k, sizes):
    assert run_distributed(_units_after_fsdp, 2, k) == [sizes, sizes]


def _fsdp_layout_and_gradients(rank, world_size, blocks_per_unit):
    """The debug model (5 blocks) under FSDP2 on 2 ranks with this fsdp_blocks_per_unit, every rank on its own tokens:
    (which blocks are FSDP modules, whether the root is, every gradient gathered whole)."""
    from torch.distributed.fsdp import FSDPModule

    from models import build_model_args, build_model_on_meta
    from models.init import init_weights
    from parallelisms.fsdp import apply_fsdp

    dims = ParallelDims.from_config(Parallelism(data_parallel_shard_degree=2), 2)
    args = build_model_args("debug", {"n_layers": 5, "d_model": 32, "headdim": 16, "d_state": 8, "chunk_size": 8})
    model = build_model_on_meta(args)
    apply_fsdp(
        model, dims.build_mesh("cpu"), Parallelism(fsdp_blocks_per_unit=blocks_per_unit), torch.float32, pdims=dims
    )
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7 + rank))
    model(tokens, labels=tokens).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return [isinstance(layer, FSDPModule) for layer in model.layers.values()], isinstance(model, FSDPModule), grads


def test_blocks_in_the_roots_unit():
    """fsdp_blocks_per_unit -1: no block is an FSDP unit of its own (the root's unit holds them), and every gradient
    equals the default layout's (one unit of the 5 blocks beside the root's) exactly."""
    in_root = run_distributed(_fsdp_layout_and_gradients, 2, -1)
    default = run_distributed(_fsdp_layout_and_gradients, 2, 0)
    assert in_root[0][:2] == ([False] * 5, True) and default[0][:2] == ([True] * 5, True)
    for rank in range(2):
        got, want = in_root[rank][2], default[rank][2]
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_fsdp_blocks_per_unit_below_minus_one_is_refused():
    from configs.checks import resolve_job
    from configs.parser import ConfigError, load_config

    cfg = load_config(["--job.config_file", "configs/debug.toml", "--parallelism.fsdp_blocks_per_unit", "-2"])
    with pytest.raises(ConfigError, match=r"fsdp_blocks_per_unit=-2 must be >= -1 .*-1 = the blocks in the root"):
        resolve_job(cfg, 2)


@pytest.mark.parametrize("flavor, blocks", [("370M", 15), ("1.3B", 4), ("2.7B", 2)])
def test_auto_blocks_per_unit_holds_about_100m_parameters(flavor, blocks):
    from models import build_model_args, build_model_on_meta
    from parallelisms.fsdp import auto_blocks_per_unit

    layers = list(build_model_on_meta(build_model_args(flavor)).layers.values())
    per_block = sum(p.numel() for p in layers[0].parameters())
    assert auto_blocks_per_unit(layers) == blocks
    assert abs(blocks * per_block - 100e6) <= per_block / 2  # the nearest whole number of blocks
    assert auto_blocks_per_unit(layers, unit_params=1) == 1  # large blocks: one unit each
    assert auto_blocks_per_unit(layers, unit_params=10**12) == len(layers)  # never more than the stage's blocks


def _fsdp_gradients(rank, world_size, reduce):
    """One backward of the debug model under FSDP2 (parallelize_part, as train.py builds it), every rank on its own
    tokens: the first block's in_proj gradient, gathered whole."""
    from configs.job_config import JobConfig
    from models import build_model_args, build_model_on_meta
    from models.init import init_weights
    from parallelisms.parallelize import parallelize_part

    cfg = JobConfig()
    cfg.parallelism.data_parallel_shard_degree = world_size
    cfg.training.mixed_precision_reduce = reduce
    dims = ParallelDims.from_config(cfg.parallelism, world_size)
    args = build_model_args("debug", {"n_layers": 2, "d_model": 32, "headdim": 16, "d_state": 8, "chunk_size": 8})
    model = build_model_on_meta(args)
    parallelize_part(model, cfg, dims, dims.build_mesh("cpu"), torch.float32)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7 + rank))
    model(tokens, labels=tokens).backward()
    return model.layers["0"].mixer.in_proj.weight.grad.full_tensor().tolist()


def test_mixed_precision_reduce_sets_the_dtype_of_fsdps_gradient_reduction():
    """training.mixed_precision_reduce bfloat16: FSDP2 reduce-scatters the gradients in bf16 (each rank's share
    rounded, then summed), float32 exactly: the two differ by bf16's rounding, not more."""
    exact = torch.tensor(run_distributed(_fsdp_gradients, 2, "float32")[0])
    halved = torch.tensor(run_distributed(_fsdp_gradients, 2, "bfloat16")[0])
    rel = ((halved - exact).norm() / exact.norm()).item()
    assert 1e-5 < rel < 1e-2, rel  # bf16 keeps 8 mantissa bits: ~2e-3 relative per element
