"""Our gated RMSNorm halves (models/kernels/gated_rmsnorm_triton.py) next to mamba_ssm's, at the models' shapes.

    bash .gpu/setup.sh && python3 benchmarks/bench_norm.py [--shapes 1.3b,370m] [--tune] [--out results.json]

The norm's operands are what the fused mixer gives it: y the SSD output [B * L, d_inner] (contiguous), z and dz the
z slices of zxbcdt / dzxbcdt (row stride the width of zxbcdt), bf16, one group, norm_before_gate False (the models'),
a float32 weight. Times (triton.testing.do_bench, median ms) of the forward and of the backward with the normed output
recomputed (as the mixer's backward calls it) for both kernels in the same process, as TB/s of the bytes each pass
must move (forward: y, z in, out; backward: dout, y, z in, dy, dz, out), and how far apart their outputs are
(relative norm of the difference; both round to bf16).

Then the blocks' residual add + RMSNorm (models/kernels/add_rmsnorm_triton.py) next to mamba_ssm's rms_norm_fn with
prenorm, at d_model (half of d_inner): x bf16, the residual float32 (the models' residual_in_fp32), the backward
given both outputs' gradients (the normed output's in bf16, the new residual's in float32, as the next layer sends
them) through autograd; bytes: forward x, residual in, normed, new residual out; backward dy, new residual, its
gradient in, dx, dresidual out.
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

# tokens (batch x length), d_inner, width of zxbcdt (2 d_inner + 2 G N + H): z is its first d_inner channels.
SHAPES = {"1.3b": (4 * 4096, 4096, 2 * 4096 + 256 + 64), "370m": (8 * 2048, 2048, 2 * 2048 + 256 + 32)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def operands(shape_name: str, gen: torch.Generator) -> dict:
    M, D, F = SHAPES[shape_name]
    dev = torch.device("cuda")
    zxbcdt = torch.randn(M, F, generator=gen).to(dev, torch.bfloat16)
    dzxbcdt = torch.empty_like(zxbcdt)
    return dict(
        y=torch.randn(M, D, generator=gen).to(dev, torch.bfloat16),
        z=zxbcdt[:, :D],
        w=(1 + 0.1 * torch.randn(D, generator=gen)).to(dev),
        dout=torch.randn(M, D, generator=gen).to(dev, torch.bfloat16),
        dz=dzxbcdt[:, :D],
    )


def run(shape_name: str, sides=("ours", "mamba_ssm"), eps: float = 1e-5, nbg: bool = False) -> dict:
    import triton.testing

    from models.kernels import cuda as kcuda

    M, D, _ = SHAPES[shape_name]
    t = operands(shape_name, torch.Generator().manual_seed(0))
    rec, outs = {"shape": shape_name, "rows": M, "dim": D}, {}
    for name in sides:
        if name == "mamba_ssm" and not kcuda.cuda_kernels_available():
            continue

        def fwd(impl=name):
            return kcuda.gated_rmsnorm_forward(t["y"], t["w"], t["z"], eps, D, nbg, impl=impl)

        out, rstd = fwd()

        def bwd(impl=name, rstd=rstd):
            return kcuda.gated_rmsnorm_backward(
                t["dout"], t["y"], t["w"], t["z"], rstd, eps, D, nbg, t["dz"], True, impl=impl
            )

        rec[f"{name}_fwd_ms"] = triton.testing.do_bench(fwd, warmup=10, rep=100)
        rec[f"{name}_bwd_ms"] = triton.testing.do_bench(bwd, warmup=10, rep=100)
        dy, dw, out_again = bwd()
        outs[name] = (out, dy, t["dz"].clone(), dw.float(), out_again)
    if len(outs) == 2:
        for i, k in enumerate(("out", "dy", "dz", "dw", "out_recomputed")):
            rec[f"diff_{k}"] = rel(outs["ours"][i], outs["mamba_ssm"][i])
    bytes_fwd, bytes_bwd = 3 * 2 * M * D, 6 * 2 * M * D  # bf16 rows moved once each
    for name in outs:
        rec[f"{name}_fwd_TBps"] = bytes_fwd / rec[f"{name}_fwd_ms"] / 1e9
        rec[f"{name}_bwd_TBps"] = bytes_bwd / rec[f"{name}_bwd_ms"] / 1e9
    return rec


# --tune: our kernels' launch shapes (gated_rmsnorm_triton's module constants) tried one set at a time.
TUNE = [
    dict(
        _BWD_PROGRAMS_PER_SM=1, _BWD_ELEMS_PER_THREAD=16, _BWD_STAGES=None, _FWD_ELEMS_PER_THREAD=8, _FAST_SIGMOID=True
    ),
    dict(_FAST_SIGMOID=False),  # the sigmoid's reciprocal as a division (before session 38)
    dict(_BWD_STAGES=2),
    dict(_BWD_STAGES=3),
    dict(_BWD_STAGES=4),
    dict(_BWD_PROGRAMS_PER_SM=2),
    dict(_BWD_PROGRAMS_PER_SM=4),
    dict(_BWD_ELEMS_PER_THREAD=8, _FWD_ELEMS_PER_THREAD=8),
    dict(_BWD_ELEMS_PER_THREAD=32, _FWD_ELEMS_PER_THREAD=32),
]


def run_add(shape_name: str, impls: dict | None = None) -> dict:
    """Residual add + RMSNorm forward / backward times (ms) and TB/s of each implementation in `impls` (name ->
    add_rmsnorm_ref's signature; default ours and, where installed, mamba_ssm's), and their outputs' differences."""
    import triton.testing

    from models.kernels import cuda as kcuda
    from models.kernels.add_rmsnorm_triton import add_rmsnorm_triton

    if impls is None:
        impls = {"ours": add_rmsnorm_triton}
        if kcuda.cuda_kernels_available():
            impls["mamba_ssm"] = kcuda.add_rmsnorm_cuda
    tokens, d_inner, _ = SHAPES[shape_name]
    D, dev = d_inner // 2, torch.device("cuda")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, D, generator=gen).to(dev, torch.bfloat16).requires_grad_()
    res = torch.randn(tokens, D, generator=gen).to(dev).requires_grad_()
    w = (1 + 0.1 * torch.randn(D, generator=gen)).to(dev).requires_grad_()
    dy = torch.randn(tokens, D, generator=gen).to(dev, torch.bfloat16)
    dres = torch.randn(tokens, D, generator=gen).to(dev)
    n = tokens * D
    rec, outs = {"shape": shape_name, "d_model": D, "tokens": tokens}, {}
    for name, fn in impls.items():
        rec[f"{name}_fwd_ms"] = triton.testing.do_bench(lambda: fn(x, res, w, 1e-5, True), warmup=10, rep=100)
        normed, new_res = fn(x, res, w, 1e-5, True)

        def grads(normed=normed, new_res=new_res):
            return torch.autograd.grad((normed, new_res), (x, res, w), (dy, dres), retain_graph=True)

        rec[f"{name}_bwd_ms"] = triton.testing.do_bench(grads, warmup=10, rep=100)
        rec[f"{name}_fwd_TBps"] = n * (2 + 4 + 2 + 4) / rec[f"{name}_fwd_ms"] / 1e9
        rec[f"{name}_bwd_TBps"] = n * (2 + 4 + 4 + 2 + 4) / rec[f"{name}_bwd_ms"] / 1e9
        outs[name] = (normed.detach(), *grads())
    first = next(iter(outs))
    for name in list(outs)[1:]:
        for i, k in enumerate(("normed", "dx", "dres", "dw")):
            rec[f"diff_{name}_{k}"] = rel(outs[name][i], outs[first][i])
    return rec


