"""GPU time of the model's dense products (in_proj, out_proj, lm_head) at the benchmark's shapes, whole and in other
shapes of the same work, so that a change to how the model calls cuBLAS is measured before it is made.

    bash .gpu/setup.sh && python3 benchmarks/bench_products.py [--flavors 1.3B,370M] [--iters 20] [--out r.json]

Why: cuBLAS picks its kernel by shape, and at the 1.3B's in_proj (8,512 output columns) the two backward products
ran at 703-705 TFLOP/s where 8,192 columns ran at 736-740 (H100, session 68, docs/ssd_sessions.md). Splitting a
product or zero-padding its reduction keeps the result's precision (every output element is still one float32 sum
of the same terms, rounded once), so where a split or a padding is faster the model can call it that way.

Rows, per flavor, at M = batch x seq_len tokens (compare_mamba_ssm.py's: 1.3B 4 x 4096, 370M 8 x 2048), bf16
operands, outputs in bf16 (the benchmark trains the linear weights with bf16 gradients; lm_head's input and weight
gradients are float32, as the fused loss writes them):
  <product> fwd / dx / dw        x W^T, the input gradient dy W, the weight gradient dy^T x
  <product> dw rows <cuts>       dw as row blocks ending at cuts, each a product into its rows of one buffer
  <product> dw cols <cut>        dw as two column blocks [0, cut) and the rest into one buffer (ldc = K)
  <product> dx rows <cut>        dx as two blocks of tokens (rows of dy and of dx)
  <product> dx cols <cut>        dx as two column blocks into one buffer (ldc = K)
  <product> dx K padded to <K'>  dx over K' > K columns of dy and rows of W, the added ones zero
  <product> fwd N <cut> + rest   the forward as two column blocks written into one buffer (ldc = N)
  <product> fwd N padded to <N'> the forward over N' > N output columns (W's added rows zero), ldc = N'
  <product> dx K <cut> + rest    a float32 input gradient (lm_head's) as two products summed in float32
(session 69 added the rows and columns halves for out_proj, whose sizes are multiples of 1,024: its backward
products ran at 693-694 TFLOP/s against its forward's 733.)
Each variant is checked against its whole product before it is timed: max |difference| / max |whole| is printed
(0 where bit for bit; a different summation order shows as float rounding). Times: bench_optimizer.time_step's
median over 3 rounds of `--iters` calls; TFLOP/s from 2 M N K.

--energy S adds each row's power and energy per call under sustained load (bench_energy.measure: CUDA-graph replays
for S seconds after a 1 s warm-up, NVML's energy counter): the trained step runs at the power limit, where a product
costs its joules rather than its isolated microseconds. Session 70 found the isolated times a poor guide end to
end: the 1.3B's in_proj input gradient in 1,024-column halves ran 6.7% faster alone and the step 0.2-0.6% slower.
--products limits the rows to some of in_proj, out_proj, lm_head.
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

from models import build_model_args  # noqa: E402

# flavor -> tokens per step in compare_mamba_ssm.py (batch x seq_len)
TOKENS = {"1.3B": 4 * 4096, "370M": 8 * 2048}
PRODUCTS = ("in_proj", "out_proj", "lm_head")  # product_shapes' names, in its order


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavors", default="1.3B,370M", help=f"comma-separated, of {sorted(TOKENS)}")
    ap.add_argument("--iters", type=int, default=20, help="calls per timed round")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    ap.add_argument("--energy", type=float, default=0.0, help="seconds of sustained load per row for W and mJ (0: off)")
    ap.add_argument("--products", default=",".join(PRODUCTS), help=f"comma-separated, of {', '.join(PRODUCTS)}")
    return ap.parse_args(argv)


def product_shapes(flavor: str) -> list[tuple[str, int, int, int, torch.dtype]]:
    """(product, M tokens, N output features, K input features, dtype of its gradients) of the flavor's products."""
    a = build_model_args(flavor)
    d_in_proj = 2 * a.d_inner + 2 * a.ngroups * a.d_state + a.nheads
    M = TOKENS[flavor]
    return [
        ("in_proj", M, d_in_proj, a.d_model, torch.bfloat16),
        ("out_proj", M, a.d_model, a.d_inner, torch.bfloat16),
        ("lm_head", M, a.padded_vocab_size, a.d_model, torch.float32),
    ]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def row_cuts(N: int) -> list[list[int]]:
    """Row blocks to try for a weight gradient of N rows: the largest multiple of 1024 below N and the rest, the
    largest multiple of 256 and the rest (the model's blocks leave a 320-row rest at the 1.3B's in_proj: 38 us of a
    split-K kernel + a 5 us reduce a layer in session 69's trace), and two halves at a multiple of 128; only the
    halves where N is a multiple of 1024 already."""
    if N < 2048:
        return []
    if N % 1024 == 0:
        return [[N // 2]]
    cuts = [[N // 1024 * 1024], [N // 256 * 256], [round_up(N // 2, 128)]]
    return [c for i, c in enumerate(cuts) if c[0] != N and c not in cuts[:i]]


def half_cut(n: int) -> int | None:
    """Where to cut n rows or columns in two for the halves variants: n / 2 rounded up to 128, None below 2,048."""
    return round_up(n // 2, 128) if n >= 2048 else None


def padded_ks(K: int) -> list[int]:
    """Reductions to pad an input gradient's K to: the next multiples of 128 and of 256 above K (none if K is one)."""
    return sorted({round_up(K, m) for m in (128, 256)} - {K})


def mm_into(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """a @ b into out (a view of a larger buffer where the caller splits), in out's dtype: float32 from 16-bit
    operands through cuBLAS's out_dtype on CUDA, else the product and a copy."""
    if out.dtype != a.dtype:
        if a.is_cuda:
            return torch.mm(a, b, out_dtype=out.dtype, out=out)
        return out.copy_(a @ b)
    return torch.mm(a, b, out=out)


def mm_rows(a: torch.Tensor, b: torch.Tensor, cuts: list[int], out: torch.Tensor) -> torch.Tensor:
    """out = a @ b, as row blocks [start, cut) of a and of out for each cut, then the rest."""
    start = 0
    for cut in [*cuts, a.shape[0]]:
        mm_into(a[start:cut], b, out[start:cut])
        start = cut
    return out


def mm_cols(a: torch.Tensor, b: torch.Tensor, cuts: list[int], out: torch.Tensor) -> torch.Tensor:
    """out = a @ b, as column blocks [start, cut) of b and of out (ldc = out's width) for each cut, then the rest."""
    start = 0
    for cut in [*cuts, b.shape[1]]:
        mm_into(a, b[:, start:cut], out[:, start:cut])
        start = cut
    return out


def dw_rows(dy_MN: torch.Tensor, x_MK: torch.Tensor, cuts: list[int], out_NK: torch.Tensor) -> torch.Tensor:
    """out = dy^T x [N, K], as row blocks [start, cut) for each cut, then the rest."""
    return mm_rows(dy_MN.t(), x_MK, cuts, out_NK)


def zero_padded(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """t with `dim` grown to `size`, the new entries zero (a fresh contiguous tensor)."""
    shape = list(t.shape)
    shape[dim] = size
    out = torch.zeros(shape, device=t.device, dtype=t.dtype)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def dx_k_split_float32(dy_MN: torch.Tensor, w_NK: torch.Tensor, cut: int, out_MK: torch.Tensor) -> torch.Tensor:
    """out (float32) = dy W as dy[:, :cut] W[:cut], then dy[:, cut:] W[cut:] added into it in float32 (cuBLAS's addmm
    with beta 1 where this torch takes a float32 input, autocast_linear.add_mm_float32_): the same float32 sum of the
    same terms, in two parts."""
    from models.kernels.autocast_linear import add_mm_float32_

    mm_into(dy_MN[:, :cut], w_NK[:cut], out_MK)
    if dy_MN.is_cuda:
        return add_mm_float32_(out_MK, dy_MN[:, cut:], w_NK[cut:])
    return out_MK.addmm_(dy_MN[:, cut:].to(out_MK.dtype), w_NK[cut:].to(out_MK.dtype))  # the CPU test's float64


def fwd_split(x_MK: torch.Tensor, w_NK: torch.Tensor, cut: int, out_MN: torch.Tensor) -> torch.Tensor:
    """out = x W^T [M, N] as columns [0, cut) and [cut, N), each written into its columns of out (ldc = N)."""
    return mm_cols(x_MK, w_NK.t(), [cut], out_MN)


def fwd_padded(x_MK: torch.Tensor, w_pad_NK: torch.Tensor, N: int, out_MN: torch.Tensor) -> torch.Tensor:
    """x W^T over N' > N output columns (W's rows zero-padded to N'), written whole into out [M, N']; the first N
    columns, the product's (a view with row stride N', as the model's consumers of in_proj's output read it)."""
    return mm_into(x_MK, w_pad_NK.t(), out_MN)[:, :N]


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


def product_rows(
    name: str, M: int, N: int, K: int, grad_dtype: torch.dtype, iters: int, dev, energy=None
) -> list[dict]:
    """The rows of one product (module docstring), each variant checked against its whole product; energy(fn), where
    given, adds the row's watts, mJ per call and SM clock under sustained load (--energy)."""
    from benchmarks.bench_optimizer import time_step

    bf16 = torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, K, device=dev, generator=gen).to(bf16)
    w = (torch.randn(N, K, device=dev, generator=gen) * 0.02).to(bf16)
    dy = (torch.randn(M, N, device=dev, generator=gen) * 1e-3).to(bf16)
    fwd_out = torch.empty(M, N, device=dev, dtype=bf16)
    dx_out = torch.empty(M, K, device=dev, dtype=grad_dtype)
    dw_out = torch.empty(N, K, device=dev, dtype=grad_dtype)
    flops = 2 * M * N * K
    whole = {
        "fwd": lambda: mm_into(x, w.t(), fwd_out),
        "dx": lambda: mm_into(dy, w, dx_out),
        "dw": lambda: mm_into(dy.t(), x, dw_out),
    }
    refs = {kind: fn().clone() for kind, fn in whole.items()}
    cases = [(kind, kind, fn) for kind, fn in whole.items()]
    for cuts in row_cuts(N):
        cases.append(("dw", f"dw rows {cuts}", lambda cuts=cuts: dw_rows(dy, x, cuts, dw_out)))
    if (cut := half_cut(K)) is not None:
        cases.append(("dw", f"dw cols {cut}", lambda cut=cut: mm_cols(dy.t(), x, [cut], dw_out)))
        cases.append(("dx", f"dx cols {cut}", lambda cut=cut: mm_cols(dy, w, [cut], dx_out)))
    if (cut := half_cut(M)) is not None:
        cases.append(("dx", f"dx rows {cut}", lambda cut=cut: mm_rows(dy, w, [cut], dx_out)))
    for k_pad in padded_ks(N):
        dy_pad, w_pad = zero_padded(dy, 1, k_pad), zero_padded(w, 0, k_pad)
        cases.append(("dx", f"dx K padded to {k_pad}", lambda d=dy_pad, p=w_pad: mm_into(d, p, dx_out)))
        out_pad = torch.empty(M, k_pad, device=dev, dtype=bf16)
        cases.append(("fwd", f"fwd N padded to {k_pad}", lambda p=w_pad, o=out_pad: fwd_padded(x, p, N, o)))
    if N % 1024 and N > 2048:
        cut = N // 1024 * 1024
        cases.append(("fwd", f"fwd N {cut} + rest", lambda cut=cut: fwd_split(x, w, cut, fwd_out)))
        if grad_dtype == torch.float32:  # a float32 input gradient can take its reduction in two parts exactly so
            cases.append(("dx", f"dx K {cut} + rest", lambda cut=cut: dx_k_split_float32(dy, w, cut, dx_out)))
    rows = []
    for kind, label, fn in cases:
        err = rel_diff(fn(), refs[kind])
        t = time_step(fn, iters)
        rows.append(
            dict(product=name, M=M, N=N, K=K, row=label, kind=kind, ms=t["ms"], host_ms=t["host_ms"],
                 tflops=flops / t["ms"] / 1e9, rel_diff=err)
        )  # fmt: skip
        if energy is not None:
            e = energy(fn)
            rows[-1].update(watts=e["watts"], mj=e["mj_per_call"], sustained_ms=e["ms"], sm_clock_mhz=e["sm_clock_mhz"])
    return rows


def table_line(head: str, r: dict, whole: dict, energy: bool) -> str:
    """One printed row: time and its change against the whole product, then (--energy) the sustained figures."""
    change = 100 * (r["ms"] / whole["ms"] - 1)
    line = f"{head}| {r['row']} | {1e3 * r['ms']:.1f} | {r['tflops']:.0f} | {change:+.1f}% | {r['rel_diff']:.1e} |"
    if energy:
        line += f" {1e3 * r['sustained_ms']:.1f} | {r['watts']:.0f} | {r['sm_clock_mhz']} | {r['mj']:.1f} | "
        line += f"{100 * (r['mj'] / whole['mj'] - 1):+.1f}% |"
    return line


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    flavors = [f for f in a.flavors.split(",") if f]
    for f in flavors:
        if f not in TOKENS:
            raise SystemExit(f"--flavors: {f!r} is not one of {sorted(TOKENS)}")
    names = [p for p in a.products.split(",") if p]
    for p in names:
        if p not in PRODUCTS:
            raise SystemExit(f"--products: {p!r} is not one of {', '.join(PRODUCTS)}")
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench_products.py times cuBLAS on the GPU: run it on a CUDA machine (bash .gpu/setup.sh first)"
        )
    dev = torch.device("cuda")
    energy = None
    if a.energy > 0:
        from benchmarks.bench_energy import _Nvml, measure

        nvml = _Nvml()
        energy = lambda fn: measure(fn, nvml, a.energy)  # noqa: E731
    rows = []
    print(f"{torch.cuda.get_device_name()}, bf16 operands")
    extra = " sustained us | W | MHz | mJ | mJ vs whole |" if energy else ""
    print(f"| flavor | product (M x N x K) | row | us | TFLOP/s | vs whole | max rel. difference |{extra}")
    print("| --- " * (7 + 5 * bool(energy)) + "|")
    for flavor in flavors:
        for name, M, N, K, grad_dtype in product_shapes(flavor):
            if name not in names:
                continue
            prod = product_rows(name, M, N, K, grad_dtype, a.iters, dev, energy)
            base = {r["row"]: r for r in prod if r["row"] == r["kind"]}
            for r in prod:
                r["flavor"] = flavor
                print(table_line(f"| {flavor} | {name} ({M} x {N} x {K}) ", r, base[r["kind"]], energy is not None))
            rows += prod
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
