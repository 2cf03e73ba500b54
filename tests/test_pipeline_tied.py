"""Tied embeddings under pipeline parallel (issue 16, item 12): the first and the last stage hold copies of the one
tied weight, their gradients are summed every step, the norm counts the weight once, the copies stay bit-identical,
and train.py reproduces the tied single-process run under PP2 (also with FSDP, Interleaved1F1B and ZBV, where one
rank holds both copies); a checkpoint of either layout resumes under the other."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint import FileSystemReader

from models.args import ModelArgs
from parallelisms.pipeline import build_stage_module
from tests.dist_utils import run_distributed
from tests.parity import PARITY_ARGS, assert_same_losses, losses_by_step, run_training

ARGS = dict(d_model=32, n_layers=4, d_state=8, headdim=8, chunk_size=8, vocab_size=64, tie_embeddings=True)
ROWS, SEQ, STEPS, LR = 4, 16, 3, 1e-2
MAX_NORM = 0.5  # below the gradient norms of these steps, so a wrong norm changes every update


def test_tied_stage_modules():
    from models import build_model_on_meta

    model = build_model_on_meta(ModelArgs(**ARGS))
    first = build_stage_module(model, range(2), True, False, "sum")
    last = build_stage_module(model, range(2, 4), False, True, "sum")
    assert first.embeds_tokens and first.lm_head is None
    # the last stage keeps the embedding as the owner of its head's weight, under the same FQN, and does not embed
    assert not last.embeds_tokens and last.lm_head.weight is last.tok_embeddings.weight
    assert set(first.state_dict()) | set(last.state_dict()) == set(model.state_dict())
    packed = torch.empty(1, 8, ARGS["d_model"], device="meta")  # the packed inter-stage tensor ("sum") in, logits out
    assert last(packed).shape == (1, 8, ARGS["vocab_size"])


def test_tied_weight_is_saved_once_and_older_checkpoints_with_the_alias_still_load(tmp_path):
    import torch.distributed.checkpoint as dcp

    from checkpoint.export import ModelState, load_model_weights
    from models.init import init_weights
    from models.mamba2.model import Mamba2LM

    model = Mamba2LM(ModelArgs(**ARGS))
    init_weights(model, seed=0)
    assert "lm_head.weight" not in ModelState([model]).state_dict()  # the alias is not written twice
    older = {k: v.clone() + 1.0 for k, v in model.state_dict().items()}  # as saved before: both names
    older["lm_head.weight"] = older["tok_embeddings.weight"]
    dcp.save(older, checkpoint_id=str(tmp_path / "older"))
    load_model_weights([model], str(tmp_path / "older"))
    assert torch.equal(model.tok_embeddings.weight, older["tok_embeddings.weight"])
    assert model.lm_head.weight is model.tok_embeddings.weight


def _ce_sum(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100, reduction="sum")


def _tied_worker(rank, world_size, schedules):
    from configs.job_config import JobConfig
    from models.init import init_weights
    from models.mamba2.model import Mamba2LM
    from parallelisms.grad_norm import clip_grad_norm_
    from parallelisms.mesh import ParallelDims
    from parallelisms.pipeline import pipeline_model
    from parallelisms.tied_weights import sum_tied_embedding_grads

    reference = Mamba2LM(ModelArgs(**ARGS))
    init_weights(reference, seed=0)
    tokens = torch.randint(0, ARGS["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(tokens, -1, 1)
    labels[:, -1] = -100
    n_tokens = float((labels != -100).sum())

    def loss_fn(logits, lbl):
        return _ce_sum(logits, lbl) / n_tokens

    def adamw(module):
        return torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=0.1)

    one = copy.deepcopy(reference)
    opt = adamw(one)
    ref_losses, ref_norms = [], []
    for _ in range(STEPS):
        loss = loss_fn(one(tokens), labels)
        loss.backward()
        ref_norms.append(clip_grad_norm_(list(one.parameters()), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())

    pdims = ParallelDims(pp=2, dp_replicate=1, dp_shard=1, cp=1, ep=1, world_size=2)
    mesh = pdims.build_mesh("cpu")
    out = {}
    for schedule_name in schedules:
        cfg = JobConfig()
        cfg.training.global_batch_size, cfg.training.local_batch_size = ROWS, 1
        cfg.parallelism.pipeline_parallel_degree = 2
        cfg.parallelism.pipeline_parallel_schedule = schedule_name
        cfg.parallelism.pipeline_parallel_microbatch_size = 1
        schedule, parts, has_first, has_last = pipeline_model(
            copy.deepcopy(reference), mesh, pdims, cfg, torch.device("cpu"), loss_fn, lambda part: part, ROWS
        )
        opts = [adamw(part) for part in parts]
        params = [p for part in parts for p in part.parameters()]
        losses, norms = [], []
        for _ in range(STEPS):
            mb_losses = [] if has_last else None
            target = labels if has_last else None
            if has_first:
                schedule.step(tokens, target=target, losses=mb_losses)
            else:
                schedule.step(target=target, losses=mb_losses)
            sum_tied_embedding_grads(parts)
            norms.append(clip_grad_norm_(params, MAX_NORM, pp_group=mesh["pp"].get_group()).item())
            for o in opts:
                o.step()
                o.zero_grad()
            losses.append(torch.stack(mb_losses).sum().item() if has_last else None)
        copies = {
            ("first" if part.embeds_tokens else "last"): part.tok_embeddings.weight.detach().clone()
            for part in parts
            if part.tok_embeddings is not None
        }
        out[schedule_name] = dict(losses=losses, norms=norms, copies=copies)
    return dict(ref_losses=ref_losses, ref_norms=ref_norms, ref_weight=one.tok_embeddings.weight.detach(), **out)


@pytest.mark.parametrize("schedules", [["1F1B", "ZBVZeroBubble"]])
def test_tied_copies_get_one_gradient_and_stay_identical(schedules):
    """1F1B: the copies on two ranks (summed over the pp pair); ZBVZeroBubble: both on rank 0 (summed there)."""
    results = run_distributed(_tied_worker, 2, schedules)
    ref = results[0]
    for name in schedules:
        per_rank = [r[name] for r in results]
        copies = {k: v for r in per_rank for k, v in r["copies"].items()}
        assert set(copies) == {"first", "last"}, name
        # the same gradient, clip factor and optimizer state on both copies: bit-identical after every step
        assert torch.equal(copies["first"], copies["last"]), name
        torch.testing.assert_close(copies["first"], ref["ref_weight"], rtol=1e-5, atol=1e-5)
        for r in per_rank:  # the global norm counts the tied weight once (every rank holds the same value)
            torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["ref_norms"]), rtol=1e-5, atol=0)
        losses = next(r["losses"] for r in per_rank if r["losses"][0] is not None)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["ref_losses"]), rtol=1e-5, atol=0)


def _group_worker(rank, world_size):
    from parallelisms.mesh import ParallelDims
    from parallelisms.tied_weights import build_tied_embedding_group

    pdims = ParallelDims(pp=3, dp_replicate=1, dp_shard=2, cp=1, ep=1, world_size=6)
    mesh = pdims.build_mesh("cpu")
    group = build_tied_embedding_group(mesh, 3, [0, 2])
    if group is None:
        return None
    x = torch.tensor([float(rank)])
    torch.distributed.all_reduce(x, group=group)
    return x.item()


@pytest.mark.slow
def test_tied_group_pairs_the_first_and_last_pp_rank_of_each_column():
    """pp 3 x dp_shard 2 (global rank = 2 * pp_rank + dp_rank): the copies live on pp ranks 0 and 2, so the groups
    are {0, 4} and {1, 5}, and the middle pp rank (global 2, 3) belongs to none."""
    assert run_distributed(_group_worker, 6) == [4.0, 6.0, None, None, 4.0, 6.0]


# ------------------------------------------------------------------------------ train.py vs one process
TIED = PARITY_ARGS + ["--model.tie_embeddings", "true"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
PP2_FSDP2 = PP2 + ["--parallelism.data_parallel_shard_degree", "2"]


def assert_same_norms(ref: list[dict], got: list[dict], rtol: float = 1e-5) -> None:
    """The logged gradient norms (the tied weight counted once, like one process) match step by step."""
    ref_n, got_n = {r["step"]: r["grad_norm"] for r in ref}, {r["step"]: r["grad_norm"] for r in got}
    bad = [(s, ref_n[s], got_n.get(s)) for s in ref_n if s not in got_n or abs(got_n[s] - ref_n[s]) > rtol * ref_n[s]]
    assert not bad, f"grad_norm mismatch (step, reference, got): {bad}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_training(1, TIED, tmp_path_factory.mktemp("tied_ref"))


@pytest.mark.parametrize(
    "nproc, layout",
    [
        (2, PP2),
        pytest.param(4, PP2_FSDP2, marks=pytest.mark.slow),
        # 4 virtual stages of one layer, two per rank: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
        pytest.param(2, PP2 + ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], marks=pytest.mark.slow),
        # the V: rank 0 holds stages 0 and 3, so both copies of the tied weight
        pytest.param(2, PP2 + ["--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"], marks=pytest.mark.slow),
        # pp 4: the copies on pp ranks 0 and 3, summed over a group of just those two (one per dp column)
        pytest.param(4, ["--parallelism.pipeline_parallel_degree", "4"], marks=pytest.mark.slow),
    ],
    ids=["pp2", "pp2xfsdp2", "pp2-interleaved1f1b", "pp2-zbv", "pp4"],
)
def test_tied_pipeline_matches_single_process(reference, tmp_path, nproc, layout):
    got = run_training(nproc, TIED + layout, tmp_path)
    assert_same_losses(reference, got)
    assert_same_norms(reference, got)


def _tied_keys(step_dir) -> set[str]:
    keys = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return {k for k in keys if "tok_embeddings" in k or "lm_head" in k}


@pytest.mark.slow
@pytest.mark.parametrize(
    "save, resume",
    [
        ((2, PP2), (1, [])),
        ((1, []), (2, PP2)),
        ((4, PP2_FSDP2), (1, [])),  # both stages write the same shards of the tied weight and its optimizer state
    ],
    ids=["pp2-to-one-process", "one-process-to-pp2", "pp2xfsdp2-to-one-process"],
)
def test_tied_checkpoint_resumes_in_the_other_layout(reference, tmp_path, save, resume):
    """A step-2 checkpoint written under one layout resumes under the other with the uninterrupted losses; every
    layout writes the tied weight once, under the embedding's name."""
    args = TIED + ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    run_training(save[0], args + save[1], tmp_path / "first")
    step2 = tmp_path / "first" / "checkpoint" / "step-2"
    keys = _tied_keys(step2)
    assert {k for k in keys if k.startswith("model.")} == {"model.tok_embeddings.weight"}  # one tensor
    optimizer_keys = {k for k in keys if k.startswith("optimizer.state.")}
    assert optimizer_keys == {f"optimizer.state.tok_embeddings.weight.{s}" for s in ("step", "exp_avg", "exp_avg_sq")}
    shutil.copytree(step2, tmp_path / "resumed" / "checkpoint" / "step-2")
    resumed = run_training(resume[0], args + resume[1], tmp_path / "resumed")
    assert sorted(losses_by_step(resumed)) == [3, 4]
    assert_same_losses(reference, resumed, steps=[3, 4])