def tune(shape_names: list[str]) -> None:
    from models.kernels import gated_rmsnorm_triton as gn

    default = {k: getattr(gn, k) for k in TUNE[0]}
    for setting in TUNE:
        for k, v in {**default, **setting}.items():  # a set names what it changes; the rest is the module's
            setattr(gn, k, v)
        short = " ".join(f"{k.strip('_').lower()}={v}" for k, v in setting.items())
        for shape in shape_names:
            r = run(shape, sides=("ours",))
            print(f"tune {shape} {short}: fwd {r['ours_fwd_ms']:.4f} ms ({r['ours_fwd_TBps']:.2f} TB/s), "
                  f"bwd {r['ours_bwd_ms']:.4f} ms ({r['ours_bwd_TBps']:.2f} TB/s)", flush=True)  # fmt: skip
    for k, v in default.items():
        setattr(gn, k, v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1.3b,370m")
    ap.add_argument("--tune", action="store_true", help="first time our kernels under each launch-shape set in TUNE")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_norm.py times GPU kernels: run it on a CUDA machine (bash .gpu/setup.sh first)")
    shapes = a.shapes.split(",")
    if a.tune:
        tune(shapes)
    recs = [run(s) for s in shapes]
    print("| shape | fwd ours | fwd mamba_ssm | bwd ours | bwd mamba_ssm | ours / theirs (f+b) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in recs:
        tf, tb = r.get("mamba_ssm_fwd_ms", float("nan")), r.get("mamba_ssm_bwd_ms", float("nan"))
        ratio = (r["ours_fwd_ms"] + r["ours_bwd_ms"]) / (tf + tb)
        print(
            f"| {r['shape']} | {r['ours_fwd_ms']:.4f} ms | {tf:.4f} ms | {r['ours_bwd_ms']:.4f} ms | {tb:.4f} ms | "
            f"{ratio:.2f} |"
        )
    for r in recs:
        diffs = ", ".join(f"{k} {v:.1e}" for k, v in r.items() if k.startswith("diff_"))
        theirs = ""
        if "mamba_ssm_fwd_TBps" in r:
            theirs = f"; mamba_ssm {r['mamba_ssm_fwd_TBps']:.2f} / {r['mamba_ssm_bwd_TBps']:.2f} TB/s"
        print(f"{r['shape']}: ours {r['ours_fwd_TBps']:.2f} / {r['ours_bwd_TBps']:.2f} TB/s (fwd / bwd, of the bytes "
              f"each must move){theirs}; ours vs mamba_ssm: {diffs}")  # fmt: skip
    adds = [run_add(s) for s in shapes]
    print("| shape (add + RMSNorm) | fwd ours | fwd mamba_ssm | bwd ours | bwd mamba_ssm | bwd TB/s ours |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in adds:
        tf, tb = r.get("mamba_ssm_fwd_ms", float("nan")), r.get("mamba_ssm_bwd_ms", float("nan"))
        print(f"| {r['shape']} | {r['ours_fwd_ms']:.4f} ms | {tf:.4f} ms | {r['ours_bwd_ms']:.4f} ms | {tb:.4f} ms | "
              f"{r['ours_bwd_TBps']:.2f} |")  # fmt: skip
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(gated=recs, add=adds), f, indent=1)


if __name__ == "__main__":
    main()
