"""The 8-process composition (issue 8's CPU part): PP2 x CP2 x FSDP2, and the hybrid MoE with EP2 borrowed
from dp_shard x cp, reproduce the single-process losses (and gradient norms) on 8 gloo processes; a checkpoint
saved under that layout resumes under PP1 x FSDP8."""

import shutil

import pytest

from tests.parity import PARITY_ARGS, assert_same_losses, losses_by_step, run_training
from tests.test_parity_hybrid import HYBRID_ARGS, assert_parity

P = "--parallelism"
PP2_CP2_FSDP2 = [
    f"{P}.pipeline_parallel_degree",
    "2",
    f"{P}.context_parallel_degree",
    "2",
    f"{P}.data_parallel_shard_degree",
    "2",
    f"{P}.pipeline_parallel_microbatch_size",
    "2",
]


def test_mamba_pp2_cp2_fsdp2_on_8_processes(parity_reference, tmp_path):
    ref = parity_reference
    assert_same_losses(ref, run_training(8, PARITY_ARGS + PP2_CP2_FSDP2, tmp_path / "pp2cp2fsdp2", timeout=900))


@pytest.mark.slow
def test_hybrid_pp2_cp2_fsdp2_ep2_on_8_processes(tmp_path):
    ref = run_training(1, HYBRID_ARGS, tmp_path / "ref")
    got = run_training(
        8, HYBRID_ARGS + PP2_CP2_FSDP2 + [f"{P}.expert_parallel_degree", "2"], tmp_path / "composed", timeout=900
    )
    assert_parity(ref, got)


@pytest.mark.slow
def test_composed_checkpoint_resumes_under_fsdp8(tmp_path):
    args = PARITY_ARGS + ["--checkpoint.enable", "true", "--checkpoint.interval", "2"]
    whole = run_training(1, args, tmp_path / "whole")
    run_training(8, args + PP2_CP2_FSDP2, tmp_path / "composed", timeout=900)
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "composed" / "checkpoint" / "step-2", resumed_dir / "checkpoint" / "step-2")
    # 8 rows per step over 8 ranks: one row each, so one row per microbatch (the global batch is unchanged)
    resumed = run_training(
        8, args + [f"{P}.data_parallel_shard_degree", "8", "--training.local_batch_size", "1"], resumed_dir, timeout=900
    )
    assert min(losses_by_step(resumed)) == 3
    assert_same_losses(whole, resumed, steps=[3, 4])
