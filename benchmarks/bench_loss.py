"""GPU time and memory of the loss (lm_head + summed token cross-entropy, forward + backward) as the trainer runs it.

    bash .gpu/setup.sh && python3 benchmarks/bench_loss.py [--shapes 1.3b,370m] [--tune] [--out r.json]

Rows, at a model's last hidden state [tokens, d_model] (bf16, as norm_f gives it) and float32 lm_head weight under
bf16 autocast (the single-GPU trainer's setting), the backward from a scalar 1 / tokens as train.py's:
  plain          lm_head's logits + models.loss.cross_entropy_sum (float32 logits): loss_chunk_tokens 0 before
                 session 21, and still the path of the mamba_ssm / reference kernels
  chunked_C      models.loss.chunked_cross_entropy_sum over chunks of C tokens, recomputed in the backward
  fused          ops.linear_cross_entropy_sum with our kernels (cross_entropy_triton.py): what "auto" runs on CUDA
  fused_chunk_C  the same with its logits buffer bounded to C rows (training.loss_chunk_tokens C)
  --tune adds fused_B<block>_W<warps>: the row kernel's other launch shapes.
Times: CUDA events around `--iters` calls, median of 3 rounds. Memory: torch.cuda.max_memory_allocated during one
call, minus what was allocated before it (the inputs), in GiB. Errors: each row's loss, dh and dweight against the
plain row's, relative (the plain row is no reference: both round the logits to bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch
import torch.nn.functional as F

from benchmarks.bench_optimizer import gpu_ms  # noqa: E402
from models.kernels import ops  # noqa: E402
from models.loss import chunked_cross_entropy_sum, cross_entropy_sum  # noqa: E402

# name -> (tokens, d_model): the compare_mamba_ssm batches (1.3B 4 x 4096, 370M 8 x 2048), vocabulary 50277 -> 50288
SHAPES = {"1.3b": (16384, 2048), "370m": (16384, 1024)}
VOCAB = 50288
TUNE = ((2048, 4), (4096, 4), (4096, 16), (8192, 8), (8192, 16))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1.3b,370m", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--iters", type=int, default=5, help="calls per timed round")
    ap.add_argument("--tune", action="store_true", help="also time the row kernel's other launch shapes")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    return ap.parse_args(argv)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def bench_shape(name: str, iters: int, tune: bool) -> list[dict]:
    from models.kernels import cross_entropy_triton as ce

    tokens, d = SHAPES[name]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    h0 = torch.randn(1, tokens, d, device=dev, generator=g).to(torch.bfloat16)
    w = (torch.randn(VOCAB, d, device=dev, generator=g) * 0.02).requires_grad_()
    labels = torch.randint(0, VOCAB, (1, tokens), device=dev, generator=g)
    labels[0, ::97] = -100  # document ends: ignored
    scale = torch.tensor(1.0 / tokens, device=dev)

    def run(loss_fn):
        h = h0.detach().requires_grad_()
        w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(h, w)
        (loss * scale).backward()
        return loss.detach(), h.grad, w.grad

    rows = {
        "plain": lambda h, w: cross_entropy_sum(F.linear(h, w), labels),
        "chunked_8192": lambda h, w: chunked_cross_entropy_sum(h, w, labels, 8192),
        "fused": lambda h, w: ops.linear_cross_entropy_sum(h, w, labels, 0),
        "fused_chunk_8192": lambda h, w: ops.linear_cross_entropy_sum(h, w, labels, 8192),
        "fused_chunk_4096": lambda h, w: ops.linear_cross_entropy_sum(h, w, labels, 4096),
    }
    shapes = [(ce.BLOCK_V, ce.WARPS)] + (list(TUNE) if tune else [])
    out, ref = [], None
    for row, fn in rows.items():
        for block, warps in shapes if row == "fused" else shapes[:1]:
            ce.BLOCK_V, ce.WARPS = block, warps
            label = row if (block, warps) == shapes[0] else f"fused_B{block}_W{warps}"
            result = run(fn)  # warm-up: compile, allocate
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            run(fn)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            ms = gpu_ms(lambda fn=fn: run(fn), iters)
            if ref is None:
                ref = result
            errs = {k: _rel(a, b) for k, a, b in zip(("loss", "dh", "dw"), result, ref)}
            out.append(
                dict(
                    shape=name,
                    row=label,
                    ms=ms,
                    peak_gib=peak,
                    **{f"err_{k}": v for k, v in errs.items()},
                )
            )
    ce.BLOCK_V, ce.WARPS = shapes[0]
    return out


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_loss.py times GPU kernels: run it on a CUDA machine (bash .gpu/setup.sh first)")
    rows = []
    for name in [s for s in a.shapes.split(",") if s]:
        if name not in SHAPES:
            raise SystemExit(f"--shapes: {name!r} is not one of {sorted(SHAPES)}")
        rows += bench_shape(name, a.iters, a.tune)
    print(f"{torch.cuda.get_device_name()}, vocabulary {VOCAB}, bf16 autocast, float32 weight")
    print("| shape | row | ms fwd + bwd | GiB above the inputs | loss / dh / dweight vs plain |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        errs = f"{r['err_loss']:.1e} / {r['err_dh']:.1e} / {r['err_dw']:.1e}"
        print(f"| {r['shape']} | {r['row']} | {r['ms']:.3f} | {r['peak_gib']:.2f} | {errs} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
