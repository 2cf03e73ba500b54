"""optimizer.weight_copies through train.py on one GPU: bf16 autocast with the optimizer's weight copies gives the
losses and gradient norms of casting every weight at its use (the copies hold the same values), over 6 steps that
update the weights (packed documents, the fused loss, in_proj / out_proj / lm_head all reading copies)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.launch import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARGS = [
    "--job.config_file", "configs/debug.toml", "--training.steps", "6", "--training.seq_len", "512",
    "--training.local_batch_size", "4", "--training.mixed_precision_param", "bfloat16",
    "--training.deterministic", "true", "--metrics.log_freq", "1", "--checkpoint.enable", "false",
    "--metrics.enable_tensorboard", "false",
]  # fmt: skip


def test_weight_copies_give_the_losses_of_casting(tmp_path):
    cache = tmp_path / "triton"  # one autotuning cache: both runs use the same kernel configurations
    cast = train([*ARGS, "--optimizer.weight_copies", "false"], tmp_path / "cast", autotune_cache=cache)
    copies = train([*ARGS, "--optimizer.weight_copies", "true"], tmp_path / "copies", autotune_cache=cache)
    assert [r["step"] for r in copies] == list(range(1, 7))
    for key in ("loss", "grad_norm"):
        bad = [(a["step"], a[key], b[key]) for a, b in zip(cast, copies) if abs(a[key] - b[key]) > 1e-6 * abs(a[key])]
        assert not bad, f"{key} (step, cast, copies): {bad}"
    assert copies[-1]["loss"] < copies[0]["loss"]
