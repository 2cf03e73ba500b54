"""Pipeline parallelism: the stage split (pure), validation errors, and a 2-rank pipeline under every enabled
schedule that (a) feeds every stage its own microbatch's seq_idx and (b) reproduces the single-process loss and
gradients of a packed multi-document batch."""

from __future__ import annotations

import copy
import gc
import itertools

import pytest
import torch
import torch.nn.functional as F

from configs.job_config import JobConfig
from models.args import ModelArgs
from parallelisms.batch_plan import BatchPlan
from parallelisms.mesh import ParallelDims
from parallelisms.pipeline import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    build_stage_module,
    canonical_schedule,
    ranges_from_pattern,
    split_layers,
    stage_ids_for_rank,
    stage_layer_ranges,
    validate_pipeline,
)
from tests.dist_utils import run_distributed


def sizes(ranges):
    return [len(r) for r in ranges]


# ------------------------------------------------------------------------------------------------ split unit tests
def test_even_split_covers_every_layer_once():
    for n in range(1, 30):
        for s in range(1, n + 1):
            rs = split_layers(n, s)
            assert [i for r in rs for i in r] == list(range(n))
            assert max(sizes(rs)) - min(sizes(rs)) <= 1 and min(sizes(rs)) >= 1


def test_even_split_examples():
    assert sizes(split_layers(24, 4)) == [6, 6, 6, 6]
    assert sizes(split_layers(48, 2)) == [24, 24]
    assert sizes(split_layers(5, 2)) == [2, 3]  # ties: the later stage takes the extra layer
    assert sizes(split_layers(10, 4)) == [2, 3, 2, 3]


def test_weighted_split_gives_end_stages_fewer_layers():
    # cost 24 + 2*2 = 28 over 4 stages = 7 each: first / last hold 5 layers + 2 of embedding / head cost
    assert sizes(split_layers(24, 4, first_last_weight=2)) == [5, 7, 7, 5]
    assert sizes(split_layers(48, 4, first_last_weight=4)) == [10, 14, 14, 10]
    # the minimum is one layer per stage, however heavy the ends
    assert sizes(split_layers(4, 4, first_last_weight=10)) == [1, 1, 1, 1]
    assert sizes(split_layers(6, 3, first_last_weight=100)) == [1, 4, 1]
    # a single stage ignores the weight
    assert sizes(split_layers(7, 1, first_last_weight=3)) == [7]

    # the largest stage cost is within one layer of the best possible (brute force over all cuts)
    def worst(cuts, n, s, w):
        e = [0, *cuts, n]
        return max((b - a) + (w if i in (0, s - 1) else 0) for i, (a, b) in enumerate(itertools.pairwise(e)))

    for n, s, w in [(12, 3, 1.0), (13, 4, 1.5), (20, 4, 3.0), (9, 2, 2.0)]:
        best = min(worst(c, n, s, w) for c in itertools.combinations(range(1, n), s - 1))
        rs = split_layers(n, s, w)
        assert worst([r.start for r in rs[1:]], n, s, w) <= best + 1, (n, s, w, sizes(rs))


def test_head_weight_gives_the_last_stage_fewer_layers():
    """pipeline_parallel_head_weight: the last stage's LM head + loss count as that many layers more."""
    # cost 48 + 2*1 + 4 = 54: two stages of 27 = 26 + 1 (embedding) and 22 + 1 + 4 (head)
    assert sizes(split_layers(48, 2, first_last_weight=1.0, head_weight=4)) == [26, 22]
    assert sizes(split_layers(48, 4, first_last_weight=1.0, head_weight=4)) == [12, 14, 13, 9]
    assert sizes(split_layers(48, 2, first_last_weight=1.0, head_weight=0)) == [24, 24]  # the default before 2026-11-28
    assert sizes(split_layers(7, 1, head_weight=5)) == [7]
    with pytest.raises(ValueError, match="pipeline_parallel_head_weight"):
        split_layers(8, 2, head_weight=-2)

    def worst(cuts, n, s, w, hw):  # the largest stage cost of a split (brute force below)
        e = [0, *cuts, n]
        return max(
            (b - a) + (w if i in (0, s - 1) else 0) + (hw if i == s - 1 else 0)
            for i, (a, b) in enumerate(itertools.pairwise(e))
        )

    for n, s, w, hw in [(12, 3, 1.0, 2.5), (24, 2, 1.0, 3.7), (20, 4, 0.0, 6.7), (9, 2, 1.0, 8.0)]:
        best = min(worst(c, n, s, w, hw) for c in itertools.combinations(range(1, n), s - 1))
        rs = split_layers(n, s, w, hw)
        assert worst([r.start for r in rs[1:]], n, s, w, hw) <= best + 1, (n, s, w, hw, sizes(rs))


