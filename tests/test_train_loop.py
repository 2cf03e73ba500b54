"""The training loop's own behaviour: LR schedules, gradient accumulation, stopping on a non-finite loss."""

import math
import subprocess
import sys

import pytest

from components.optimizer import lr_factor
from tests.parity import PARITY_ARGS, REPO, assert_same_losses, run_training


def test_warmup_then_cosine_to_min():
    f = [lr_factor(i, 20, warmup=4, decay_ratio=-1, decay_type="cosine", min_lr_factor=0.1) for i in range(20)]
    assert f[:4] == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5])
    assert f[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 16)))
    assert f[-1] == pytest.approx(0.1) and all(a >= b for a, b in zip(f[4:], f[5:]))


def test_warmup_stable_decay():
    f = [lr_factor(i, 20, warmup=2, decay_ratio=0.25, decay_type="linear", min_lr_factor=0.0) for i in range(20)]
    decay_steps = round(18 * 0.25)  # 4 (banker's rounding of 4.5)
    assert f[2 : 20 - decay_steps] == [1.0] * (18 - decay_steps)
    assert f[-decay_steps:] == pytest.approx([0.75, 0.5, 0.25, 0.0])


def test_gradient_accumulation_equals_one_big_batch(parity_reference, tmp_path):
    one_pass = run_training(1, PARITY_ARGS + ["--training.local_batch_size", "8"], tmp_path / "big")
    assert_same_losses(one_pass, parity_reference)  # PARITY_ARGS: 4 microbatches of 2 rows


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            *PARITY_ARGS,
            "--optimizer.lr",
            "1e4",
            "--training.steps",
            "6",
            "--lr_scheduler.warmup_steps",
            "0",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "1",
            "--job.dump_folder",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0
    assert "loss is nan at step" in r.stderr and "the newest complete checkpoint is step-" in r.stderr, r.stderr[-2000:]
    bad_step = int(r.stderr.split("loss is nan at step ")[1].split(":")[0])
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoint").glob("step-*"))
    assert (
        saved and saved[-1] == bad_step - 1 and (tmp_path / "checkpoint" / f"step-{saved[-1]}" / ".metadata").exists()
    )


def test_chunked_cross_entropy_matches_full_logits():
    import torch

    from models.loss import chunked_cross_entropy_sum, cross_entropy_sum

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 37, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (2, 37), generator=g)
    labels[0, 3] = labels[1, 30] = -100
    for chunk in (1, 10, 74, 100):
        got = chunked_cross_entropy_sum(h, w, labels, chunk)
        want = cross_entropy_sum(h @ w.T, labels)
        torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)
        for a, b in zip(torch.autograd.grad(got, (h, w)), torch.autograd.grad(want, (h, w))):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_chunked_loss_through_the_trainer(parity_reference, tmp_path):
    full = parity_reference
    chunked = run_training(1, PARITY_ARGS + ["--training.loss_chunk_tokens", "24"], tmp_path / "chunked")
    assert_same_losses(full, chunked)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_the_losses(parity_reference, tmp_path, mode):
    plain = parity_reference
    ac = run_training(1, PARITY_ARGS + ["--activation_checkpoint.mode", mode], tmp_path / mode)
    assert_same_losses(plain, ac)


def test_document_masking_off_treats_rows_as_one_stream(parity_reference, tmp_path):
    """Without document masking the state runs across documents: different losses, and the same under PP."""
    masked = parity_reference
    stream = run_training(1, PARITY_ARGS + ["--training.document_masking", "false"], tmp_path / "stream")
    # state now flows across document starts: beyond the 1e-5 parity tolerance of identical runs
    assert any(abs(a["loss"] - b["loss"]) > 1e-5 * a["loss"] for a, b in zip(masked[1:], stream[1:]))
    pp = run_training(
        2,
        PARITY_ARGS + ["--training.document_masking", "false", "--parallelism.pipeline_parallel_degree", "2"],
        tmp_path / "pp",
    )
    assert_same_losses(stream, pp)


def test_run_train_sh_on_cpu_with_gloo_and_log_rank(tmp_path):
    """The launcher: NGPU processes on a machine without CUDA, arguments passed through, LOG_RANK filters output."""
    import os

    env = dict(os.environ, CONFIG_FILE="configs/debug.toml", NGPU="2", LOG_RANK="1", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run(
        [
            "./run_train.sh",
            *PARITY_ARGS[2:],
            "--training.steps",
            "2",
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--job.dump_folder",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "[rank1]" in out and "[rank0]" not in out  # only rank 1's lines are shown
    records = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2  # rank 0 still writes the metrics
