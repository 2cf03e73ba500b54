"""Expert parallel against the single-process model, on the CPU (gloo, fp32).

- the regrouping index and the validation messages (no process group);
- in 4 processes: the EP expert module vs a full GroupedExperts (outputs and every gradient) at ep 2 and ep 4,
  with uneven routing and a rank that sends no rows to some experts;
- in 4 processes: a whole hybrid MoE model under EP + FSDP exactly as train.py builds it (ep 2 with efsdp 2,
  ep 4; HSDP 2 x (efsdp 1 x ep 2)): initial weights, every parameter's reduced gradient and the clipped global
  gradient norm equal the single-process ones. This is where the expert-gradient scale is checked: a loss parity
  test cannot see it (Adam is nearly invariant to a gradient scale).
"""

from __future__ import annotations

import pytest
import torch

from models.args import build_model_args
from models.hybrid.moe import MoE
from parallelisms.expert_parallel import row_blocks, validate_expert_parallel
from parallelisms.mesh import ParallelDims
from tests.dist_utils import run_distributed

TINY = {
    "d_model": 32,
    "d_state": 16,
    "headdim": 16,
    "chunk_size": 16,
    "moe_hidden_dim": 24,
    "mlp_hidden_dim": 48,
    "n_heads": 4,
    "n_kv_heads": 2,
    "moe_load_balance_coeff": 0.0,
}


def _regroup_index(recv: torch.Tensor) -> torch.Tensor:
    """Row indices taking the received rows (blocks (source i, local expert e), i-major) to e-major order, stable
    within a block: x_by_expert = x_recv[index] (written out row by row)."""
    ep, n_local = recv.shape
    offsets = recv.flatten().cumsum(0) - recv.flatten()
    blocks = [(i, e) for e in range(n_local) for i in range(ep)]  # e-major
    rows = [int(offsets[i * n_local + e]) + j for i, e in blocks for j in range(int(recv[i, e]))]
    return torch.tensor(rows, dtype=torch.int64)


def test_row_blocks_permutation_matches_regroup_index_forward_and_backward():
    """The EP forward regroups by host block sizes (one cat each way); it must equal the gather by the row index
    (rows and gradients), empty blocks included."""
    recv = torch.tensor([[2, 0, 3], [1, 4, 0], [0, 2, 2]])  # [source rank, local expert]
    ep, n_local = recv.shape
    sizes = recv.flatten().tolist()
    by_expert = [i * n_local + e for e in range(n_local) for i in range(ep)]
    x = torch.randn(int(recv.sum()), 5, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    index = _regroup_index(recv)
    y = row_blocks(x, (sizes, by_expert, []))
    y_ref = x_ref[index]
    assert torch.equal(y, y_ref)
    inverse = [by_expert.index(j) for j in range(len(by_expert))]
    back = row_blocks(y * 3, ([sizes[j] for j in by_expert], inverse, []))  # the undo of the EP forward
    back_ref = torch.empty_like(y_ref).index_copy(0, index, y_ref * 3)
    assert torch.equal(back, back_ref)
    g = torch.randn_like(back)
    back.backward(g)
    back_ref.backward(g)
    assert torch.equal(x.grad, x_ref.grad)


def test_row_blocks_with_zero_pads_and_their_inverse():
    """The expert-major plan with padding (what the grouped GEMM gets): rows equal the gather by the regroup index
    with zero rows after each expert's group up to a multiple of `align`; the inverse plan drops them again; the
    gradient of the padded copy reaches x exactly (the pads' gradient dropped), and the inverse's backward inserts
    zeros for them."""
    from parallelisms.expert_parallel import _inverse_plan, expert_major_plan, row_blocks

    recv = torch.tensor([[2, 0, 3], [1, 4, 0], [0, 2, 2]])  # [source rank, local expert]
    ep, n_local = recv.shape
    align = 4
    plan, group_sizes = expert_major_plan(recv.flatten().tolist(), n_local, align)
    assert group_sizes == [4, 8, 8]  # 3, 6, 5 rows per expert, padded to 4
    x = torch.randn(int(recv.sum()), 5, dtype=torch.float64, requires_grad=True)
    by_expert = x[_regroup_index(recv)]
    groups = by_expert.split(recv.sum(0).tolist())
    ref = torch.cat([torch.cat([g, g.new_zeros(n - len(g), 5)]) for g, n in zip(groups, group_sizes)])
    back = _inverse_plan(*plan)
    y = row_blocks(x, plan, back)
    assert torch.equal(y, ref)
    z = row_blocks(y * 2, back, plan)  # the return trip: pads dropped, rows back in x's order
    assert torch.equal(z, x * 2)
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, g)
    (gx_ref,) = torch.autograd.grad(ref, x, g)
    assert torch.equal(gx, gx_ref)
    yy = y.detach().requires_grad_(True)
    (gy,) = torch.autograd.grad(row_blocks(yy, back, plan), yy, x.detach())
    assert torch.equal(gy, ref.detach())  # zeros where the pads were