def test_default_split_balances_the_head_at_1_3b():
    """The defaults (embedding 0, head -1: estimated) give the splits that measured best on 2 x H200 (2026-11-28):
    26 / 22 under 1F1B and 13 / 13 / 13 / 9 under Interleaved1F1B, against 24 / 24 and 11 / 13 / 12 / 12 before."""
    from models.args import build_model_args
    from parallelisms.pipeline import head_weight_in_layers

    p = JobConfig().parallelism
    head = head_weight_in_layers(build_model_args("1.3B"), 4096, p.pipeline_parallel_head_weight)
    w = p.pipeline_parallel_first_last_stage_weight
    assert sizes(split_layers(48, 2, w, head)) == [26, 22]
    assert sizes(split_layers(48, 4, w, head)) == [13, 13, 13, 9]


def test_head_weight_estimate():
    """-1 estimates the head's cost in layers from the FLOPs: larger for a smaller model at the same vocabulary."""
    from models.args import build_model_args
    from parallelisms.pipeline import head_weight_in_layers

    w13, w370 = (head_weight_in_layers(build_model_args(f), 4096, -1) for f in ("1.3B", "370M"))
    assert 3.0 < w13 < 4.5 and w370 > w13
    assert head_weight_in_layers(build_model_args("1.3B"), 4096, 2.5) == 2.5  # a given value is used as it is
    pd = ParallelDims(pp=2, dp_replicate=1, dp_shard=1, cp=1, ep=1, world_size=2)
    ok = ModelArgs(n_layers=4, tie_embeddings=False)
    assert _pipeline_errors(_cfg(pipeline_parallel_head_weight=-1.0), pd, ok) == []
    errs = _pipeline_errors(_cfg(pipeline_parallel_head_weight=-3.0), pd, ok)
    assert len(errs) == 1 and "pipeline_parallel_head_weight=-3.0" in errs[0]


def test_explicit_splits():
    assert sizes(stage_layer_ranges(24, "", 4, "1F1B", split_points=[4, 12, 20])) == [4, 8, 8, 4]
    assert stage_layer_ranges(9, "MM*|-ME|M|MM", 2, "Interleaved1F1B") == [
        range(3),
        range(3, 6),
        range(6, 7),
        range(7, 9),
    ]
    assert ranges_from_pattern("M*ME|M-ME") == [range(4), range(4, 8)]


