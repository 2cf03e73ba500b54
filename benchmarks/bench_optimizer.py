"""GPU time of the trainer's optimizer phase (gradient norm + fused AdamW with on-device clipping and skipping) on a
model flavor's parameters, next to what the same bytes cost at the GPU's bandwidth.

    bash .gpu/setup.sh && python3 benchmarks/bench_optimizer.py [--flavor 1.3B] [--iters 20] [--out r.json]

Rows (CUDA events around `iters` repetitions, median of 3 rounds, ms per step; with the host's time per step to
launch them, and "host-bound" where that reaches the step's time: then the row times the launches, not the kernels,
as the 370M's rows did in session 66, 6.7 ms against the trained step's 3.5 ms of AdamW kernels):
  grad_norm        parallelisms.grad_norm.global_grad_norm over every gradient (what train.py calls: on CUDA one
                   Triton launch over a table of the gradients, components/sumsq_triton.py, since session 26)
  grad_norm_foreach  the same sum of squares from torch's _foreach_norm (the trainer's before session 26)
  adamw_step       grad_norm, then components.optimizer.take_optimizer_steps with a device skip flag: torch's
                   fused AdamW over the parameter lists, gradients divided by the clipping divisor inside its
                   kernels (optimizer.implementation "fused": train.py's optimizer phase before session 21)
  adamw_step_triton  the same with optimizer.implementation "triton" (components/adamw_triton.py: one launch per
                   parameter group over address tables, fused AdamW's state; what "auto" runs on CUDA)
  adamw_step_triton_scalar  the same with the kernel's ALIGNED off: 4-byte loads, as for tensors whose addresses or
                   sizes do not allow 16-byte ones (the kernel before session 26)
  adamw_flat       torch's fused AdamW on ONE flat tensor of the same element count: the multi-tensor kernel
                   without per-tensor boundaries
  copy_bound       the bytes the step must move at least (read parameter, gradient and both moments, write
                   parameter and moments: 28 bytes per float32 parameter) as copies of flat buffers: the bandwidth
                   bound
With --as_trained, also the step as the trainer runs it on one GPU with compare_mamba_ssm.py's settings: the blocks'
linear weights' gradients in bf16 (training.grad_dtype bfloat16) and every weight matrix's bf16 copy written by the
step (optimizer.weight_copies), and the launches that makes (one per parameter group and gradient dtype: tensors,
elements, programs, whether its loads are 16-byte ones):
  grad_norm_as_trained  grad_norm in that setting (the bytes: the gradients', 2 or 4 per parameter)
  adamw_as_trained     grad_norm + our step in that setting
  copy_bound_as_trained  copy_bound scaled to the bytes that setting moves (24 per parameter for the float32
                   parameter and moments, + 2 or 4 for the gradient, + 2 for a copy written)
The step moves the same bytes in every row; the ratio to copy_bound is how far from the memory bound it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch

from components import adamw_triton, sumsq_triton  # noqa: E402
from components.gradient_dtype import set_linear_weight_grad_dtype  # noqa: E402
from components.optimizer import build_optimizer, take_optimizer_steps  # noqa: E402
from configs.job_config import Optimizer  # noqa: E402
from models import build_model_args, build_model_on_meta  # noqa: E402
from models.kernels import weight_copies  # noqa: E402
from parallelisms.grad_norm import global_grad_norm  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="1.3B", help="model flavor whose parameters are stepped (models/flavors)")
    ap.add_argument("--iters", type=int, default=20, help="repetitions per timed round")
    ap.add_argument("--out", default="", help="write the rows as JSON here")
    ap.add_argument(
        "--adamw_tiles",
        default="",
        help="also adamw_step_triton at these elements-per-program x warps, e.g. 4096x8,8192x8 (rows "
        "adamw_step_triton_<block>x<warps>; components/adamw_triton.py's BLOCK, WARPS)",
    )
    ap.add_argument(
        "--sumsq_blocks",
        default="",
        help="with --as_trained, also the norm with the bf16 gradients summed in blocks of these many elements, e.g. "
        "4096,8192 (rows grad_norm_as_trained_<block>; components/sumsq_triton.py's BLOCK, the float32 ones kept)",
    )
    ap.add_argument(
        "--as_trained",
        action="store_true",
        help="also the step with bf16 gradients for the blocks' linear weights and the weights' bf16 copies, as "
        "the trainer runs it on one GPU (rows adamw_as_trained, copy_bound_as_trained; the launches printed)",
    )
    return ap.parse_args(argv)


def time_step(fn, iters: int) -> dict:
    """{ms: the median over 3 rounds of the time per call of fn between CUDA events around `iters` calls, host_ms:
    the host's time per call to launch them in that round}. Where host_ms reaches ms the GPU waited for the host
    (the 370M's 435 tensors' tables, session 66): ms is then the host's rate, not the kernels' time."""
    rounds = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        host = (time.perf_counter() - t0) * 1e3 / iters
        end.record()
        end.synchronize()
        rounds.append((start.elapsed_time(end) / iters, host))
    ms, host_ms = sorted(rounds)[1]
    return dict(ms=ms, host_ms=host_ms)


def gpu_ms(fn, iters: int) -> float:
    """time_step's ms alone (benchmarks/bench_loss.py times its rows with it)."""
    return time_step(fn, iters)["ms"]


HOST_BOUND = 0.9  # a row whose host time per call is at least this share of its time is marked host-bound


def model_with_gradients(flavor: str, device: torch.device, gen: torch.Generator):
    """(model, trainable parameters) of the flavor on `device`, weights ~ N(0, 0.02) and random gradients (1e-3)."""
    model = build_model_on_meta(build_model_args(flavor))
    model.to_empty(device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in params:
            p.normal_(0.0, 0.02, generator=gen)
            p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
    return model, params


def as_trained_rows(model, params, iters: int, copy_bound_ms: float, sumsq_blocks: list[int]) -> list[dict]:
    """The rows of --as_trained (module docstring): the same parameters, the blocks' linear weights' gradients
    redrawn in bf16, a bf16 copy of every weight matrix (the products' weights: in_proj, out_proj, the embedding
    that lm_head shares), our optimizer keeping them current; its launches printed."""
    bf16 = torch.bfloat16
    for p in params:
        p.grad = None  # a weight takes its grad_dtype without a gradient of the other dtype attached
    set_linear_weight_grad_dtype([model], "bfloat16")
    gen = torch.Generator(device=params[0].device).manual_seed(1)
    with torch.no_grad():
        for p in params:
            dtype = bf16 if getattr(p, "grad_dtype", None) == bf16 else torch.float32
            p.grad = (torch.randn(p.shape, device=p.device, generator=gen) * 1e-3).to(dtype)
    opt = build_optimizer([model], Optimizer(implementation="triton"), "cuda", copies_dtype=bf16)
    copied = [p for p in params if p.dim() == 2]
    for p in copied:
        weight_copies.compute_weight(p, bf16)  # made now, current until a torch op bumps the weight's version
    skip = torch.zeros((), device=params[0].device)

    def step():
        take_optimizer_steps([opt], params, global_grad_norm(params), 1.0, skip)

    step()
    torch.cuda.synchronize()
    if sum(c is not None for c in weight_copies.current_copies(params)) != len(copied):
        raise RuntimeError("bench_optimizer --as_trained: the step left a weight copy stale")
    timed = time_step(step, iters)
    grad_bytes = sum(p.numel() * p.grad.element_size() for p in params)
    rows = [dict(row="grad_norm_as_trained", **time_step(lambda: global_grad_norm(params), iters), bytes=grad_bytes)]
    by_dtype = {dtype: [p.grad for p in params if p.grad.dtype == dtype] for dtype in (torch.float32, bf16)}
    float32_sums = sumsq_triton.TableSumOfSquares()
    for block in sumsq_blocks:
        bf16_sums = sumsq_triton.TableSumOfSquares(block=block)

        def norm(bf16_sums=bf16_sums):
            return (float32_sums(by_dtype[torch.float32]) + bf16_sums(by_dtype[bf16])).sqrt()

        # the same norm as the trainer's (another summation order: float32 rounding apart), else the row times nothing
        torch.testing.assert_close(norm(), global_grad_norm(params), rtol=1e-5, atol=0.0)
        rows.append(dict(row=f"grad_norm_as_trained_{block}", **time_step(norm, iters), bytes=grad_bytes))
    moved = 24 * sum(p.numel() for p in params) + grad_bytes + 2 * sum(p.numel() for p in copied)
    n = sum(p.numel() for p in params)
    print("launches as trained (group, gradient dtype: tensors, elements, programs, 16-byte loads):")
    for (index, dtype), tables in opt._tables.groups.items():
        picked = [p for p in opt.param_groups[index]["params"] if p.grad is not None and p.grad.dtype == dtype]
        aligned = tables.aligned and all(p.grad.data_ptr() % 16 == 0 for p in picked)
        elements = int(tables.numel.sum())
        print(f"  group {index}, {dtype}: {len(picked)} tensors, {elements / 1e6:.1f}M elements, "
              f"{tables.n_blocks} programs, aligned {aligned}")  # fmt: skip
    return rows + [
        dict(row="adamw_as_trained", **timed, bytes=moved),
        dict(row="copy_bound_as_trained", ms=copy_bound_ms * moved / (28 * n), bytes=moved),
    ]


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_optimizer.py times GPU kernels: run it on a CUDA machine (bash .gpu/setup.sh first)")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    model, params = model_with_gradients(a.flavor, dev, gen)
    n = sum(p.numel() for p in params)
    opt = build_optimizer([model], Optimizer(implementation="fused"), "cuda")  # torch's ("auto" is ours on CUDA)
    opt_triton = build_optimizer([model], Optimizer(implementation="triton"), "cuda")
    skip = torch.zeros((), device=dev)  # the trainer's flag: 0.0, a finite step

    def step(optimizer=opt):
        take_optimizer_steps([optimizer], params, global_grad_norm(params), 1.0, skip)

    flat = [torch.randn(n, device=dev, generator=gen) * 1e-3 for _ in range(4)]  # parameter, gradient, moments
    flat_step = torch.zeros((), device=dev)

    def flat_adamw():
        flat_step.add_(1)
        torch._fused_adamw_(
            [flat[0]], [flat[1]], [flat[2]], [flat[3]], [], [flat_step], amsgrad=False, lr=1e-4, beta1=0.9,
            beta2=0.95, weight_decay=0.1, eps=1e-8, maximize=False, grad_scale=None, found_inf=None,
        )  # fmt: skip

    # 28 bytes per parameter: 4 float32 reads and 3 writes, as 3 copies reading 3 flat buffers (12 B read + 12 B
    # written per element) plus a read of the fourth (a sum): a bound the step cannot beat.
    def copy_bound():
        flat[2].copy_(flat[0])
        flat[3].copy_(flat[1])
        flat[0].copy_(flat[2])
        flat[1].sum()

    for fn in (step, lambda: step(opt_triton), flat_adamw, copy_bound):  # warm-up: moments allocated, kernels loaded
        fn()
    grads = [p.grad for p in params]
    block0, warps0 = adamw_triton.BLOCK, adamw_triton.WARPS
    torch.cuda.synchronize()
    rows = [
        dict(row="grad_norm", **time_step(lambda: global_grad_norm(params), a.iters)),
        dict(
            row="grad_norm_foreach",
            **time_step(lambda: torch.stack(torch._foreach_norm(grads, 2.0)).square().sum().sqrt(), a.iters),
        ),
        dict(row="adamw_step", **time_step(step, a.iters)),
        dict(row="adamw_step_triton", **time_step(lambda: step(opt_triton), a.iters)),
    ]
    for tile in filter(None, a.adamw_tiles.split(",")):
        block, warps = (int(v) for v in tile.split("x"))
        adamw_triton.BLOCK, adamw_triton.WARPS = block, warps
        opt_triton._tables.groups.clear()  # block maps rebuilt at the next step
        step(opt_triton)
        rows.append(dict(row=f"adamw_step_triton_{tile}", **time_step(lambda: step(opt_triton), a.iters)))
    adamw_triton.BLOCK, adamw_triton.WARPS = block0, warps0
    opt_triton._tables.groups.clear()
    step(opt_triton)
    for tables in opt_triton._tables.groups.values():
        tables.aligned = False  # as if some address or size were not: the kernel's scalar loads (before session 26)
    rows += [
        dict(row="adamw_step_triton_scalar", **time_step(lambda: step(opt_triton), a.iters)),
        dict(row="adamw_flat", **time_step(flat_adamw, a.iters)),
        dict(row="copy_bound", **time_step(copy_bound, a.iters)),
    ]
    if a.as_trained:
        for o in (opt, opt_triton):
            o.state.clear()  # their moments: room for the setting's own optimizer
        flat.clear()
        torch.cuda.empty_cache()
        copy_bound_ms = next(r["ms"] for r in rows if r["row"] == "copy_bound")
        blocks = [int(b) for b in filter(None, a.sumsq_blocks.split(","))]
        rows += as_trained_rows(model, params, a.iters, copy_bound_ms, blocks)
    print(f"{a.flavor}: {n / 1e6:.1f}M parameters in {len(params)} tensors, {torch.cuda.get_device_name()}")
    print("| row | ms per step | host ms per step | GB/s of the bytes moved (28 per parameter; the *_as_trained rows: "
          "their own) |")  # fmt: skip
    print("| --- | --- | --- | --- |")
    for r in rows:
        r["GBps"] = r.get("bytes", 28 * n) / r["ms"] / 1e6
        host = r.get("host_ms")
        r["host_bound"] = host is not None and host >= HOST_BOUND * r["ms"]
        shown = "-" if host is None else f"{host:.3f}" + (" (host-bound: ms is the host's)" if r["host_bound"] else "")
        print(f"| {r['row']} | {r['ms']:.3f} | {shown} | {r['GBps']:.0f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(flavor=a.flavor, params=n, tensors=len(params), rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
