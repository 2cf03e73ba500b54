"""Our SSD kernels and mamba_ssm's, side by side in Triton's interpreter on the CPU, against the float64 reference.

    pip install --no-deps einops .gpu/wheels/mamba_ssm-2.3.2.post1-py3-none-any.whl   # the GPU wheelhouse's
    python3 benchmarks/ssd_numerics_cpu.py --L 256 --chunk 64 --seq              # errors of every output / gradient
    python3 benchmarks/ssd_numerics_cpu.py --L 256 --chunk 64 --seq --parts      # + where dA's error comes from
    bash .gpu/setup.sh && python3 benchmarks/ssd_numerics_cpu.py --cuda --dtype bfloat16 --L 1024 --chunk 256 \
        --heads 8 --headdim 64 --dstate 128 --seq --parts                         # the same on a GPU, compiled

mamba_ssm's Triton kernels are pure Python; its PyPI sdist does not build on a machine without CUDA, so take the
wheel from the GPU wheelhouse (../shared/gpu, copied to .gpu/: built from that sdist with MAMBA_SKIP_CUDA_BUILD).

No GPU needed: both kernel sets run in float16 under TRITON_INTERPRET=1 (numpy has no bfloat16) on the same inputs,
with mamba_ssm's autotuner reduced to its smallest config and its CUDA-only calls stubbed. The ratios track the
bf16 GPU comparison of `bench_ssd.py --numerics` closely enough to find a numerics gap offline: the dA excess at
whole-chunk lengths (docs/ssd_sessions.md, session 7) was found here. --parts splits the decay gradient g (the
gradient of dt * A before the within-chunk cumsum) into the y state term O, the intra-chunk pairs R, the
chunk-state term q and the chunk-end term dtot, for both kernel sets, each against our kernels run in float64,
and reports each part's share of dA's error.

With --cuda the same runs compiled on a GPU (mamba_ssm as installed), in --dtype (bfloat16: what the GPU
comparison of bench_ssd.py measures); the parts' exact values then come from our kernels in float32 with full-
precision dots (errors near 1e-6, three digits below bfloat16's), the gradients' from the float64 reference.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

ON_GPU = "--cuda" in sys.argv
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch
import triton

from models.kernels.ssd_reference import ssd_chunk_scan_ref
from models.kernels.ssd_triton import autograd
from tests.interpreter_child import patch_interpreter
from tests.ssd_checks import fp16_model_inputs, gradients


def _import_mamba_for_the_interpreter():
    """mamba_ssm's chunked SSD with its autotuner on one config and its CUDA-only calls stubbed."""
    original = triton.autotune

    def smallest_config(configs, key, **kw):  # the interpreter cannot benchmark configs
        cfg = min(configs, key=lambda c: sum(v for v in c.kwargs.values() if isinstance(v, int)))
        return original(configs=[cfg], key=key, **kw)

    triton.autotune = smallest_config
    torch.cuda.device = lambda index: contextlib.nullcontext()

    class _Props:
        multi_processor_count = 132

    torch.cuda.get_device_properties = lambda device: _Props()
    try:
        import selective_scan_cuda  # noqa: F401  (mamba_ssm's Mamba-1 extension, imported by its __init__)
    except ImportError:
        import types

        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    from mamba_ssm.ops.triton import ssd_combined

    return ssd_combined


def _rev_cumsum(t):
    return torch.flip(torch.cumsum(torch.flip(t, [-1]), -1), [-1])


def decay_parts(inp, seq_idx, gy, gf, chunk: int, mamba, dtype, exact_dtype, device):
    """The parts of g from our kernels (dtype and exact_dtype) and mamba_ssm's (dtype), in g's units."""
    captured = {}
    original_dt = autograd.dt_backward

    def spy(dt, dt_bias, A, ddt_p, O, rev_parts, q, dtot, *rest, **kw):  # noqa: E741
        # O and R's slots arrive apart (R as row minus column sums, reverse-cumsummed like O).
        NC, Q = ddt_p.shape[2:]
        dt_p, _, _ = autograd.dt_forward(dt, dt_bias, A, Q, NC, True, (0.0, float("inf")))
        captured["parts"] = dict(
            O=_rev_cumsum(O.double()),
            R=_rev_cumsum(rev_parts.double().sum(0)),
            q=(torch.cumsum(q, -1) - q).double(),
            dtot=dtot.double().sum(0)[..., None].expand_as(q).clone(),
        )
        captured["dt_p"] = dt_p.double()
        return original_dt(dt, dt_bias, A, ddt_p, O, rev_parts, q, dtot, *rest, **kw)

    autograd.dt_backward = spy
    ours = {}
    try:
        for dt_ in (dtype, exact_dtype):
            gradients(autograd.ssd_chunk_scan_triton, inp, seq_idx, gy, chunk, dt_, device, gf)
            ours[dt_] = {
                k: v.cpu() if torch.is_tensor(v) else {n: t.cpu() for n, t in v.items()} for k, v in captured.items()
            }
    finally:
        autograd.dt_backward = original_dt

    cap = {}

    def wrap(name, index):
        f = getattr(mamba, name)

        def wrapped(*a, **k):
            out = f(*a, **k)
            cap[name] = (out if index is None else out[index]).detach().double().cpu()
            return out

        setattr(mamba, name, wrapped)
        return f

    saved = {n: wrap(n, i) for n, i in (("_chunk_scan_bwd_dC", 1), ("_chunk_state_bwd_db", 1),
                                        ("_chunk_scan_bwd_ddAcs_stable", None), ("_state_passing_bwd", 1))}  # fmt: skip
    try:
        gradients(mamba.mamba_chunk_scan_combined, inp, seq_idx, gy, chunk, dtype, device, gf)
    finally:
        for n, f in saved.items():
            setattr(mamba, n, f)
    exact = ours[exact_dtype]["parts"]
    theirs = dict(
        O=_rev_cumsum(cap["_chunk_scan_bwd_dC"]),
        R=cap["_chunk_scan_bwd_ddAcs_stable"],
        q=cap["_chunk_state_bwd_db"],
        dtot=cap["_state_passing_bwd"][..., None].expand_as(exact["q"]),
    )
    return ours[dtype]["parts"], theirs, exact, ours[exact_dtype]["dt_p"]


