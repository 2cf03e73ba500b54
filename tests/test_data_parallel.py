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


def _fsdp_layout_and_gradients(rank, world_size, blocks_per_unit, replicate_below=0):
    """The debug model (5 blocks) under FSDP2 on 2 ranks with this fsdp_blocks_per_unit and
    fsdp_replicate_params_below, every rank on its own tokens, the replicated parameters' gradients all-reduced as
    train.py does: (which blocks are FSDP modules, whether the root is, every gradient whole, the names of the
    parameters left whole on every rank)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from models import build_model_args, build_model_on_meta
    from models.init import init_weights
    from parallelisms.fsdp import ReplicatedGradients, apply_fsdp

    dims = ParallelDims.from_config(Parallelism(data_parallel_shard_degree=2), 2)
    args = build_model_args("debug", {"n_layers": 5, "d_model": 32, "headdim": 16, "d_state": 8, "chunk_size": 8})
    model = build_model_on_meta(args)
    mesh = dims.build_mesh("cpu")
    p = Parallelism(fsdp_blocks_per_unit=blocks_per_unit, fsdp_replicate_params_below=replicate_below)
    apply_fsdp(model, mesh, p, torch.float32, pdims=dims)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7 + rank))
    model(tokens, labels=tokens).backward()
    ReplicatedGradients([model], mesh["dp_cp"].get_group()).all_reduce()
    grads = {n: p.grad.full_tensor() if isinstance(p, DTensor) else p.grad for n, p in model.named_parameters()}
    whole = sorted(n for n, p in model.named_parameters() if not isinstance(p, DTensor))
    blocks = [isinstance(layer, FSDPModule) for layer in model.layers.values()]
    return blocks, isinstance(model, FSDPModule), grads, whole


def _assert_same_gradients(got, want, rtol=0.0, atol=0.0):
    for rank in range(2):
        assert got[rank][2].keys() == want[rank][2].keys()
        for name, g in want[rank][2].items():
            torch.testing.assert_close(got[rank][2][name], g, rtol=rtol, atol=atol, msg=name)


def test_blocks_in_the_roots_unit():
    """fsdp_blocks_per_unit -1 (and the auto default for a part this small): no block is an FSDP unit of its own (the
    root's unit holds them), and every gradient equals that of one unit of the 5 blocks beside the root's exactly."""
    in_root = run_distributed(_fsdp_layout_and_gradients, 2, -1)
    default = run_distributed(_fsdp_layout_and_gradients, 2, 0)
    one_unit = run_distributed(_fsdp_layout_and_gradients, 2, 5)
    assert in_root[0][:2] == ([False] * 5, True) and default[0][:2] == ([False] * 5, True)
    assert one_unit[0][:2] == ([True] * 5, True)
    _assert_same_gradients(in_root, one_unit)


def test_small_parameters_replicated_give_fsdps_gradients():
    """fsdp_replicate_params_below: the norms, the conv's weight and bias, dt_bias, A_log and D stay whole on every
    rank (never an nn.Linear's or nn.Embedding's weight, however small: their products need param_dtype), and after
    ReplicatedGradients' all-reduce every gradient equals that of the layout sharding everything."""
    replicated = run_distributed(_fsdp_layout_and_gradients, 2, 0, 100_000)
    sharded = run_distributed(_fsdp_layout_and_gradients, 2, 0, 0)
    assert sharded[0][3] == []
    whole = replicated[0][3]
    assert whole == replicated[1][3]
    kinds = {name.split(".", 2)[-1] if name.startswith("layers.") else name for name in whole}
    assert kinds == {
        "norm.weight", "mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.dt_bias", "mixer.A_log", "mixer.D",
        "mixer.norm.weight", "norm_f.weight",
    }, kinds  # fmt: skip
    assert len(whole) == 7 * 5 + 1
    assert not any("proj" in n or "embedding" in n or "lm_head" in n for n in whole), whole
    for rank in range(2):  # the replicated gradients are the mean over the ranks: equal on both
        for name in whole:
            torch.testing.assert_close(replicated[rank][2][name], replicated[1 - rank][2][name], rtol=0, atol=0)
    _assert_same_gradients(replicated, sharded, rtol=1e-6, atol=1e-7)


def test_small_parameters_threshold_and_cpu_offload():
    from models import build_model_args, build_model_on_meta
    from parallelisms.fsdp import small_replicated_params

    model = build_model_on_meta(build_model_args("370M"))
    names = {id(p): n for n, p in model.named_parameters()}
    small = small_replicated_params(model, 100_000)
    assert len(small) == 337 and len(names) == 434  # 7 per block of 48, and norm_f
    assert {names[id(p)] for p in small if "layers.0." in names[id(p)]} == {
        f"layers.0.{n}" for n in ("norm.weight", "mixer.conv1d.weight", "mixer.conv1d.bias", "mixer.dt_bias",
                                  "mixer.A_log", "mixer.D", "mixer.norm.weight")
    }  # fmt: skip
    assert len(small_replicated_params(model, 2305)) == 337 - 48  # conv weights have 2304 x 4 elements
    assert small_replicated_params(model, 0) == set()
    assert small_replicated_params(model, 100_000, cpu_offload=True) == set()


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


def test_negative_replicate_threshold_is_refused():
    from configs.checks import resolve_job
    from configs.parser import ConfigError, load_config

    cfg = load_config(["--job.config_file", "configs/debug.toml", "--parallelism.fsdp_replicate_params_below", "-1"])
    with pytest.raises(ConfigError, match=r"fsdp_replicate_params_below=-1 must be >= 0 \(0 = FSDP shards every"):
        resolve_job(cfg, 2)