def test_validate_expert_parallel_messages():
    args = build_model_args("hybrid_moe_debug")  # 4 experts
    ok = ParallelDims(pp=1, dp_replicate=1, dp_shard=4, cp=1, ep=4, world_size=4)
    assert validate_expert_parallel(args, ok) == []
    bad = ParallelDims(pp=1, dp_replicate=1, dp_shard=3, cp=1, ep=3, world_size=3)
    (msg,) = validate_expert_parallel(args, bad)
    assert "expert_parallel_degree=3" in msg and "moe_num_experts=4" in msg
    dense = build_model_args("debug")
    (msg,) = validate_expert_parallel(dense, ok)
    assert "no MoE" in msg


# ------------------------------------------------------------------------------------------- 4 processes
def _experts_vs_full(rank, world, ep, grouped_mm=False):
    """EP module on random rows of every rank vs one full GroupedExperts on all ranks' rows. grouped_mm: the EP
    module's local experts take the grouped-GEMM path (CUDA's, here through torch's CPU fallback in fp32): its
    groups padded to GROUP_ALIGN rows by the regrouping copy."""
    import torch.distributed as dist

    from models.hybrid.moe import GroupedExperts
    from parallelisms.expert_parallel import apply_expert_parallel

    E, D, H = 4, 8, 12
    torch.manual_seed(0)
    full = GroupedExperts(D, H, E, n_layers=2)
    full.backend = "loop"
    rows_per_rank = [torch.randint(0, 6, (E,)) for _ in range(world)]
    rows_per_rank[1][2] = 0  # an expert that gets nothing from rank 1
    xs = [torch.randn(int(c.sum()), D) for c in rows_per_rank]

    class Holder(MoE):  # apply_expert_parallel converts the `experts` of MoE layers (found by isinstance)
        def __init__(self, experts):
            torch.nn.Module.__init__(self)  # the experts alone: no router
            self.experts = experts

    holder = Holder(GroupedExperts(D, H, E, n_layers=2))
    holder.experts.load_state_dict(full.state_dict())
    pdims = ParallelDims(pp=1, dp_replicate=1, dp_shard=world, cp=1, ep=ep, world_size=world)
    pdims.build_mesh("cpu")
    apply_expert_parallel(holder, pdims)
    ep_experts = holder.experts
    ep_experts.backend = "loop"
    if grouped_mm:  # the CUDA path (bf16 only there) on the CPU, in fp32
        ep_experts._use_grouped_mm = lambda x_TD: True

    x = xs[rank].clone().requires_grad_(True)
    syncs = []  # device -> host reads: at most one per forward (the split sizes), none in backward
    tolist, item = torch.Tensor.tolist, torch.Tensor.item
    torch.Tensor.tolist = lambda t: syncs.append("tolist") or tolist(t)
    torch.Tensor.item = lambda t: syncs.append("item") or item(t)
    try:
        y = ep_experts(x, rows_per_rank[rank])
        n_forward = len(syncs)
        y.backward(torch.ones_like(y) * (rank + 1))
    finally:
        torch.Tensor.tolist, torch.Tensor.item = tolist, item
    assert (n_forward, len(syncs)) == (1, 1), syncs
    grads = {n: p.grad.full_tensor() for n, p in ep_experts.named_parameters()}
    for g in grads.values():
        # Each rank's grad is its ep group's token sum / ep (the EP scale; FSDP's mean over efsdp supplies the
        # rest), replicated on the ep ranks by full_tensor: the world sum is the sum over every rank's tokens.
        dist.all_reduce(g)
    ref_x = [xi.clone().requires_grad_(True) for xi in xs]
    ref_y = [full(xi, c) for xi, c in zip(ref_x, rows_per_rank)]
    torch.autograd.backward(ref_y, [torch.ones_like(r) * (i + 1) for i, r in enumerate(ref_y)])
    # ep ranks of one group exchange tokens; the other group (ep 2 of 4) computes the same experts for its own
    torch.testing.assert_close(y, ref_y[rank], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_x[rank].grad, rtol=1e-6, atol=1e-6)
    for n, p in full.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)
    return True


