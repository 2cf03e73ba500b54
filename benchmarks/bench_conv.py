"""Our Triton causal conv (models/kernels/conv_triton.py) next to causal_conv1d's CUDA kernels, at the models' shapes.

    bash .gpu/setup.sh && python3 benchmarks/bench_conv.py [--shapes 1.3b,370m] [--out results.json]

The conv's input is what the fused mixer gives it: the xBC slice of in_proj's output zxbcdt (channels contiguous,
token stride the width of zxbcdt), bf16, width 4, silu, with and without documents (seq_idx: packed documents of
random lengths, mean 1000 tokens). Times (triton.testing.do_bench, median ms) of the forward and of the backward
(dx written into a view of a dzxbcdt buffer, as the mixer does; dweight, dbias) for both kernels in the same process,
and how far apart their outputs are (relative norm of the difference; both round to bf16).
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

# batch, length, d_inner, ngroups * d_state, nheads: xBC has d_inner + 2 * G * N channels, zxbcdt adds z and dt.
SHAPES = {"1.3b": (4, 4096, 4096, 128, 64), "370m": (8, 2048, 2048, 128, 32)}


def documents(b: int, L: int, gen: torch.Generator, mean: int = 1000) -> torch.Tensor:
    """int32 [b, L] segment ids of packed documents with exponential lengths around `mean` tokens."""
    seq = torch.zeros(b, L, dtype=torch.int32)
    for r in range(b):
        t, doc = 0, 0
        while t < L:
            n = max(1, int(torch.empty(1).exponential_(1.0 / mean, generator=gen).item()))
            seq[r, t : t + n] = doc
            t, doc = t + n, doc + 1
    return seq


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run(shape_name: str, with_seq: bool) -> dict:
    import triton.testing

    from models.kernels import cuda as kcuda
    from models.kernels.conv_triton import conv_backward_triton, conv_forward_triton

    b, L, d_inner, gn, H = SHAPES[shape_name]
    conv_dim = d_inner + 2 * gn
    width_f = 2 * d_inner + 2 * gn + H
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    zxbcdt = torch.randn(b, L, width_f, generator=gen).to(dev, torch.bfloat16)
    x = zxbcdt[..., d_inner : d_inner + conv_dim].transpose(1, 2)  # [B, C, L], channels contiguous
    w = (0.5 * torch.randn(conv_dim, 4, generator=gen)).to(dev)
    bias = (0.1 * torch.randn(conv_dim, generator=gen)).to(dev)
    seq = documents(b, L, gen).to(dev) if with_seq else None
    dout = torch.randn(b, L, conv_dim, generator=gen).to(dev, torch.bfloat16).transpose(1, 2)
    dz = torch.empty_like(zxbcdt)
    dx_view = dz[..., d_inner : d_inner + conv_dim].transpose(1, 2)
    halves = kcuda.kernel_halves()
    sides = {"ours": (conv_forward_triton, lambda *a: conv_backward_triton(*a))}
    if halves is not None:
        sides["causal_conv1d"] = (
            lambda x_, w_, b_, s_, silu: kcuda.conv_forward(x_, w_, b_, s_, silu),
            lambda x_, w_, b_, d_, s_, silu, dx_: (dx_,) + kcuda.conv_backward(x_, w_, b_, d_, s_, silu, dx_),
        )
    rec, outs = {"shape": shape_name, "seq_idx": with_seq, "channels": conv_dim, "tokens": b * L}, {}
    for name, (fwd, bwd) in sides.items():
        rec[f"{name}_fwd_ms"] = triton.testing.do_bench(lambda: fwd(x, w, bias, seq, True), warmup=10, rep=100)
        rec[f"{name}_bwd_ms"] = triton.testing.do_bench(
            lambda: bwd(x, w, bias, dout, seq, True, dx_view), warmup=10, rep=100
        )
        out = fwd(x, w, bias, seq, True)
        _, dw, db = bwd(x, w, bias, dout, seq, True, dx_view)
        outs[name] = (out.clone(), dx_view.clone(), dw.float(), db.float())
    if "causal_conv1d" in outs:
        for i, k in enumerate(("out", "dx", "dw", "db")):
            rec[f"diff_{k}"] = rel(outs["ours"][i], outs["causal_conv1d"][i])
    # Bytes each pass must move at least: x (and dout, dx) once, bf16.
    bytes_fwd = 2 * 2 * b * L * conv_dim
    rec["ours_fwd_TBps"] = bytes_fwd / rec["ours_fwd_ms"] / 1e9
    rec["ours_bwd_TBps"] = 1.5 * bytes_fwd / rec["ours_bwd_ms"] / 1e9
    return rec


# --tune: our kernels' block sizes (conv_triton's module constants) tried one set at a time; a set names what it
# changes, the rest stays the module's. Forward: (BLOCK_D, BLOCK_L, warps); backward: (BLOCK_D, ROWS streams of SEG
# positions, warps, positions loaded ahead).
TUNE = [
    dict(),  # the module's defaults
    dict(_BWD_UNROLL=1, _FAST_SIGMOID=False),  # before session 23: a rolled stream loop, tl.sigmoid
    dict(_BWD_UNROLL=1),
    dict(_BWD_UNROLL=4),
    dict(_FAST_SIGMOID=False),
    dict(_BWD_ROWS=2, _BWD_WARPS=2),
    dict(_FWD_ONE_DOC_BRANCH=False, _BWD_ONE_DOC_BRANCH=False),  # before sessions 43 / 49: document tests everywhere
    dict(_BWD_BLOCK_D=128, _BWD_ROWS=4),  # the backward's tiles before session 49
    dict(_BWD_PREFETCH=2, _BWD_STAGES=1, _BWD_UNROLL=2, _BWD_L2_AHEAD=3),  # two positions ahead in registers (s. 55)
    dict(_BWD_PREFETCH=2, _BWD_STAGES=1, _BWD_UNROLL=2, _BWD_L2_AHEAD=0),  # ... without L2 hints (before session 55)
    dict(_BWD_STAGES=2),  # the pipelined loop (session 58) one iteration ahead: 128 registers
    dict(_BWD_STAGES=4),  # ... three ahead (faster at the 1.3B, slower at the 370M in session 58)
    # ... in other programs (compiled for sm_90, Triton 3.6): 4 streams at 2 warps, 146 registers, 7 programs (14
    # warps) per SM against the default's 3 (12 warps); 8 streams at 8 warps, 113 registers, 2 (16 warps)
    dict(_BWD_ROWS=4, _BWD_WARPS=2),
    dict(_BWD_WARPS=8),
]
TUNED = ("_FWD_BLOCK_D", "_FWD_BLOCK_L", "_FWD_WARPS", "_FWD_CHANNELS_FASTEST", "_BWD_BLOCK_D", "_BWD_ROWS", "_BWD_SEG",
         "_BWD_WARPS", "_BWD_PREFETCH", "_BWD_UNROLL", "_FAST_SIGMOID", "_FWD_ONE_DOC_BRANCH",
         "_BWD_ONE_DOC_BRANCH", "_BWD_L2_AHEAD", "_BWD_STAGES")  # fmt: skip


def tune(shape_name: str) -> None:
    from models.kernels import conv_triton

    default = {k: getattr(conv_triton, k) for k in TUNED}
    for setting in TUNE:
        for k, v in {**default, **setting}.items():  # a set names what it changes; the rest is the module's
            setattr(conv_triton, k, v)
        r = run(shape_name, True)
        short = " ".join(f"{k.strip('_').lower()}={v}" for k, v in setting.items()) or "defaults"
        print(
            f"tune {shape_name} {short}: fwd {r['ours_fwd_ms']:.3f} ms, bwd {r['ours_bwd_ms']:.3f} ms "
            f"(dx vs causal_conv1d {r.get('diff_dx', float('nan')):.1e}, dw {r.get('diff_dw', float('nan')):.1e})",
            flush=True,
        )
    for k, v in default.items():
        setattr(conv_triton, k, v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1.3b,370m")
    ap.add_argument("--tune", action="store_true", help="first time our kernels under each set in TUNE (every shape)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_conv.py times GPU kernels: run it on a CUDA machine (bash .gpu/setup.sh first)")
    if a.tune:
        for shape in a.shapes.split(","):
            tune(shape)
    recs = [run(s, q) for s in a.shapes.split(",") for q in (False, True)]
    print("| shape | seq_idx | fwd ours | fwd causal_conv1d | bwd ours | bwd causal_conv1d | ours / theirs (f+b) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in recs:
        tf, tb = r.get("causal_conv1d_fwd_ms", float("nan")), r.get("causal_conv1d_bwd_ms", float("nan"))
        ratio = (r["ours_fwd_ms"] + r["ours_bwd_ms"]) / (tf + tb)
        print(
            f"| {r['shape']} | {r['seq_idx']} | {r['ours_fwd_ms']:.3f} ms | {tf:.3f} ms | {r['ours_bwd_ms']:.3f} ms | "
            f"{tb:.3f} ms | {ratio:.2f} |"
        )
    for r in recs:
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in r.items() if k.startswith("diff_"))
        print(f"{r['shape']} seq={r['seq_idx']}: ours {r['ours_fwd_TBps']:.2f} / {r['ours_bwd_TBps']:.2f} TB/s "
              f"(fwd / bwd, of the bytes each must move); ours vs causal_conv1d: {diffs}")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(recs, f, indent=1)


if __name__ == "__main__":
    main()