def test_virtual_stages():
    assert sizes(stage_layer_ranges(8, "", 2, "Interleaved1F1B")) == [2, 2, 2, 2]  # 2 per rank by default
    assert sizes(stage_layer_ranges(12, "", 2, "LoopedBFS", layers_per_stage=2)) == [2] * 6
    assert sizes(stage_layer_ranges(4, "", 2, "1F1B")) == [2, 2]
    assert stage_ids_for_rank(0, 2, 4, "Interleaved1F1B") == [0, 2]
    assert stage_ids_for_rank(1, 4, 12, "LoopedBFS") == [1, 5, 9]
    assert stage_ids_for_rank(0, 2, 4, "ZBVZeroBubble") == [0, 3]
    assert stage_ids_for_rank(1, 2, 4, "ZBVZeroBubble") == [1, 2]
    assert canonical_schedule("interleaved1f1b") == "Interleaved1F1B"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(n_layers=3, pp=4, schedule="1F1B"), "only 3 layers"),
        (dict(n_layers=8, pp=2, schedule="1F1B", split_points=[4, 2]), "strictly increasing"),
        (dict(n_layers=8, pp=2, schedule="1F1B", split_points=[9]), r"must lie in \[1, 7\]"),
        (dict(n_layers=8, pp=2, schedule="1F1B", split_points=[2, 4]), "exactly one stage per rank"),
        (dict(n_layers=6, pp=2, schedule="1F1B", pattern="MM|MM|MM"), "exactly one stage per rank"),
        (dict(n_layers=6, pp=2, schedule="Interleaved1F1B", pattern="MM|MM|MM"), "do not divide"),
        (dict(n_layers=6, pp=2, schedule="Interleaved1F1B", pattern="MMM|MMM", layers_per_stage=1), "make them agree"),
        (dict(n_layers=4, pp=2, schedule="MyFancy"), "choose one of"),
        (dict(n_layers=4, pp=2, schedule="1F1B", pattern="MM||MM"), "empty pipeline stage"),
        (dict(n_layers=12, pp=2, schedule="ZBVZeroBubble", layers_per_stage=2), "exactly 2 stages per rank"),
    ],
)
def test_split_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        stage_layer_ranges(
            kw["n_layers"],
            kw.get("pattern", ""),
            kw["pp"],
            kw["schedule"],
            kw.get("layers_per_stage", -1),
            kw.get("split_points"),
        )


def _cfg(**parallelism):
    cfg = JobConfig()
    cfg.training.global_batch_size, cfg.training.local_batch_size = 8, 2
    for k, v in parallelism.items():
        setattr(cfg.parallelism, k, v)
    return cfg


def _pipeline_errors(cfg, pd, model_args) -> list[str]:
    """What configs/checks.py reports for the pipeline: the batch plan's errors, then validate_pipeline's."""
    plan = BatchPlan.from_config(cfg.training, cfg.parallelism, pd)
    return plan.errors() or validate_pipeline(cfg, pd, model_args, plan.n_microbatches)


def test_validate_pipeline_errors():
    pd = ParallelDims(pp=2, dp_replicate=1, dp_shard=1, cp=1, ep=1, world_size=2)
    ok = ModelArgs(n_layers=4, tie_embeddings=False)
    assert _pipeline_errors(_cfg(pipeline_parallel_degree=2), pd, ok) == []
    tied = ModelArgs(n_layers=4, tie_embeddings=True)
    assert _pipeline_errors(_cfg(pipeline_parallel_degree=2), pd, tied) == []  # tests/test_pipeline_tied.py
    errs = _pipeline_errors(_cfg(fsdp_cpu_offload=True), pd, tied)  # the tied gradient sum cannot reach the CPU
    assert len(errs) == 1 and "fsdp_cpu_offload false" in errs[0] and "tie_embeddings false" in errs[0]
    errs = _pipeline_errors(_cfg(pipeline_parallel_microbatch_size=3), pd, ok)
    assert len(errs) == 1 and "training.global_batch_size" in errs[0] and "microbatch_size=3" in errs[0]
    assert "--parallelism.pipeline_parallel_microbatch_size 2" in errs[0]  # a value that works
    errs = _pipeline_errors(_cfg(pipeline_parallel_schedule="Nope"), pd, ok)
    assert len(errs) == 1 and all(s in errs[0] for s in SCHEDULES)
    errs = _pipeline_errors(_cfg(), pd, ModelArgs(n_layers=1, tie_embeddings=False))
    assert len(errs) == 1 and "only 1 layers" in errs[0]
    errs = _pipeline_errors(_cfg(pipeline_parallel_microbatch_size=8), pd, ok)  # 1 microbatch < 2 stages
    assert len(errs) == 1 and "at least as many microbatches" in errs[0]
    pd4 = ParallelDims(pp=4, dp_replicate=1, dp_shard=1, cp=1, ep=1, world_size=4)
    errs = _pipeline_errors(
        _cfg(
            pipeline_parallel_schedule="Interleaved1F1B",
            pipeline_parallel_microbatch_size=1,
            pipeline_parallel_split_points=[1, 2, 3, 4, 5, 6, 7],
        ),
        pd4,
        ModelArgs(n_layers=8, tie_embeddings=False),
    )
    assert errs == []  # 8 microbatches, 2 rounds
    cfg = _cfg(pipeline_parallel_schedule="Interleaved1F1B")
    cfg.training.global_batch_size = 6  # 6 microbatches over pp 4: rounds = 1, fine; 10 over 4: 2 rounds, 10 % 2 = 0
    assert _pipeline_errors(cfg, pd4, ModelArgs(n_layers=8, tie_embeddings=False)) == []
    cfg.training.global_batch_size = 9  # 9 microbatches: 2 rounds, 9 % 2 != 0
    errs = _pipeline_errors(cfg, pd4, ModelArgs(n_layers=8, tie_embeddings=False))
    assert len(errs) == 1 and "multiple of" in errs[0]
    plan = BatchPlan.from_config(
        _cfg(pipeline_parallel_microbatch_size=2).training, _cfg(pipeline_parallel_microbatch_size=2).parallelism, pd
    )
    assert (plan.rows_per_dp_rank, plan.microbatch_rows, plan.n_microbatches) == (8, 2, 4)