def bench_case_inputs(case: str, dtype):
    """bench_ssd.py's numerics case ``shape:seq|noseq:init|noinit`` (its inputs, seed 7, and its cotangents)."""
    from benchmarks.bench_ssd import SHAPES, make_inputs

    shape, seq, init = case.split(":")
    sh = SHAPES[shape]
    raw = make_inputs(sh, seq == "seq", seed=7, dtype=dtype, with_init=init == "init")
    g = torch.Generator(device="cuda").manual_seed(0)
    b, L, H, P, N = (sh[k] for k in "bLHPN")
    gy = torch.randn(b, L, H, P, device="cuda", generator=g, dtype=torch.float64)
    gf = torch.randn(b, H, P, N, device="cuda", generator=g, dtype=torch.float64)
    inp = {k: raw[k] for k in ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_states") if raw[k] is not None}
    return inp, raw["seq_idx"], gy, gf, sh["Q"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--L", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--headdim", type=int, default=16)
    ap.add_argument("--dstate", type=int, default=32)
    ap.add_argument("--seq", action="store_true", help="documents (seq_idx)")
    ap.add_argument("--init", action="store_true", help="initial states")
    ap.add_argument("--final", action="store_true", help="final states with a cotangent of their own")
    ap.add_argument(
        "--bench_case",
        help="with --cuda: bench_ssd.py's numerics inputs and cotangents instead, e.g. small_even:seq:init",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", action="store_true", help="split dA's error by the parts of the decay gradient")
    ap.add_argument("--cuda", action="store_true", help="compiled on the GPU instead of the CPU interpreter")
    ap.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"), help="bfloat16 needs --cuda")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and not args.cuda:
        raise SystemExit("--dtype bfloat16 needs --cuda: the interpreter runs numpy, which has no bfloat16")
    if args.cuda:
        from mamba_ssm.ops.triton import ssd_combined as mamba

        device, exact_dtype = "cuda", torch.float32
    else:
        patch_interpreter()
        mamba = _import_mamba_for_the_interpreter()
        device, exact_dtype = "cpu", torch.float64
    if args.bench_case:
        inp, seq_idx, gy, gf, args.chunk = bench_case_inputs(args.bench_case, dtype)
        tag = f"{args.dtype} bench case {args.bench_case}"
    else:
        inp, seq_idx, gy = fp16_model_inputs(
            2, args.L, args.heads, args.headdim, args.dstate, args.seq, args.seed, dtype, args.init
        )
        gf = torch.randn(2, args.heads, args.headdim, args.dstate, dtype=torch.float64) if args.final else None
        tag = f"{args.dtype} L {args.L} chunk {args.chunk} seq {args.seq} init {args.init} final {args.final}"
    ref = gradients(ssd_chunk_scan_ref, inp, seq_idx, gy, args.chunk, torch.float64, gf=gf)
    ours = gradients(autograd.ssd_chunk_scan_triton, inp, seq_idx, gy, args.chunk, dtype, device, gf)
    theirs = gradients(mamba.mamba_chunk_scan_combined, inp, seq_idx, gy, args.chunk, dtype, device, gf)
    for k in ref:
        e_o = ((ours[k] - ref[k]).norm() / ref[k].norm()).item()
        e_m = ((theirs[k] - ref[k]).norm() / ref[k].norm()).item()
        print(f"{tag}  d{k:8s} ours {e_o:.2e}  mamba_ssm {e_m:.2e}  ratio {e_o / e_m:.2f}")
    if args.parts:
        lo, m, exact, dt_p = decay_parts(inp, seq_idx, gy, gf, args.chunk, mamba, dtype, exact_dtype, device)
        g = sum(exact.values())
        dA = (g * dt_p).sum(dim=(0, 2, 3))
        for k in exact:
            row = []
            for name, got in (("ours", lo[k]), ("mamba_ssm", m[k])):
                g_err = ((got - exact[k]).norm() / g.norm()).item()
                dA_err = (((got - exact[k]) * dt_p).sum(dim=(0, 2, 3)).norm() / dA.norm()).item()
                row.append(f"{name} g {g_err:.2e} dA {dA_err:.2e}")
            print(f"{tag}  part {k:4s} ({(exact[k].norm() / g.norm()).item():.2f} of g): " + " | ".join(row))


if __name__ == "__main__":
    main()
