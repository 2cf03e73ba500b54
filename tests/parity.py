"""The parity harness: run train.py in N gloo processes on the CPU and compare per-step losses with one process.

    ref = run_training(1, PARITY_ARGS, tmp_path / "ref")
    got = run_training(4, PARITY_ARGS + ["--parallelism.data_parallel_shard_degree", "4"], tmp_path / "fsdp4")
    assert_same_losses(ref, got)                       # fp32, deterministic: 1e-5 relative per step

DESIGN.md "Parity": with the same seed, global batch and data, every layout reproduces the single-process losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A small, fast Mamba-2 over packed multi-document rows (the embedded corpus, byte tokens), fp32, deterministic.
PARITY_ARGS = [
    "--job.config_file",
    "configs/debug.toml",
    "--model.d_model",
    "64",
    "--model.n_layers",
    "4",
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
    "8",
    "--training.steps",
    "4",
    "--training.deterministic",
    "true",
    "--optimizer.lr",
    "3e-3",
    "--lr_scheduler.warmup_steps",
    "1",
    "--metrics.enable_tensorboard",
    "false",
]


def run_training(
    nproc: int,
    args: list[str],
    dump_folder: Path,
    timeout: int = 600,
    check: bool = True,
    env_extra: dict | None = None,
) -> list[dict]:
    """Run the trainer (torchrun when nproc > 1, CPU only) and return its metrics.jsonl records."""
    dump_folder = Path(dump_folder)
    cmd = [sys.executable]
    if nproc > 1:
        cmd += [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=localhost:0",
        ]
    cmd += ["train.py", *args, "--job.dump_folder", str(dump_folder)]
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", **(env_extra or {}))
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}")
    return read_metrics(dump_folder)


def read_metrics(dump_folder: Path) -> list[dict]:
    path = Path(dump_folder) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def losses_by_step(records: list[dict]) -> dict[int, float]:
    """The last record of each step wins (a resumed run may repeat a step)."""
    return {r["step"]: r["loss"] for r in records}


def assert_same_losses(ref: list[dict], got: list[dict], rtol: float = 1e-5, steps=None) -> None:
    ref_l, got_l = losses_by_step(ref), losses_by_step(got)
    steps = sorted(ref_l) if steps is None else list(steps)
    assert steps and all(s in got_l for s in steps), f"missing steps: ref {sorted(ref_l)} got {sorted(got_l)}"
    bad = [(s, ref_l[s], got_l[s]) for s in steps if abs(got_l[s] - ref_l[s]) > rtol * abs(ref_l[s])]
    assert not bad, "loss mismatch (step, reference, got): " + ", ".join(f"({s}, {a:.8f}, {b:.8f})" for s, a, b in bad)