def test_batch_plan_names_a_value_that_works():
    pd2 = ParallelDims(pp=1, dp_replicate=1, dp_shard=2, cp=1, ep=1, world_size=2)
    cfg = JobConfig()
    cfg.training.global_batch_size, cfg.training.local_batch_size = 8, 8  # 4 rows per rank, microbatches of 8
    plan = BatchPlan.from_config(cfg.training, cfg.parallelism, pd2)
    assert plan.errors() == [
        "training.global_batch_size / dp = 4 rows per data-parallel rank must divide by "
        "training.local_batch_size=8 (gradient accumulation steps); e.g. "
        "--training.local_batch_size 4"
    ]
    cfg.training.local_batch_size = -1  # follows the global batch: the rank's whole share, no accumulation
    plan = BatchPlan.from_config(cfg.training, cfg.parallelism, pd2)
    assert plan.errors() == [] and (plan.microbatch_rows, plan.n_microbatches) == (4, 1)
    cfg.training.global_batch_size = 7
    assert (
        "e.g. --training.global_batch_size 6" in BatchPlan.from_config(cfg.training, cfg.parallelism, pd2).errors()[0]
    )


def test_stage_module_keeps_fqns():
    from models import build_model_on_meta

    model = build_model_on_meta(
        ModelArgs(d_model=32, n_layers=4, d_state=8, headdim=8, vocab_size=64, tie_embeddings=False)
    )
    first = build_stage_module(model, range(2), True, False, "stack")
    last = build_stage_module(model, range(2, 4), False, True, "stack")
    assert first.norm_f is None and first.lm_head is None and last.tok_embeddings is None
    assert list(first.layers) == ["0", "1"] and list(last.layers) == ["2", "3"]
    whole = set(model.state_dict())
    parts = set(first.state_dict()) | set(last.state_dict())
    assert parts == whole and not set(first.state_dict()) & set(last.state_dict())
    assert first.pack_format == "stack" and model.pack_format == "sum"  # the original is untouched


# ------------------------------------------------------------------------- the 2-rank pipeline vs one process
ARGS = dict(d_model=32, n_layers=4, d_state=8, headdim=8, chunk_size=8, vocab_size=64, tie_embeddings=False)
ROWS, SEQ = 4, 32


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (ROWS, SEQ), generator=g)
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = -100
    # a different set of document starts in every row, so every microbatch's seq_idx is distinct
    starts = torch.rand(ROWS, SEQ, generator=g) < 0.15
    starts[:, 0] = False
    seq_idx = starts.cumsum(1).to(torch.int32)
    return tokens, labels, seq_idx


def _ce_sum(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100, reduction="sum")


