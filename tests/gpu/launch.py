"""Start train.py on the first `nproc` GPUs this test process may use, and read its metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def visible_gpus(nproc: int) -> str:
    """The first nproc of the GPUs this process sees: CUDA_VISIBLE_DEVICES from the caller is narrowed, not reset
    (a test run confined to GPU 6 must not start its jobs on GPU 0)."""
    seen = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d for d in seen.split(",") if d.strip()] if seen else [str(i) for i in range(nproc)]
    return ",".join(ids[:nproc])


def train(args: list[str], folder: Path, nproc: int = 1, autotune_cache: Path | None = None) -> list[dict]:
    """Run train.py (torchrun when nproc > 1) and return its metrics records.

    autotune_cache: a Triton cache folder shared by runs that must pick the same kernel configurations (Triton
    autotunes in every new process and may choose differently, which changes fp32 sums in the last bits)."""
    cmd = [sys.executable]
    if nproc > 1:
        cmd += [
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d",
            "--rdzv_endpoint=localhost:0",
        ]
    cmd += ["train.py", *args, "--job.dump_folder", str(folder)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible_gpus(nproc), PYTHONUNBUFFERED="1")
    if autotune_cache is not None:
        env.update(TRITON_CACHE_DIR=str(autotune_cache), TRITON_CACHE_AUTOTUNING="1")
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
