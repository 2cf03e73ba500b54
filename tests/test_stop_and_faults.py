"""What a run does when things go wrong: non-finite gradients, a poisoned state at save time, SIGTERM from a
scheduler, and a launcher killed with SIGKILL. Each test runs the real trainer in its own processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from components.signals import EXIT_CODE_TERMINATED
from tests.parity import PARITY_ARGS, REPO, read_metrics

ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
CKPT_EVERY_STEP = ["--checkpoint.enable", "true", "--checkpoint.interval", "1"]


def run_with_faults(args: list[str], dump: Path, **faults: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "tests/train_with_faults.py", *PARITY_ARGS, *args, "--job.dump_folder", str(dump)],
        cwd=REPO,
        env=dict(ENV, **faults),
        capture_output=True,
        text=True,
        timeout=300,
    )


def saved_steps(dump: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (dump / "checkpoint").glob("step-*") if (p / ".metadata").exists())


def model_weights(step_dir: Path, tmp: Path) -> dict[str, torch.Tensor]:
    out = tmp / f"{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    state = torch.load(out, weights_only=False)  # our own test checkpoint
    return dict(state["model"])


def test_nonfinite_gradient_stops_before_the_optimizer_step_and_saves_nothing(tmp_path):
    r = run_with_faults(CKPT_EVERY_STEP + ["--training.steps", "5"], tmp_path, MT_NAN_GRAD_STEPS="3")
    assert r.returncode != 0
    assert "the global gradient norm is nan at step 3" in r.stderr, r.stderr[-3000:]
    assert "the newest complete checkpoint is step-2" in r.stderr and "skip_nonfinite_grads" in r.stderr
    assert saved_steps(tmp_path) == [1, 2]  # nothing of step 3 (its state would be all NaN after the step)


@pytest.mark.parametrize("optimizer", ["auto", "foreach"])  # skipped inside fused AdamW / by the host
def test_skipped_nonfinite_gradient_leaves_the_weights_and_training_goes_on(tmp_path, optimizer):
    r = run_with_faults(
        CKPT_EVERY_STEP
        + ["--training.steps", "5", "--training.skip_nonfinite_grads", "1", "--optimizer.implementation", optimizer],
        tmp_path,
        MT_NAN_GRAD_STEPS="3",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    records = {rec["step"]: rec for rec in read_metrics(tmp_path)}
    assert records[3].get("skipped") is True and not records[4].get("skipped")
    assert sorted(records) == [1, 2, 3, 4, 5] and all(
        map(torch.isfinite, map(torch.tensor, ([records[s]["loss"] for s in records])))
    )
    ckpt = tmp_path / "checkpoint"
    before, after = model_weights(ckpt / "step-2", tmp_path), model_weights(ckpt / "step-3", tmp_path)
    assert before.keys() == after.keys() and before
    for k in before:  # the skipped step took no optimizer step: bit-identical weights
        assert torch.equal(before[k], after[k]), k
    stepped = model_weights(ckpt / "step-4", tmp_path)  # the next step trains again
    assert any(not torch.equal(after[k], stepped[k]) for k in after)


def test_too_many_nonfinite_gradients_in_a_row_stop_the_run(tmp_path):
    r = run_with_faults(
        ["--training.steps", "6", "--training.skip_nonfinite_grads", "1"], tmp_path, MT_NAN_GRAD_STEPS="3,4"
    )
    assert r.returncode != 0 and "the global gradient norm is nan at step 4" in r.stderr, r.stderr[-3000:]


def test_a_nonfinite_state_is_never_saved(tmp_path):
    """A finite gradient whose optimizer step still yields an infinity: the save refuses, naming the tensor."""
    r = run_with_faults(CKPT_EVERY_STEP + ["--training.steps", "5"], tmp_path, MT_NAN_PARAM_STEP="3")
    assert r.returncode != 0
    assert "step 3 was not saved" in r.stderr and "holds NaN or inf values" in r.stderr, r.stderr[-3000:]
    assert "newest complete checkpoint is step-2" in r.stderr
    assert saved_steps(tmp_path) == [1, 2] and not list((tmp_path / "checkpoint").glob(".step-3*"))


def _wait_for_steps(dump: Path, n: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while len(read_metrics(dump)) < n:
        assert proc.poll() is None, "the run ended early:\n" + proc.communicate()[1][-3000:]
        assert time.time() < deadline, "no training steps in time"
        time.sleep(0.2)


LONG_RUN = ["--training.steps", "100000", "--checkpoint.enable", "true", "--checkpoint.interval", "100000"]


@pytest.mark.parametrize("nproc", [1, 2])
def test_sigterm_finishes_the_step_saves_and_the_run_resumes(tmp_path, nproc):
    """What SLURM and torchrun send first: every rank stops after the same step, which is saved off-interval."""
    env = dict(ENV, CONFIG_FILE="configs/debug.toml", NGPU=str(nproc), LOG_RANK="0,1")
    args = [*PARITY_ARGS[2:], *LONG_RUN, "--job.dump_folder", str(tmp_path)]
    if nproc == 2:
        args += ["--parallelism.data_parallel_shard_degree", "2"]
    proc = subprocess.Popen(
        ["./run_train.sh", *args], cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        _wait_for_steps(tmp_path, 2, proc)
        proc.send_signal(signal.SIGTERM)  # the launcher itself (run_train.sh execs python / torchrun)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0  # stopped early: not a success
    if nproc == 1:
        assert proc.returncode == EXIT_CODE_TERMINATED
    last = read_metrics(tmp_path)[-1]["step"]
    assert f"stopped by SIGTERM after step {last}" in out + err, (out + err)[-3000:]
    assert saved_steps(tmp_path) == [last]  # off the interval, complete
    r = subprocess.run(
        ["./run_train.sh", *args, "--training.steps", str(last + 1)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )  # the last value of a key wins
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from step {last}" in r.stdout + r.stderr
    assert read_metrics(tmp_path)[-1]["step"] == last + 1


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals are Linux's")
def test_workers_die_with_a_launcher_killed_by_sigkill(tmp_path):
    env = dict(ENV, CONFIG_FILE="configs/debug.toml", NGPU="2")
    proc = subprocess.Popen(
        [
            "./run_train.sh",
            *PARITY_ARGS[2:],
            *LONG_RUN,
            "--parallelism.data_parallel_shard_degree",
            "2",
            "--job.dump_folder",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_steps(tmp_path, 2, proc)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        proc.send_signal(signal.SIGKILL)  # torchrun cannot forward this one
        proc.wait(timeout=30)
        deadline = time.time() + 20
        while any(map(_alive, workers)) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, workers)), "workers outlived their launcher"
    finally:
        for pid in _children(proc.pid) + [proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