def _pipeline_worker(rank, world_size, schedules, pack):
    from models.init import init_weights
    from models.mamba2.model import Mamba2LM
    from parallelisms.pipeline import pipeline_model

    reference = Mamba2LM(ModelArgs(**ARGS))
    init_weights(reference, seed=0)
    tokens, labels, seq_idx = _batch()
    n_tokens = float((labels != -100).sum())
    ref_loss = _ce_sum(reference(tokens, seq_idx=seq_idx), labels)
    with torch.no_grad():  # the documents matter: ignoring the boundaries changes the loss
        assert abs(_ce_sum(reference(tokens), labels) - ref_loss) > 1e-4 * ref_loss
    (ref_loss / n_tokens).backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    pdims = ParallelDims(pp=2, dp_replicate=1, dp_shard=1, cp=1, ep=1, world_size=2)
    mesh = pdims.build_mesh("cpu")
    out = {}
    for schedule_name in schedules:
        cfg = JobConfig()
        cfg.training.global_batch_size, cfg.training.local_batch_size = ROWS, 1
        cfg.parallelism.pipeline_parallel_degree = 2
        cfg.parallelism.pipeline_parallel_schedule = schedule_name
        cfg.parallelism.pipeline_parallel_pack = pack
        cfg.parallelism.pipeline_parallel_microbatch_size = 1
        seen: dict[int, list] = {}

        def parallelize(part, seen=seen):
            # the probe: the seq_idx every forward of this stage received, in call order
            key = min(int(k) for k in part.layers)
            seen[key] = []

            part.register_buffer("probe_calls", torch.zeros((), dtype=torch.int64), persistent=False)

            def probe(module, args, kwargs):
                module.probe_calls += 1  # a forward-updated buffer, like the MoE load counters
                s = kwargs.get("seq_idx")
                if s is not None and s.device.type != "meta":
                    seen[key].append(s.clone())

            part.register_forward_pre_hook(probe, with_kwargs=True)
            return part

        model = copy.deepcopy(reference)
        model.zero_grad(set_to_none=True)
        schedule, parts, has_first, has_last = pipeline_model(
            model, mesh, pdims, cfg, torch.device("cpu"), lambda lg, lb: _ce_sum(lg, lb) / n_tokens, parallelize, ROWS
        )
        losses = [] if has_last else None
        if has_first:
            schedule.step(tokens, seq_idx=seq_idx, target=labels if has_last else None, losses=losses)
        else:
            schedule.step(seq_idx=seq_idx, target=labels if has_last else None, losses=losses)
        loss = torch.stack(losses).sum().item() * n_tokens if has_last else None
        grad_err = max(
            (p.grad - ref_grads[n]).abs().max().item() / (ref_grads[n].abs().max().item() + 1e-12)
            for part in parts
            for n, p in part.named_parameters()
        )
        expected = [seq_idx[i : i + 1] for i in range(ROWS)]
        for v in seen.values():
            # torch 2.13 runs each stage once more at the first step to infer the inter-stage shapes, on the
            # first microbatch's real keyword inputs (torch 2.11 on meta tensors, which the probe skips)
            if len(v) == ROWS + 1 and torch.equal(v[0], expected[0]):
                v.pop(0)
        probes_ok = {k: len(v) == ROWS and all(torch.equal(a, b) for a, b in zip(v, expected)) for k, v in seen.items()}
        # torch's extra shape-inference forward must leave no trace in buffers: one count per microbatch
        probes_ok.update({f"calls{i}": int(part.probe_calls) == ROWS for i, part in enumerate(parts)})
        out[schedule_name] = dict(
            loss=loss,
            ref=ref_loss.item(),
            grad_err=grad_err,
            probes_ok=probes_ok,
            has_first=has_first,
            has_last=has_last,
            n_seen=[len(v) for v in seen.values()],
        )
    return out


def _check(results, schedules):
    for name in schedules:
        per_rank = [r[name] for r in results]
        n_stages = 4 if name in MULTI_STAGE_SCHEDULES else 2
        assert sum(len(r["probes_ok"]) for r in per_rank) == 2 * n_stages, (name, per_rank)
        for r in per_rank:
            # (a) every stage's forward saw exactly the seq_idx rows of its own microbatch, in order
            assert all(r["probes_ok"].values()), (name, r)
            # (b) the gradients of the owned parameters match the single-process ones
            assert r["grad_err"] < 1e-5, (name, r["grad_err"])
        last = [r for r in per_rank if r["has_last"]]
        assert len(last) == 1 and abs(last[0]["loss"] - last[0]["ref"]) <= 1e-5 * abs(last[0]["ref"]), (name, last)