def _model_grads_vs_single(rank, world, layouts):
    """train.py's build (EP before FSDP, meta init, loss x dp_cp / global tokens) vs one unsharded model."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from configs.job_config import Parallelism
    from models import build_model_on_meta
    from models.init import init_weights
    from models.loss import cross_entropy_sum
    from parallelisms.expert_parallel import apply_expert_parallel, expert_modules
    from parallelisms.fsdp import ReplicatedGradients, apply_fsdp
    from parallelisms.grad_norm import clip_grad_norm_

    whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    args = build_model_args("hybrid_moe_debug", TINY)
    B, S = 8, 32
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (B, S + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    cuts = torch.randint(1, S, (B, 2), generator=g)
    pos = torch.arange(S)
    seq_idx = ((pos[None] >= cuts[:, :1]).int() + (pos[None] >= cuts[:, 1:]).int()).to(torch.int32)
    labels[:, -3:] = -100

    ref = build_model_on_meta(args)
    ref.to_empty(device="cpu")
    init_weights(ref, seed=7)
    loss = cross_entropy_sum(ref(inputs, seq_idx=seq_idx), labels) / (labels != -100).sum()
    loss.backward()
    ref_norm = clip_grad_norm_(list(ref.parameters()), 1e-3)  # clips: the clipped grads are compared too
    ref_params = dict(ref.named_parameters())

    results = []
    for dp_replicate, dp_shard, ep in layouts:
        pdims = ParallelDims(pp=1, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, ep=ep, world_size=world)
        mesh = pdims.build_mesh("cpu")
        model = build_model_on_meta(args)
        apply_expert_parallel(model, pdims)
        apply_fsdp(model, mesh, Parallelism(), param_dtype=torch.float32, pdims=pdims)
        model.to_empty(device="cpu")
        init_weights(model, seed=7)
        for n, p in model.named_parameters():
            torch.testing.assert_close(whole(p), ref_params[n].detach(), rtol=0, atol=0, msg=f"init {n}")
        # experts get FSDP units only where they have replicas to reduce over (efsdp x dp_replicate > 1); else FSDP
        # leaves them out (no hooks) and they stay DTensors on the "ep" mesh
        replicated = dp_replicate * dp_shard // ep > 1
        for experts in expert_modules(model):
            assert isinstance(experts, FSDPModule) == replicated, (dp_replicate, dp_shard, ep)
            assert all((p.device_mesh.mesh_dim_names == ("ep",)) != replicated for p in experts.parameters())

        dp_rank = mesh["dp"].get_local_rank()
        rows = slice(dp_rank * B // pdims.dp, (dp_rank + 1) * B // pdims.dp)
        global_tokens = (labels != -100).sum().float()
        out = model(inputs[rows], seq_idx=seq_idx[rows])
        (cross_entropy_sum(out, labels[rows]) * (pdims.dp_cp / global_tokens)).backward()
        ReplicatedGradients([model], mesh["dp_cp"].get_group()).all_reduce()  # FSDP's small parameters, as train.py
        norm = clip_grad_norm_(list(model.parameters()), 1e-3)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        experts_seen, small = 0, 0
        for n, p in model.named_parameters():
            assert isinstance(p.grad, DTensor) or ".experts." not in n, n
            experts_seen += ".experts." in n
            small += not isinstance(p.grad, DTensor)
            torch.testing.assert_close(
                whole(p.grad),
                ref_params[n].grad,
                rtol=1e-4,
                atol=1e-7,
                msg=lambda m, n=n, where=(dp_replicate, dp_shard, ep): f"{where} grad {n}: {m}",
            )
        assert experts_seen == 6  # w1, w2, w3 of two MoE layers
        assert small > 0  # norms, conv, dt_bias, A_log, D: whole on every rank, reduced by ReplicatedGradients
        results.append((float(norm), float(ref_norm)))
        dist.barrier()
    return results


def test_ep_experts_module_matches_full_experts():
    # ep 2 of 4 ranks: two ep groups (ep 4, one group: test_ep_fsdp_model_gradients_and_norm_match_single_process)
    run_distributed(_experts_vs_full, 4, 2)


def test_ep_experts_grouped_mm_path_matches_full_experts():
    """The grouped-GEMM path's groups are padded by the regrouping copy (zero rows, dropped on the way back): a
    wrong pad, offset or inverse plan changes outputs or gradients (ep 2 of 4: 2 local experts per rank)."""
    run_distributed(_experts_vs_full, 4, 2, True)


def test_ep_fsdp_model_gradients_and_norm_match_single_process():
    layouts = [(1, 4, 2), (1, 4, 4), (2, 2, 2)]  # (dp_replicate, dp_shard, ep): efsdp 2; ep 4; HSDP x ep 2
    out = run_distributed(_model_grads_vs_single, 4, layouts)
    for per_rank in out:
        assert len(per_rank) == 3


@pytest.mark.parametrize("ep", [3])
def test_ep_that_does_not_divide_experts_fails_before_compute(tmp_path, ep):
    import os
    import subprocess
    import sys

    from tests.parity import REPO

    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "--job.config_file",
            "configs/hybrid_moe_debug.toml",
            "--parallelism.expert_parallel_degree",
            str(ep),
            "--training.global_batch_size",
            "-1",
            "--training.local_batch_size",
            "8",
            "--job.dump_folder",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ, WORLD_SIZE=str(ep), CUDA_VISIBLE_DEVICES=""),
    )
    assert r.returncode != 0 and "moe_num_experts=4" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("config, params_m", [("hybrid_1b", 1390.0), ("hybrid_moe_1b", 770.2)])
def test_1b_configs_resolve_and_validate(config, params_m):
    from configs.parser import load_config
    from models import build_model_on_meta

    cfg = load_config(["--job.config_file", f"configs/{config}.toml"])
    args = build_model_args(cfg.model.flavor, cfg.model_overrides)
    assert args.validate() == []
    n = sum(p.numel() for p in build_model_on_meta(args).parameters()) / 1e6
    assert abs(n - params_m) < 0.5, n
    if "E" in args.layer_types:  # 8 experts: ep 8 on 8 GPUs is valid, ep 16 (over 16 GPUs) is not
        assert validate_expert_parallel(args, ParallelDims(1, 1, 8, 1, 8, 8)) == []
        assert validate_expert_parallel(args, ParallelDims(1, 1, 16, 1, 16, 16))


def test_local_weights_cast_and_scale_in_one_node():
    """_LocalWeights hands out the weights in the compute dtype and returns their gradient in the stored dtype,
    scaled by 1/ep: upcast, then scale (as a separate cast node and the scale did), on plain tensors here."""
    from parallelisms.expert_parallel import _LocalWeights

    ws = [torch.randn(2, 3, 4, requires_grad=True) for _ in range(3)]
    outs = _LocalWeights.apply(0.5, torch.bfloat16, *ws)
    assert [o.dtype for o in outs] == [torch.bfloat16] * 3
    assert all(torch.equal(o, w.detach().to(torch.bfloat16)) for o, w in zip(outs, ws))
    gs = [torch.randn(2, 3, 4, dtype=torch.bfloat16) for _ in range(3)]
    grads = torch.autograd.grad(outs, ws, gs)
    assert all(g.dtype == torch.float32 and torch.equal(g, r.float() * 0.5) for g, r in zip(grads, gs))
    same = _LocalWeights.apply(0.25, None, *ws)  # no cast: views, gradients scaled
    assert all(o.dtype == torch.float32 and o.data_ptr() == w.data_ptr() for o, w in zip(same, ws))
    grads = torch.autograd.grad(same, ws, [g.float() for g in gs])
    assert all(torch.equal(g, r.float() * 0.25) for g, r in zip(grads, gs))


def test_host_counts_on_the_cpu_reads_the_values():
    from parallelisms.expert_parallel import HostCounts

    assert HostCounts(torch.tensor([[3, 0], [1, 7]])).wait() == [3, 0, 1, 7]
