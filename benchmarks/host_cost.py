"""How much host (CPU) time one training step costs, by phase: forward, backward, optimizer.

A step is host-bound when launching its kernels takes longer than running them; then every millisecond of Python,
dispatch or launch overhead per layer is a millisecond of step time, under FSDP / PP hooks too (docs/performance.md,
"Multi-GPU efficiency"). Run at a tiny batch (default 1 x 256 tokens) the GPU never holds the host back, so the
time to issue a step is the host cost alone; compare it with the step time at the real batch
(`--rows 8 --seq 2048` prints both). Python's garbage collector is off, as in train.py between collections.

    bash .gpu/setup.sh && python3 benchmarks/host_cost.py --flavor 370M --kernels auto
    python3 benchmarks/host_cost.py --flavor 370M --kernels mamba_ssm --profile 25     # + cProfile's top 25

The model is built as train.py builds it on one GPU (fp32 weights, bf16 autocast, fused AdamW); the backward runs on
the calling thread under --profile only (autograd's device thread is invisible to cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models import build_model_args, build_model_on_meta  # noqa: E402
from models.init import init_weights  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="370M", help="model.flavor (models/args.py)")
    ap.add_argument("--kernels", default="auto", help="model.kernels: auto, triton, mamba_ssm, reference")
    ap.add_argument("--tiny", default="1x256", help="rows x tokens of the host-cost batch")
    ap.add_argument("--rows", type=int, default=0, help="also time the step at this real batch (with --seq)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after 3 untimed)")
    ap.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions by self time")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    gc_was_enabled = gc.isenabled()
    try:
        return _measure(parse_args(argv))
    finally:  # callable from tests: leave Python's collector as it was
        if gc_was_enabled:
            gc.enable()


def _measure(a: argparse.Namespace) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    args = build_model_args(a.flavor)
    model = build_model_on_meta(args)
    model.to_empty(device=device)
    init_weights(model, 0)
    model.set_kernel_backend(a.kernels)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    gc.collect()
    gc.disable()

    def batch(rows, seq):
        return torch.randint(0, args.vocab_size, (rows, seq), device=device)

    def forward(ids):
        with autocast:
            return model(ids, labels=ids, loss_chunk_tokens=8192)

    def optimizer_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    rows, seq = (int(v) for v in a.tiny.split("x"))
    ids = batch(rows, seq)
    for _ in range(3):
        forward(ids).backward()
        optimizer_step()
    sync()
    t_fwd = t_bwd = t_opt = 0.0
    for _ in range(a.steps):
        t0 = time.perf_counter()
        loss = forward(ids)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer_step()
        t3 = time.perf_counter()
        t_fwd, t_bwd, t_opt = t_fwd + t1 - t0, t_bwd + t2 - t1, t_opt + t3 - t2
    sync()
    ms = 1e3 / a.steps
    result = dict(flavor=a.flavor, kernels=a.kernels, layers=args.n_layers, host_forward_ms=t_fwd * ms,
                  host_backward_ms=t_bwd * ms, host_optimizer_ms=t_opt * ms)  # fmt: skip
    result["host_step_ms"] = result["host_forward_ms"] + result["host_backward_ms"] + result["host_optimizer_ms"]
    print(
        f"{a.flavor} kernels={a.kernels} {a.tiny}: host {result['host_step_ms']:.1f} ms per step = forward "
        f"{result['host_forward_ms']:.1f} + backward {result['host_backward_ms']:.1f} + optimizer "
        f"{result['host_optimizer_ms']:.1f} ({args.n_layers} layers, {result['host_step_ms'] / args.n_layers:.2f} ms "
        "per layer)"
    )
    if a.rows:
        ids = batch(a.rows, a.seq)
        for _ in range(3):
            forward(ids).backward()
            optimizer_step()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            forward(ids).backward()
            optimizer_step()
        sync()
        result["real_step_ms"] = (time.perf_counter() - t0) * ms
        print(f"  step at {a.rows}x{a.seq}: {result['real_step_ms']:.1f} ms (host-bound when close to the host cost)")
    if a.profile:
        pr = cProfile.Profile()
        ids = batch(rows, seq)
        with torch.autograd.set_multithreading_enabled(False):
            pr.enable()
            for _ in range(5):
                forward(ids).backward()
                optimizer_step()
            sync()
            pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(a.profile)
        print(out.getvalue())
    return result


if __name__ == "__main__":
    main()