@pytest.mark.parametrize("pack", ["stack", "sum"])
def test_every_stage_sees_its_microbatch_seq_idx_and_matches_single_process(pack):
    _check(run_distributed(_pipeline_worker, 2, list(SCHEDULES), pack), SCHEDULES)


class _Scale(torch.autograd.Function):
    """y = x * w as a custom autograd.Function: its backward node is Python's, like mamba_ssm's fused scan."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad_y):
        x, w = ctx.saved_tensors
        return grad_y * w, grad_y * x


def test_weight_step_after_input_step_through_a_custom_function():
    """Zero-bubble schedules split the backward: input gradients, outputs detached, weight gradients later. The
    weight step starts from a custom Function's node (torch 2.11 had freed it by then); gradients are exact."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from parallelisms.pipeline import keep_graph_for_weight_grads

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5))
    x = torch.randn(5, requires_grad=True)
    out = _Scale.apply(x, w).sin() * 2
    dx, groups = keep_graph_for_weight_grads(stage_backward_input)([out], [torch.ones(5)], [x], iter([w]))
    gc.collect()
    stage_backward_weight(iter([w]), groups)
    x_, w_ = x.detach(), w.detach()
    torch.testing.assert_close(w.grad, 2 * x_ * torch.cos(x_ * w_), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx[0], 2 * w_ * torch.cos(x_ * w_), rtol=1e-6, atol=1e-6)


class _AddNorm(torch.autograd.Function):
    """(x, res, w) -> (rmsnorm(x + res) * w, x + res): one node, two outputs, like mamba_ssm's fused add + norm."""

    @staticmethod
    def forward(ctx, x, res, w):
        s = x + res
        r = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
        ctx.save_for_backward(s, r, w)
        return s * r * w, s

    @staticmethod
    def backward(ctx, grad_y, grad_s):
        s, r, w = ctx.saved_tensors
        n = s * r
        grad_n = grad_y * w
        grad_sum = r * (grad_n - n * (grad_n * n).mean(-1, keepdim=True)) + grad_s
        return grad_sum, grad_sum, (grad_y * n).sum(0)


def test_split_backward_through_a_two_output_node():
    """The weight step behind a two-output node gives the plain backward's gradients on torch >= 2.13 (torch 2.11
    feeds the two outputs' summed gradient into the first: off by ~0.9 here, hence split_backward_error)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.torch_version import TorchVersion

    from parallelisms.pipeline import keep_graph_for_weight_grads

    if TorchVersion(torch.__version__) < (2, 13):
        pytest.skip("torch < 2.13 gets this wrong; zero-bubble schedules are refused on GPUs there")
    torch.manual_seed(0)
    w, v = torch.nn.Parameter(torch.randn(6)), torch.nn.Parameter(torch.randn(6))
    x, res = torch.randn(3, 6, requires_grad=True), torch.randn(3, 6)

    def loss():
        y, s = _AddNorm.apply(x, res, w)
        return ((y * v).tanh() + s.sin()).sum()

    loss().backward()
    expected = [t.grad.clone() for t in (w, v, x)]
    w.grad = v.grad = x.grad = None
    _, groups = keep_graph_for_weight_grads(stage_backward_input)([loss()], None, [x], iter([w, v]))
    stage_backward_weight(iter([w, v]), groups)
    for got, want in zip((w.grad, v.grad, x.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_zero_bubble_on_gpus_needs_torch_2_13():
    from parallelisms.pipeline import split_backward_error

    err = split_backward_error("ZBVZeroBubble", on_gpu=True, torch_version="2.11.0+cu130")
    assert "torch >= 2.13" in err and "1F1B" in err
    assert split_backward_error("InterleavedZeroBubble", True, "2.12.1") is not None
    assert split_backward_error("ZBVZeroBubble", True, "2.13.0") is None
    assert split_backward_error("ZBVZeroBubble", False, "2.11.0") is None  # the CPU references: no two-output node
    assert split_backward_error("1F1B", True, "2.11.0") is None
