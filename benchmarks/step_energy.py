"""A whole training step's time, energy and mean power in situ, ours or mamba-ssm's loop, optionally with extra
low-power work put into every step: does that work cost the step its time or only its joules?

    bash .gpu/setup.sh && python3 benchmarks/step_energy.py --side ours [--size 1.3b] [--extra copy4]
    bash .gpu/setup.sh && python3 benchmarks/step_energy.py --side theirs
    python3 benchmarks/step_energy.py --side ours --size debug --warmup 1 --steps 2      # CPU smoke run: times only

Each side runs as compare_mamba_ssm.py runs it (ours: train.py in this process with its overrides for the size;
theirs: its worker's loop). Once a step, where the gradient norm is taken (ours: train.global_grad_norm; theirs:
clip_grad_norm_), the host reads a clock and NVML's energy counter; over the timed steps the differences give ms,
J and W per step. Our host runs up to a step ahead of the GPU: a constant lag, which the differences cancel.
--extra puts work on the stream at that point in every step:
  sleep<ms>  one thread spinning for <ms> at the idle SM clock (torch.cuda._sleep): ~idle power
  copy<n>    n element-wise copies of 1 GiB (HBM-bound, below the power limit on an H100)
Session 49 (docs/performance.md) found on an H100 that four copies added their time (3.0 ms against 2.85 ms alone)
and not their joules (1.5 ms at 700 W): a phase below the power limit costs the step its time.
Prints one line "STEP_ENERGY {json}" (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from benchmarks.bench_energy import _written  # noqa: E402
from benchmarks.compare_mamba_ssm import SIZES, ours_command, read_jsonl, summarize_ours, theirs_worker  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=("ours", "theirs"), required=True)
    ap.add_argument("--size", default="1.3b", help=f"one of {', '.join(SIZES)} (compare_mamba_ssm.py's batch)")
    ap.add_argument("--extra", default="none", help="none, sleep<ms> or copy<n> (module docstring)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=12, help="timed steps")
    ap.add_argument("--dump_folder", default="/tmp/step_energy", help="ours: train.py's dump folder (replaced)")
    ap.add_argument("--out", default="", help="also write the result as JSON here")
    a = ap.parse_args(argv)
    if a.size not in SIZES:
        ap.error(f"unknown --size {a.size!r}; choose from {list(SIZES)}")
    if a.warmup < 1 or a.steps < 1:
        ap.error("--warmup and --steps must be >= 1 (the first step compiles kernels)")
    try:
        parse_extra(a.extra)
    except ValueError as e:
        ap.error(str(e))
    if a.side == "theirs" and a.size == "debug":
        ap.error("their loop has no debug size: use 370m or 1.3b")
    return a


def parse_extra(extra: str) -> tuple[str, float]:
    """'none' -> ('none', 0); 'sleep3' -> ('sleep', 3.0) ms; 'copy4' -> ('copy', 4) GiB copies."""
    for kind in ("sleep", "copy"):
        if extra.startswith(kind):
            try:
                amount = float(extra[len(kind) :])
            except ValueError:
                break
            if amount > 0 and (kind == "sleep" or amount == int(amount)):
                return kind, amount
            break
    if extra == "none":
        return "none", 0.0
    raise ValueError(f"--extra must be none, sleep<ms> (e.g. sleep3) or copy<n> (e.g. copy4), got {extra!r}")


def per_step(marks: list[tuple[float, float | None]], warmup: int) -> dict:
    """Marks (host seconds, energy in mJ or None), one per step taken at the same point of every step: mark k
    (0-based) falls in step k + 1. Over the timed steps warmup + 1 ... (the marks from the last warm-up step's to the
    last step's): ms and J per step and the mean W (None without energy readings)."""
    if len(marks) <= warmup:
        raise ValueError(f"{len(marks)} marks for {warmup} warm-up steps: no timed step was marked")
    (t0, e0), (t1, e1) = marks[warmup - 1], marks[-1]
    n = len(marks) - warmup
    joules = None if e0 is None or e1 is None else (e1 - e0) / 1e3
    return dict(
        timed_steps=n,
        ms_per_step=1e3 * (t1 - t0) / n,
        joules_per_step=None if joules is None else joules / n,
        watts=None if joules is None else joules / (t1 - t0),
    )


def energy_reader():
    """A callable giving NVML's energy counter in mJ for this process's GPU, or None where there is none."""
    if not torch.cuda.is_available():
        return lambda: None
    from benchmarks.bench_energy import _Nvml  # lazily: needs NVML

    nvml = _Nvml()
    return nvml.energy_mj


def extra_work(extra: str):
    """The callable that queues --extra's work on the current stream (nothing for none)."""
    kind, amount = parse_extra(extra)
    if kind == "none":
        return lambda: None
    if not torch.cuda.is_available():
        raise SystemExit(f"--extra {extra} queues GPU work: run it on a CUDA machine")
    if kind == "sleep":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        torch.cuda.synchronize()
        cycles = int(2_000_000 * amount / start.elapsed_time(end))
        return lambda: torch.cuda._sleep(cycles)
    src = torch.ones(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def copies():
        for _ in range(int(amount)):
            dst.copy_(src)

    return copies


def main(argv=None) -> dict:
    a = parse_args(argv)
    size = SIZES[a.size]
    read_energy, work = energy_reader(), extra_work(a.extra)
    marks: list[tuple[float, float | None]] = []

    def mark_then(fn):
        def wrapped(*args, **kwargs):
            marks.append((time.perf_counter(), read_energy()))
            work()
            return fn(*args, **kwargs)

        return wrapped

    if a.side == "ours":
        import train

        original = train.global_grad_norm
        train.global_grad_norm = mark_then(original)
        try:
            if os.path.isdir(a.dump_folder):
                shutil.rmtree(a.dump_folder)
            train.main(ours_command(size, a.warmup, a.steps, a.dump_folder, [])[2:])
        finally:
            train.global_grad_norm = original
        result = summarize_ours(read_jsonl(os.path.join(a.dump_folder, "metrics.jsonl")), a.warmup)
    else:
        original = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = mark_then(original)
        try:
            run = theirs_worker(size, a.warmup, a.steps)
        finally:
            torch.nn.utils.clip_grad_norm_ = original
        result = {k: run[k] for k in ("tokens_per_sec", "memory_gib")}
    result.update(per_step(marks, a.warmup), side=a.side, size=a.size, extra=a.extra,
                  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")  # fmt: skip
    print("STEP_ENERGY " + json.dumps(result), flush=True)
    return _written(result, a.out)


if __name__ == "__main__":
    main()
