"""torchtitan's (0.2.2) own Trainer with the "mamba2" TrainSpec on GPUs (integrations/torchtitan), with mamba_ssm's
kernels where installed: the debug and hybrid MoE flavors train on one GPU (plain, and with torchtitan's
activation checkpointing + torch.compile flags), as do the two commands README.md gives; on 2 GPUs FSDP reproduces
one GPU (fp32, deterministic: losses and gradient norms to 1e-4 relative) and pipeline parallel (1F1B, untied head)
starts from the one-GPU loss and trains. Skips without CUDA or torchtitan (pip install the wheel, e.g.
../shared/gpu/wheels/torchtitan-0.2.2-*.whl, or -e ".[torchtitan]").
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchtitan")

from tests.gpu.launch import REPO, visible_gpus  # noqa: E402
from tests.test_torchtitan import run_torchtitan  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ARGS = [
    "--job.config_file",
    "integrations/torchtitan/mamba2_debug.toml",
    "--training.seq_len",
    "512",
    "--training.mixed_precision_param",
    "float32",
    "--debug.deterministic",
]


@pytest.fixture(autouse=True)
def _first_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible_gpus(2))


def test_debug_flavor_trains_on_one_gpu(tmp_path: Path):
    got = run_torchtitan(ARGS + ["--training.steps", "20"], tmp_path)[0]
    losses = got["loss"]
    print("torchtitan mamba2 debug, 1 GPU, loss per step:", [round(x, 3) for x in losses])
    assert len(losses) == 20 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0] - 1.0, losses


def test_hybrid_moe_flavor_trains(tmp_path: Path):
    """Mamba-2, attention, MLP and MoE layers (grouped_mm experts on CUDA, the expert-bias update after each step)."""
    flags = ["--model.flavor", "hybrid_moe_debug", "--training.steps", "10"]
    losses = run_torchtitan(ARGS + flags, tmp_path)[0]["loss"]
    assert losses[-1] < losses[0] - 0.5, losses


def test_activation_checkpointing_and_compile_train(tmp_path: Path):
    flags = ["--activation_checkpoint.mode", "full", "--compile.enable", "--training.steps", "10"]
    losses = run_torchtitan(ARGS + flags, tmp_path)[0]["loss"]
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs")
def test_fsdp2_matches_one_gpu(tmp_path: Path):
    steps = ["--training.steps", "5"]
    one = run_torchtitan(ARGS + steps + ["--training.local_batch_size", "8"], tmp_path / "one")[0]
    fsdp = run_torchtitan(ARGS + steps + ["--training.local_batch_size", "4"], tmp_path / "fsdp", nproc=2)[0]
    for key in ("loss", "grad_norm"):
        print(
            "FSDP2",
            key,
            "relative difference per step:",
            [f"{abs(a - b) / abs(a):.1e}" for a, b in zip(one[key], fsdp[key])],
        )
        torch.testing.assert_close(torch.tensor(fsdp[key]), torch.tensor(one[key]), rtol=1e-4, atol=0, msg=key)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs")
def test_pipeline_parallel_trains(tmp_path: Path):
    args = ARGS + ["--model.flavor", "debug_untied"]
    one = run_torchtitan(args + ["--training.steps", "1"], tmp_path / "one")[0]["loss"]
    pp = run_torchtitan(
        args + ["--training.steps", "10", "--parallelism.pipeline_parallel_degree", "2"], tmp_path / "pp", nproc=2
    )[1]["loss"]
    torch.testing.assert_close(torch.tensor(pp[0]), torch.tensor(one[0]), rtol=1e-4, atol=0)
    assert pp[-1] < pp[0] - 0.5, pp


USER_COMMANDS = {
    "our_launcher": ["-m", "integrations.torchtitan.train"],
    "torchtitan_custom_import": ["-m", "torchtitan.train", "--experimental.custom_import", "integrations.torchtitan"],
}


@pytest.mark.parametrize("entry", list(USER_COMMANDS.values()), ids=list(USER_COMMANDS))
def test_user_commands_train(tmp_path: Path, entry):
    """The two commands README.md gives, as a user runs them (torchrun, one GPU): torchtitan logs falling losses."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        *entry,
        *ARGS,
        "--training.steps",
        "10",
        "--job.dump_folder",
        str(tmp_path),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    log = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{log[-5000:]}"
    losses = [float(x) for x in re.findall(r"step:\s*\d+\s+loss:\s*([-\d.]+)", log)]
    assert len(losses) == 10 and losses[-1] < losses[0] - 0.5, losses
