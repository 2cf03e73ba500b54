"""Validation: Validator against a direct loss computation, layout independence, evaluate.py vs in-training.

- Validator.run equals the token-mean cross-entropy computed by hand over the same validation batches, twice
  in a row (reset: the same batches every time), and leaves the model in training mode.
- evaluate.py on a training checkpoint gives the same loss in one process and under FSDP2 (validation rows per
  rank halved so that the global validation batches are the same), and the loss train.py's in-training
  validation logged at that step (needs the trainer's validation hook: metrics.jsonl records with val_loss).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from configs.parser import load_config
from tests.dist_utils import run_distributed
from tests.parity import REPO, read_metrics, run_training

ARGS = [
    "--job.config_file",
    "configs/debug.toml",
    "--model.d_model",
    "64",
    "--model.n_layers",
    "2",
    "--model.d_state",
    "16",
    "--model.headdim",
    "16",
    "--model.chunk_size",
    "16",
    "--model.tie_embeddings",
    "false",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "2",
    "--training.steps",
    "2",
    "--training.deterministic",
    "true",
    "--metrics.enable_tensorboard",
    "false",
    "--validation.steps",
    "3",
    "--validation.local_batch_size",
    "2",
]


def test_validator_matches_direct_loss():
    from components.validation import Validator
    from configs.checks import resolve_job
    from data.loader import IGNORE_INDEX, build_loader
    from data.tokenizer import build_tokenizer
    from models import Mamba2LM, build_model_args

    cfg = load_config(ARGS)
    torch.manual_seed(0)
    from models.init import init_weights

    model = Mamba2LM(build_model_args(cfg.model.flavor, cfg.model_overrides)).train()
    init_weights(model, seed=0)  # dt_bias / A_log / D start as torch.empty
    tok = build_tokenizer("")
    plan = resolve_job(cfg, 1).batch
    v = Validator(cfg, [model], tok, None, None, plan, torch.device("cpu"))
    got, again = v.run(1), v.run(2)
    assert model.training
    loader = build_loader(cfg, tok, plan, split="validation")
    loss_sum, n = 0.0, 0
    with torch.no_grad():
        for _ in range(3):
            b = loader.next_batch()
            logits = model(b["input_ids"], seq_idx=b["seq_idx"])
            loss_sum += torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            ).item()
            n += (b["labels"] != IGNORE_INDEX).sum().item()
    assert got["val_tokens"] == n
    assert abs(got["val_loss"] - loss_sum / n) <= 1e-5 * got["val_loss"]
    assert again["val_tokens"] == n and abs(again["val_loss"] - got["val_loss"]) <= 1e-7 * got["val_loss"]
    assert math.isclose(got["val_ppl"], math.exp(got["val_loss"]))
    assert v.maybe_run(3) == {} and v.maybe_run(3, last_step=True)["val_tokens"] == n
    from parallelisms.mesh import ParallelDims

    pp = ParallelDims(2, 1, 1, 1, 1, 2)
    with pytest.raises(ValueError, match="needs the training schedule"):  # PP validation runs through the schedule
        Validator(cfg, [model], tok, None, pp, plan, torch.device("cpu"))


def _fsdp_validation_body(rank, world):
    """FSDP2 over 2 gloo ranks: the sharded weights change in place between two validations, as a step replayed from a
    CUDA graph changes them (the optimizer on the shards, none of FSDP's Python run): the second validation must score
    the new weights. Without the reshard at its end, the root's unit stays gathered after the first and the second
    scores the old weights again."""
    from components.validation import Validator
    from configs.checks import resolve_job
    from data.tokenizer import build_tokenizer
    from parallelisms.grad_norm import local_shard
    from parallelisms.parallelize import build_model_parts

    one_row = ["--training.local_batch_size", "1", "--validation.local_batch_size", "1"]
    cfg = load_config([*ARGS, "--parallelism.data_parallel_shard_degree", "2", *one_row])
    job = resolve_job(cfg, world)
    mesh = job.pdims.build_mesh("cpu")
    model = build_model_parts(cfg, job.pdims, mesh, job.model_args, torch.device("cpu"), torch.float32).parts[0]
    sharded = [p for p in model.parameters() if p.dim() >= 2]  # FSDP's DTensors (the products' weights)
    v = Validator(cfg, [model], build_tokenizer(""), mesh, job.pdims, job.batch, torch.device("cpu"))
    first = v.run(1)
    # the module's parameters are the shards again (a gathered unit would show its plain unsharded tensors)
    resharded = all(type(p) is type(q) for p, q in zip(sharded, [p for p in model.parameters() if p.dim() >= 2]))
    with torch.no_grad():
        for p in sharded:
            local_shard(p).mul_(0.5)  # what the optimizer's step does to the shards between two replays
    second = v.run(2)
    for m in model.modules():  # FSDP's own way back to the shards, then the same batches again
        if hasattr(m, "reshard"):
            m.reshard()
    fresh = v.run(3)
    return first["val_loss"], second["val_loss"], fresh["val_loss"], resharded


def test_validation_under_fsdp_scores_the_current_shards():
    (first, second, fresh, resharded), other = run_distributed(_fsdp_validation_body, 2)
    assert other[:3] == (first, second, fresh)  # every rank reads the same all-reduced loss
    assert second != first and second == fresh, (first, second, fresh)
    assert resharded


def _evaluate(nproc: int, args: list[str]) -> dict:
    cmd = [sys.executable]
    if nproc > 1:
        cmd += [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=localhost:0",
        ]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(
        cmd + ["evaluate.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("evaluation: ")][-1]
    return json.loads(line[len("evaluation: ") :])


def test_evaluate_matches_in_training_validation(tmp_path):
    dump = ["--job.dump_folder", str(tmp_path)]
    run_training(
        1, ARGS + ["--checkpoint.enable", "true", "--validation.enable", "true", "--validation.freq", "2"], tmp_path
    )
    one = _evaluate(1, ARGS + dump + ["--checkpoint.load_step", "2"])
    assert one["checkpoint"].endswith("step-2") and one["val_tokens"] == 3 * 2 * 64
    # FSDP2: each rank reads 1 validation row per batch, so the global batches are the single-process ones
    two = _evaluate(
        2, ARGS + dump + ["--validation.local_batch_size", "1", "--parallelism.data_parallel_shard_degree", "2"]
    )
    assert two["val_tokens"] == one["val_tokens"]
    assert abs(two["val_loss"] - one["val_loss"]) <= 1e-5 * one["val_loss"]
    # A weights-only folder (as checkpoint.convert writes) evaluates the same
    from checkpoint.export import convert_to_weights_only

    convert_to_weights_only(str(tmp_path / "checkpoint" / "step-2"), str(tmp_path / "w"))
    w = _evaluate(
        1, ARGS + ["--job.dump_folder", str(tmp_path / "other"), "--checkpoint.initial_load_path", str(tmp_path / "w")]
    )
    assert w["val_loss"] == one["val_loss"]
    val = [r for r in read_metrics(tmp_path) if "val_loss" in r]
    if not val:
        pytest.skip("train.py has no validation hook yet (no val_loss in metrics.jsonl); see components/validation.py")
    at2 = [r for r in val if r["step"] == 2]
    assert at2, f"no val_loss record at step 2: {val}"
    assert abs(at2[-1]["val_loss"] - one["val_loss"]) <= 1e-6 * one["val_loss"]


def test_validation_under_pipeline_parallel_matches_one_process(tmp_path):
    """PP2: validation batches go through the schedule's forward-only pass; val_loss equals one process'."""
    from tests.parity import PARITY_ARGS, run_training

    args = PARITY_ARGS + [
        "--validation.enable",
        "true",
        "--validation.freq",
        "2",
        "--validation.steps",
        "2",
        "--validation.local_batch_size",
        "8",
    ]
    ref = {r["step"]: r["val_loss"] for r in run_training(1, args, tmp_path / "one") if "val_loss" in r}
    pp = {
        r["step"]: r["val_loss"]
        for r in run_training(2, args + ["--parallelism.pipeline_parallel_degree", "2"], tmp_path / "pp2")
        if "val_loss" in r
    }
    assert sorted(ref) == sorted(pp) == [2, 4]
    for step in ref:
        assert abs(pp[step] - ref[step]) <= 1e-5 * ref[step], (step, ref[step], pp[step])
