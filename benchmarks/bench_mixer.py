"""The whole fused Mamba-2 mixer after in_proj (conv -> SSD -> gated RMSNorm -> out_proj, forward + backward) at a
model's shape, per kernel, next to the bare SSD on contiguous inputs, in one process on one GPU.

    bash .gpu/setup.sh && python3 benchmarks/bench_mixer.py [--shapes 1.3b,370m] [--docs] [--out results.json]
    python3 benchmarks/bench_mixer.py --shapes 1.3b --docs --variant scan_p=32,scan_maxnreg=128   # tiles, vs default

What the trainer's step runs per layer (models/kernels/split_conv1d_scan.py with our kernels), outside of the step:
so a kernel that takes longer in a training profile than here loses its time to the step around it (clocks under
the power cap, the caches), not to its inputs. The mixer reads the SSD's operands as views of one zxbcdt buffer
(x, B, C from the conv's output, dt from zxbcdt), the bare SSD (`ssd_chunk_scan_triton`) contiguous tensors of the
same values' shapes. Device time per kernel name (torch.profiler, mean over --iters iterations), twice each so that
the second round shows the spread; the configs' kept states (`keep_states`) on both.

The mixer runs as the 1.3B and 370M configs run it, with the gated norm's first half in the chunk scan
(model.fuse_gate_into_scan; --unfused_gate: the scan without it and the gated norm's kernels after it), so the gated
chunk scan is timed here and not by bench_ssd.py's bare SSD. With --variant (repeatable; comma-separated BlockConfig
fields, as bench_ssd.py's --set) only the mixer runs, under the default config and each variant in turn, two
alternating rounds in one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch

from benchmarks.bench_ssd import SHAPES, make_inputs, parse_sets, patched_config, stage_times
from models.kernels.row_scale import materialize
from models.kernels.split_conv1d_scan import mamba_split_conv1d_scan_triton
from models.kernels.ssd_triton import ssd_chunk_scan_triton
from models.kernels.ssd_triton.config import block_config

D_MODEL = {"1.3b": 2048, "370m": 1024}


def kernel_times(step, iters: int) -> dict[str, float]:
    """Device ms per iteration of each kernel name, after 3 untimed iterations (bench_ssd.stage_times)."""
    for _ in range(2):
        step()
    return stage_times(step, iters)


def steps(shape_name: str, docs: bool, fuse_gate: bool = True):
    """(mixer step, bare SSD step): forward + backward closures on fixed random inputs. fuse_gate: the configs'
    model.fuse_gate_into_scan (the chunk scan writes the gated values and their rows' sums of squares; the row scale
    the next block's norm applies is applied here by materialize(), a few small PyTorch kernels), else the chunk
    scan without the gate and the gated norm's kernels after it."""
    shape = SHAPES[shape_name]
    b, L, H, P, N, G, Q = (shape[k] for k in "bLHPNGQ")
    dim, d_model = H * P, D_MODEL[shape_name]
    conv_dim = dim + 2 * G * N
    inp = make_inputs(shape, docs, seed=0)
    seq = inp["seq_idx"]
    g = torch.Generator(device="cpu").manual_seed(1)

    def leaf(*s, scale=1.0, dtype=torch.float32):
        return (torch.randn(*s, generator=g) * scale).to("cuda", dtype).requires_grad_()

    zxbcdt = leaf(b, L, dim + conv_dim + H, scale=0.5, dtype=torch.bfloat16)
    conv_w, conv_b = leaf(conv_dim, 4, scale=0.3), leaf(conv_dim, scale=0.0)
    dt_bias, A = inp["dt_bias"].clone().requires_grad_(), inp["A"].clone().requires_grad_()
    D, norm_w, out_w = leaf(H, scale=0.0), leaf(dim, scale=0.0), leaf(d_model, dim, scale=0.02)
    with torch.no_grad():
        D.fill_(1.0)
        norm_w.fill_(1.0)
    dout = torch.randn(b, L, d_model, generator=g).to("cuda", torch.bfloat16)
    mixer_leaves = (zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, out_w)

    def mixer():
        for t in mixer_leaves:
            t.grad = None
        out = mamba_split_conv1d_scan_triton(
            zxbcdt, conv_w, conv_b, dt_bias, A, D, Q, seq_idx=seq, rmsnorm_weight=norm_w, rmsnorm_eps=1e-5,
            outproj_weight=out_w, headdim=P, ngroups=G, norm_before_gate=False, keep_states=True, fuse_gate=fuse_gate,
        )  # fmt: skip
        materialize(out).backward(dout)

    bare_leaves = {
        k: v.detach().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inp.items()
    }
    dy = torch.randn_like(inp["x"])

    def bare():
        for v in bare_leaves.values():
            if isinstance(v, torch.Tensor):
                v.grad = None
        v = bare_leaves
        y = ssd_chunk_scan_triton(
            v["x"], v["dt"], v["A"], v["B"], v["C"], Q, D=v["D"], dt_bias=v["dt_bias"], dt_softplus=True,
            seq_idx=seq, keep_states=True,
        )  # fmt: skip
        y.backward(dy)

    return mixer, bare


def time_variants(shape_name: str, docs: bool, variants: dict[str, dict], iters: int, fuse_gate: bool) -> dict:
    """The mixer's kernels under the default config ("base") and each variant, two alternating rounds; prints the
    kernels whose time differs and the totals, returns {column: {kernel: ms}}."""
    mixer, _ = steps(shape_name, docs, fuse_gate)
    configs = {"base": {}, **variants}
    runs, heads = {}, []
    for r in (1, 2):
        for i, (label, over) in enumerate(configs.items()):
            patched_config(over)
            runs[f"{label} #{r}"] = kernel_times(mixer, iters)
            heads.append(f"v{i}#{r}")
    patched_config({})
    cols = list(runs)
    print(f"\n{shape_name}{' with documents' if docs else ''}: the mixer's device ms per forward + backward")
    for i, label in enumerate(configs):
        print(f"  v{i}: {label}")
    print(f"{'kernel':50s} " + " ".join(f"{h:>9s}" for h in heads))
    names = sorted(set().union(*runs.values()), key=lambda k: -runs[cols[0]].get(k, 0.0))
    for k in names:
        times = [runs[c].get(k, 0.0) for c in cols]
        if max(times) - min(times) > 0.002 or k == names[0]:
            print(f"{k[:50]:50s} " + " ".join(f"{t:9.4f}" for t in times))
    print(f"{'total':50s} " + " ".join(f"{sum(runs[c].values()):9.4f}" for c in cols))
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1.3b,370m", help=f"comma-separated, of {', '.join(D_MODEL)}")
    ap.add_argument("--docs", action="store_true", help="packed documents (seq_idx), as the data loader gives them")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument(
        "--unfused_gate",
        action="store_true",
        help="the chunk scan without the gate, the gated norm after it (the configs fuse it: fuse_gate_into_scan)",
    )
    ap.add_argument("--out", default="outputs/bench_mixer.json")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="FIELD=VALUE,...",
        help="our SSD kernels' config fields (repeatable, one variant each): the mixer under each, against the default",
    )
    a = ap.parse_args(argv)
    variants = {v: parse_sets(ap, v.split(","), flag="--variant") for v in a.variant}
    for v, over in variants.items():  # BlockConfig's own checks, before any GPU time is spent
        try:
            dataclasses.replace(block_config(256, 64, 128), **over)
        except (TypeError, ValueError) as e:
            ap.error(f"--variant {v}: {e}")
    shapes = [s for s in a.shapes.split(",") if s]
    if not shapes or any(s not in D_MODEL for s in shapes):
        ap.error(f"--shapes takes a comma-separated list of {', '.join(D_MODEL)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_mixer.py times GPU kernels: run it on a CUDA machine (bash .gpu/setup.sh first)")
    record = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "docs": a.docs}
    if variants:
        record["variants"] = {
            name: time_variants(name, a.docs, variants, a.iters, not a.unfused_gate) for name in shapes
        }
        shapes = []
    for name in shapes:
        mixer, bare = steps(name, a.docs, not a.unfused_gate)
        sides = (("mixer", mixer), ("bare", bare))
        runs = {f"{side}{r}": kernel_times(fn, a.iters) for r in (1, 2) for side, fn in sides}
        record[name] = runs
        cols = ("mixer1", "mixer2", "bare1", "bare2")
        print(f"\n{name}{' with documents' if a.docs else ''}: device ms per forward + backward")
        print(f"{'kernel':60s} " + " ".join(f"{c:>8s}" for c in cols))
        for k in sorted(set(runs["mixer1"]) | set(runs["bare1"]), key=lambda k: -runs["mixer1"].get(k, 0.0)):
            print(f"{k:60s} " + " ".join(f"{runs[c].get(k, 0.0):8.4f}" for c in cols))
        print(f"{'total':60s} " + " ".join(f"{sum(runs[c].values()):8.4f}" for c in cols))
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
