"""Pipeline parallel on 2 GPUs through the trainer, with mamba_ssm's kernels: every schedule kind reproduces one GPU.

Zero-bubble schedules split each stage's backward into an input-gradient step and a weight-gradient step; on GPUs
the weight step starts from mamba_ssm's custom autograd Functions (torch 2.11 lost those nodes: see
parallelisms.pipeline.keep_graph_for_weight_grads). fp32 + deterministic kernels; the losses and gradient norms
of the first steps agree to 1e-4 relative (microbatches change the order of GPU sums, not the maths).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.launch import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs")]

ARGS = ["--job.config_file", "configs/debug.toml", "--training.steps", "5", "--training.seq_len", "512",
        "--training.global_batch_size", "8", "--training.local_batch_size", "8", "--metrics.log_freq", "1",
        "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false", "--model.tie_embeddings", "false",
        "--training.mixed_precision_param", "float32", "--training.deterministic", "true"]


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    return train(ARGS, tmp_path_factory.mktemp("one"))


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", "ZBVZeroBubble"])
def test_pp2_matches_one_gpu(one_gpu, tmp_path: Path, schedule):
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", schedule,
          "--parallelism.pipeline_parallel_microbatch_size", "2"]
    got = train(ARGS + pp, tmp_path / schedule, nproc=2)
    assert [r["step"] for r in got] == [r["step"] for r in one_gpu]
    for key in ("loss", "grad_norm"):
        print(schedule, key, "relative difference per step:",
              [f"{abs(a[key] - b[key]) / abs(a[key]):.1e}" for a, b in zip(one_gpu, got)])
        bad = [(a["step"], a[key], b[key]) for a, b in zip(one_gpu, got) if abs(a[key] - b[key]) > 1e-4 * abs(a[key])]
        assert not bad, f"PP2 {schedule} {key} (step, 1 GPU, PP2): {bad}"
