"""Context parallel on GPUs (NCCL all-to-alls, the overlapped in_proj / all-to-all of the Mamba mixer, the mamba_ssm
kernels on the whole sequence of a rank's heads) through the trainer, against one GPU.

fp32 + deterministic, one shared Triton autotune cache: losses and gradient norms of 6 steps agree to 1e-4 / 1e-3
relative (GPU reductions run in another order than on one GPU, so not the CPU's 1e-5). The hybrid debug model adds
attention's CP and MoE layers. Needs >= 2 GPUs.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.launch import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs")]

COMMON = [
    "--training.seq_len",
    "512",
    "--training.global_batch_size",
    "4",
    "--training.steps",
    "6",
    "--lr_scheduler.warmup_steps",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--checkpoint.enable",
    "false",
    "--training.mixed_precision_param",
    "float32",
    "--training.deterministic",
    "true",
]
MODELS = {
    "mamba": ["--job.config_file", "configs/debug.toml"],
    "hybrid_moe": ["--job.config_file", "configs/hybrid_moe_debug.toml", "--model.moe_load_balance_coeff", "1e-2"],
}
CP2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]


def _close(ref: list[dict], got: list[dict], key: str, rtol: float) -> None:
    a, b = {r["step"]: r[key] for r in ref}, {r["step"]: r[key] for r in got}
    assert sorted(a) == sorted(b)
    bad = [(s, a[s], b[s]) for s in a if abs(a[s] - b[s]) > rtol * abs(a[s])]
    assert not bad, f"{key} mismatch (step, one GPU, cp 2): {bad}"


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("balanced", [False, True], ids=["plain", "load-balanced"])
def test_fp32_cp2_matches_one_gpu(tmp_path, model, balanced):
    cache = tmp_path / "triton_cache"
    args = MODELS[model] + COMMON
    ref = train(args, tmp_path / "one_gpu", 1, autotune_cache=cache)
    got = train(
        args + CP2 + ["--parallelism.context_parallel_load_balance", str(balanced).lower()],
        tmp_path / "cp2",
        2,
        autotune_cache=cache,
    )
    _close(ref, got, "loss", 1e-4)
    _close(ref, got, "grad_norm", 1e-3)
