"""Time, power and energy per call of a training step's kernel families, each alone under sustained load.

At the 1.3B shape the step runs at the GPU's power limit (docs/ssd_sessions.md, sessions 25, 34 and 37): its time is
its energy over the limit, so a kernel costs its joules, not its milliseconds. Each family below runs alone in a loop
for --seconds after a warm-up (the clock settles as it would under a long run); NVML's energy counter over the
window gives the mean power, and with the CUDA-event time per call, the energy per call. Multiplied by how often a
step calls it (step_calls), the families add up to the step's energy; that sum over the power limit is the step
time the families imply, next to the sum of their times.

    bash .gpu/setup.sh && python3 benchmarks/bench_energy.py [--size 1.3b] [--seconds 1.5] [--out r.json]

Families (the fused mixer's kernels as train.py runs them on CUDA; bf16; packed documents):
  in_proj_fwd / _dgrad / _wgrad, out_proj_fwd / _dgrad / _wgrad   the block's products (weight gradients in float32)
  ssd_fwd_bwd      our SSD forward + backward (models/kernels/ssd_triton), the size's ssd_keep_states
  conv_fwd         our conv forward with documents: twice per layer (the forward and the backward's recompute)
  conv_bwd         its backward
  gated_norm_fwd / _bwd   the gated RMSNorm (its backward recomputes out_proj's input)
  add_rmsnorm_fwd_bwd     residual add + RMSNorm forward and backward (every block and the final norm)
  lm_head_loss     lm_head + the fused cross-entropy, forward and backward
  optimizer        the gradient norm and our AdamW over the flavor's parameters
and references that are not part of the step: mamba_ssm's SSD forward + backward at the same inputs (when
installed), copy (1 GiB read and written by an element-wise kernel: HBM at full speed) and idle.

--variant (repeatable) measures our SSD's forward + backward under config variants instead, in one process: a
baseline first, then the variants with a baseline after every second one and at the end; each variant's mJ per
call against the mean of the baselines on either side of it, and its outputs and gradients against the baseline's
(a variant that computes something else is marked, its energy meaningless). The SSD's tiles were chosen in
milliseconds on an H100 (sessions 9-26); at the power limit they cost their joules, which this ranks:

    python3 benchmarks/bench_energy.py --size 1.3b --seconds 3 --variant dcb_col_parts=2 --variant bcf_n=64,bcf_warps=8

--ssd_stages splits our SSD's forward + backward by kernel instead: the whole is measured with one kernel launched
twice at each of its calls, in turn, and that kernel's ms and mJ per launch are the excess over the whole measured
alone (the mean of baselines taken between them). The chained kernels cannot run twice in a row (NOT_DOUBLED): what
they and torch's own small ops cost is the rest, the whole minus the kernels measured. Every family runs
as CUDA-graph replays of 5 calls where it can be captured (graphed): the host's Python then costs nothing, as in a
step whose host runs ahead of the GPU (an eagerly launched family whose host is the slower side would count idle
time as its own).
Needs NVML (`pynvml`, from nvidia-ml-py, which the GPU machines have).
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

import torch  # noqa: E402

from benchmarks.compare_sides import SIZES  # noqa: E402
from benchmarks.energy_ssd import print_variants, ssd_stages, ssd_variants  # noqa: E402
from models import build_model_args  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1.3b", help=f"one of {', '.join(SIZES)} (compare_mamba_ssm.py's batch)")
    ap.add_argument("--seconds", type=float, default=1.5, help="measured window per family, after a 1 s warm-up")
    ap.add_argument("--families", default="", help="comma-separated subset of the families (default: all)")
    ap.add_argument("--ssd_stages", action="store_true", help="our SSD forward + backward kernel by kernel instead")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="our SSD kernels' config field, as bench_ssd.py's --set (repeatable; e.g. overlap_dcb=True)",
    )
    ap.add_argument(
        "--conv",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="one of our conv's module settings (bench_conv.TUNED; repeatable; e.g. _FWD_ONE_DOC_BRANCH=True)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="FIELD=VALUE[,FIELD=VALUE...]",
        help="our SSD under this config variant (on top of --set), between baselines (repeatable; module docstring)",
    )
    ap.add_argument("--out", default="", help="write the rows and totals as JSON here")
    a = ap.parse_args(argv)
    from benchmarks.bench_conv import TUNED
    from benchmarks.bench_ssd import parse_sets

    a.config_overrides = parse_sets(ap, a.set)
    a.conv_settings = parse_sets(ap, a.conv, TUNED, "--conv")
    a.variants = [parse_sets(ap, [f for f in v.split(",") if f], flag="--variant") for v in a.variant]
    if a.variants and (a.ssd_stages or a.families):
        ap.error("--variant measures our SSD alone, variant by variant: leave --families and --ssd_stages out")
    if any(not v for v in a.variants):
        ap.error("--variant needs at least one FIELD=VALUE")
    if a.size not in SIZES:
        ap.error(f"unknown --size {a.size!r}; choose from {list(SIZES)}")
    if a.ssd_stages and a.families:
        ap.error("--ssd_stages measures the SSD kernel by kernel: leave --families out")
    return a


def step_calls(n_layers: int) -> dict[str, int]:
    """How many times one training step calls each family (one Mamba-2 block per layer, the fused loss)."""
    per_layer = dict(
        in_proj_fwd=1, in_proj_dgrad=1, in_proj_wgrad=1, out_proj_fwd=1, out_proj_dgrad=1, out_proj_wgrad=1,
        ssd_fwd_bwd=1, conv_fwd=2, conv_bwd=1, gated_norm_fwd=1, gated_norm_bwd=1, add_rmsnorm_fwd_bwd=1,
    )  # fmt: skip
    calls = {name: n * n_layers for name, n in per_layer.items()}
    calls["add_rmsnorm_fwd_bwd"] += 1  # the final norm
    calls.update(lm_head_loss=1, optimizer=1)
    return calls


def step_totals(rows: list[dict], calls: dict[str, int], power_limit_w: float) -> dict:
    """The step's energy by family (J) from the rows' mJ per call, its sum, and the step time it implies at the
    power limit, next to the sum of the families' times (ms)."""
    by_family = {r["family"]: r["mj_per_call"] * calls[r["family"]] / 1e3 for r in rows if r["family"] in calls}
    ms_sum = sum(r["ms"] * calls[r["family"]] for r in rows if r["family"] in calls)
    joules = sum(by_family.values())
    return dict(
        joules_by_family=by_family,
        joules=joules,
        ms_at_power_limit=1e3 * joules / power_limit_w,
        ms_sum=ms_sum,
        power_limit_w=power_limit_w,
        missing=sorted(set(calls) - set(by_family)),
    )


def families(size_name: str, device: torch.device) -> dict:
    """name -> a zero-argument callable running that family once at the size's shapes (the optimizer None off CUDA:
    our AdamW is a CUDA kernel; the rest also runs on the CPU under TRITON_INTERPRET=1, which the tests use)."""
    from benchmarks.bench_conv import documents
    from benchmarks.bench_ssd import fwd_bwd_fn
    from models.kernels.add_rmsnorm_triton import add_rmsnorm_triton
    from models.kernels.autocast_linear import mm_float32
    from models.kernels.conv_triton import conv_backward_triton, conv_forward_triton
    from models.kernels.cross_entropy_triton import linear_cross_entropy_triton
    from models.kernels.gated_rmsnorm_triton import gated_rmsnorm_bwd, gated_rmsnorm_fwd
    from models.loss import IGNORE_INDEX

    size = SIZES[size_name]
    args = model_args(size_name)
    b, L = size.batch, size.seq_len
    T, D, DI, N, G, P = b * L, args.d_model, args.d_inner, args.d_state, args.ngroups, args.headdim
    H = DI // P
    conv_dim, F = DI + 2 * G * N, 2 * DI + 2 * G * N + H
    V = -(-args.vocab_size // args.pad_vocab_size_multiple) * args.pad_vocab_size_multiple
    gen = torch.Generator().manual_seed(0)
    bf = torch.bfloat16

    def randn(*shape, scale=1.0, dtype=bf):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    x, w_in, dzx = randn(T, D), randn(F, D, scale=0.02), randn(T, F)
    h, w_out, dout = randn(T, DI), randn(D, DI, scale=0.02), randn(T, D)
    zx = randn(b, L, F)
    xBC = zx[..., DI : DI + conv_dim].transpose(1, 2)  # the mixer's view: channels contiguous
    conv_w, conv_b = randn(conv_dim, args.d_conv, scale=0.3, dtype=torch.float32), randn(conv_dim, scale=0.1)
    seq = documents(b, L, gen).to(device)
    dxBC = randn(b, L, conv_dim).transpose(1, 2)
    dxBC_in = torch.empty(b, L, conv_dim, device=device, dtype=bf).transpose(1, 2)
    y, z, dh = randn(T, DI), randn(T, DI), randn(T, DI)
    norm_w = torch.ones(DI, device=device)
    _, rstd = gated_rmsnorm_fwd(y, norm_w, z, args.norm_eps, DI // G, args.norm_before_gate)
    dz = torch.empty_like(z)
    ssd = ssd_problem(size_name, device)
    ssd_inp = ssd["inp"]
    ssd_step, _ = fwd_bwd_fn(ssd["fn"], ssd_inp, ssd["Q"], ssd["dy"])
    hidden = randn(b, L, D).requires_grad_()
    residual = randn(b, L, D, dtype=torch.float32).requires_grad_()
    add_w = torch.ones(D, device=device, requires_grad=True)
    head_h = randn(T, D).requires_grad_()
    head_w = randn(V, D, scale=0.02, dtype=torch.float32).requires_grad_()
    labels = torch.randint(0, V, (T,), generator=gen).to(device)

    # torch.autograd.grad, not backward: gradients returned, not accumulated into .grad by kernels of their own.
    def add_rmsnorm():
        normed, res = add_rmsnorm_triton(hidden, residual, add_w, args.norm_eps, True)
        torch.autograd.grad((normed, res), (hidden, residual, add_w), (dout.view(b, L, D), residual.detach()))

    def lm_head_loss():  # compare_mamba_ssm.py's --training.loss_chunk_tokens 8192
        with torch.autocast("cuda", dtype=bf):
            loss = linear_cross_entropy_triton(head_h, head_w, labels, 8192, IGNORE_INDEX)
        torch.autograd.grad(loss, (head_h, head_w))

    references = {}
    try:  # mamba_ssm's SSD, a reference (not in our step): its fwd + bwd at the same inputs
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

        references["ssd_fwd_bwd_mamba_ssm"], _ = fwd_bwd_fn(
            mamba_chunk_scan_combined, ssd_inp, args.chunk_size, randn(b, L, H, P)
        )
    except ImportError:
        pass
    big = torch.empty(2**28 if device.type == "cuda" else 2**16, device=device)  # 1 GiB of float32 on the GPU
    big_out = torch.empty_like(big)
    return dict(
        in_proj_fwd=lambda: x @ w_in.t(),
        in_proj_dgrad=lambda: dzx @ w_in,
        in_proj_wgrad=lambda: mm_float32(dzx.t(), x),
        out_proj_fwd=lambda: h @ w_out.t(),
        out_proj_dgrad=lambda: dout @ w_out,
        out_proj_wgrad=lambda: mm_float32(dout.t(), h),
        ssd_fwd_bwd=ssd_step,
        conv_fwd=lambda: conv_forward_triton(xBC, conv_w, conv_b, seq, True),
        conv_bwd=lambda: conv_backward_triton(xBC, conv_w, conv_b, dxBC, seq, True, dxBC_in),
        gated_norm_fwd=lambda: gated_rmsnorm_fwd(y, norm_w, z, args.norm_eps, DI // G, args.norm_before_gate),
        gated_norm_bwd=lambda: gated_rmsnorm_bwd(
            dh, y, norm_w, z, rstd, args.norm_eps, DI // G, args.norm_before_gate, dz, True
        ),
        add_rmsnorm_fwd_bwd=add_rmsnorm,
        lm_head_loss=lm_head_loss,
        optimizer=_optimizer_step(size.flavor, device) if device.type == "cuda" else None,
        **references,
        copy=lambda: torch.mul(big, 1.0, out=big_out),  # a kernel: a graph would turn copy_ into a copy-engine node
    )


def ssd_problem(size_name: str, device: torch.device) -> dict:
    """Our SSD as the size's training step calls it: fn (ssd_chunk_scan_triton with the size's ssd_keep_states),
    inp (bench_ssd.make_inputs: bf16, packed documents), the chunk size Q and the output's cotangent dy."""
    from benchmarks.bench_ssd import make_inputs
    from models.kernels.ssd_triton import ssd_chunk_scan_triton

    size, args = SIZES[size_name], model_args(size_name)
    b, L, P, N, G = size.batch, size.seq_len, args.headdim, args.d_state, args.ngroups
    H = args.d_inner // P
    dy = (torch.randn(b, L, H, P, generator=torch.Generator().manual_seed(1))).to(device, torch.bfloat16)
    return dict(
        fn=lambda *a, **k: ssd_chunk_scan_triton(*a, keep_states=args.ssd_keep_states, **k),
        inp=make_inputs(dict(b=b, L=L, H=H, P=P, N=N, G=G), True, 0, device=device),
        Q=args.chunk_size,
        dy=dy,
    )


def model_args(size_name: str):
    """The size's ModelArgs as train.py builds them: its TOML's flavor with the [model] overrides (ssd_keep_states)."""
    from configs.parser import load_config

    cfg = load_config(["--job.config_file", os.path.join(REPO, SIZES[size_name].config)])
    return build_model_args(cfg.model.flavor, cfg.model_overrides)


def _optimizer_step(flavor: str, device: torch.device):
    """The trainer's optimizer phase on the flavor's parameters (random gradients): gradient norm + our AdamW. The
    parameters, gradients and moments (~23 GiB at 1.3B) are made at the first call, so only a run that measures this
    family allocates them."""
    from benchmarks.bench_optimizer import model_with_gradients
    from components.optimizer import build_optimizer, take_optimizer_steps
    from configs.job_config import Optimizer
    from parallelisms.grad_norm import global_grad_norm

    built = []

    def step():
        if not built:
            model, params = model_with_gradients(flavor, device, torch.Generator(device=device).manual_seed(0))
            opt = build_optimizer([model], Optimizer(implementation="auto"), "cuda")
            built.append((opt, params, torch.zeros((), device=device)))  # the trainer's skip flag: a finite step
        opt, params, skip = built[0]
        take_optimizer_steps([opt], params, global_grad_norm(params), 1.0, skip)

    return step


class _Nvml:
    def __init__(self):
        try:
            import pynvml
        except ImportError as e:
            raise SystemExit("bench_energy.py reads NVML's energy counter: pip install nvidia-ml-py") from e
        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())

    def energy_mj(self) -> int:
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)

    def sm_clock(self) -> int:
        return self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM)

    def power_limit_w(self) -> float:
        return self.nvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1e3

    def power_w(self) -> float:
        """The board's power draw as NVML reports it (on Hopper an average over its own short window)."""
        return self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3

    def clock_event_reasons(self) -> int:
        """Why the clocks are below their maximum now, as NVML's bitmask (step_energy.CLOCK_EVENT_BITS); newer
        NVMLs call these clock events, older ones throttle reasons."""
        read = getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        read = read or self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(read(self.handle))


def graphed(fn, calls: int):
    """`calls` calls of fn captured in one CUDA graph: (replay, True), or (a plain loop, False) where fn cannot be
    captured. Replays launch nothing from the host, so a family whose Python costs more than its kernels (autograd,
    many small launches) is measured by its GPU work, as in a step where the host runs ahead of the GPU."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # allocations and lazy initialisation outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    except Exception:  # e.g. a host sync inside fn
        torch.cuda.synchronize()

        def loop():
            for _ in range(calls):
                fn()

        return loop, False
    return graph.replay, True


def measure(fn, nvml: _Nvml, seconds: float, warmup: float = 1.0, batch: int = 5) -> dict:
    """fn under sustained load, `batch` calls per CUDA-graph replay (graphed): ms per call (CUDA events), mean W
    (energy counter / wall time), mJ per call, the median SM clock sampled between replays."""
    run, in_graph = graphed(fn, batch)
    end = time.time() + warmup
    while time.time() < end:
        run()
        torch.cuda.synchronize()
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, clocks = 0, []
    torch.cuda.synchronize()
    t0, e0 = time.time(), nvml.energy_mj()
    start_ev.record()
    while time.time() < t0 + seconds:
        run()
        calls += batch
        clocks.append(nvml.sm_clock())
    end_ev.record()
    torch.cuda.synchronize()
    t1, e1 = time.time(), nvml.energy_mj()
    ms = start_ev.elapsed_time(end_ev) / calls
    watts = (e1 - e0) / (t1 - t0) / 1e3
    return dict(
        ms=ms, watts=watts, mj_per_call=watts * ms, sm_clock_mhz=sorted(clocks)[len(clocks) // 2], graph=in_graph
    )


def idle_power(nvml: _Nvml, seconds: float) -> float:
    torch.cuda.synchronize()
    time.sleep(1.0)
    t0, e0 = time.time(), nvml.energy_mj()
    time.sleep(seconds)
    return (nvml.energy_mj() - e0) / (time.time() - t0) / 1e3


def main(argv=None) -> dict:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_energy.py measures GPU power: run it on a CUDA machine (bash .gpu/setup.sh first)")
    nvml = _Nvml()
    device = torch.device("cuda")
    if a.config_overrides:
        from benchmarks.bench_ssd import patched_config

        patched_config(a.config_overrides)
        print(f"our SSD kernels' config overrides: {a.config_overrides}", flush=True)
    if a.conv_settings:
        from models.kernels import conv_triton

        for name, value in a.conv_settings.items():
            setattr(conv_triton, name, value)
        print(f"our conv's settings: {a.conv_settings}", flush=True)
    size = SIZES[a.size]
    if a.variants:
        shape = f"size {a.size} ({size.batch} x {size.seq_len})"
        print(f"{torch.cuda.get_device_name()}, power limit {nvml.power_limit_w():.0f} W, our SSD forward + backward "
              f"at {shape}, {len(a.variants)} variants", flush=True)  # fmt: skip
        problem = ssd_problem(a.size, device)
        rows = ssd_variants(problem, a.variants, a.config_overrides, lambda step: measure(step, nvml, a.seconds))
        print_variants(rows)
        result = dict(device=torch.cuda.get_device_name(), size=a.size, base=a.config_overrides, variants=rows)
        return _written(result, a.out)
    fams = families(a.size, device)
    wanted = [f for f in a.families.split(",") if f] or list(fams)
    unknown = sorted(set(wanted) - set(fams))
    if unknown:
        raise SystemExit(f"unknown --families {unknown}; choose from {list(fams)}")
    if a.ssd_stages:
        print(f"{torch.cuda.get_device_name()}, power limit {nvml.power_limit_w():.0f} W, our SSD forward + backward "
              f"at size {a.size} ({size.batch} x {size.seq_len}), kernel by kernel", flush=True)  # fmt: skip
        rows = ssd_stages(fams["ssd_fwd_bwd"], lambda step: measure(step, nvml, a.seconds))
        for r in rows:
            print(f"{r['kernel']:40s} x{r['launches']}  {r['ms']:7.4f} ms {r['mj']:8.1f} mJ {r['watts']:6.0f} W")
        print(f"(baselines' spread: {rows[-1]['mj_spread']:.1f} mJ)")
        return _written(dict(device=torch.cuda.get_device_name(), size=a.size, ssd_stages=rows), a.out)
    for name in wanted:  # compiled and autotuned before anything is measured
        fams[name]()
    calls = step_calls(model_args(a.size).n_layers)
    print(f"{torch.cuda.get_device_name()}, power limit {nvml.power_limit_w():.0f} W, size {a.size} "
          f"({size.batch} x {size.seq_len})", flush=True)  # fmt: skip
    print(f"idle: {idle_power(nvml, a.seconds):.1f} W", flush=True)
    rows = []
    for name in wanted:
        row = dict(family=name, **measure(fams[name], nvml, a.seconds), calls_per_step=calls.get(name, 0))
        rows.append(row)
        print(f"{name:20s} {row['ms']:8.3f} ms {row['watts']:6.1f} W {row['mj_per_call']:8.1f} mJ/call "
              f"SM {row['sm_clock_mhz']} MHz  x{row['calls_per_step']}/step"
              + ("" if row["graph"] else "  (eager: not capturable)"), flush=True)  # fmt: skip
    totals = step_totals(rows, calls, nvml.power_limit_w())
    print(f"step: {totals['joules']:.1f} J -> {totals['ms_at_power_limit']:.1f} ms at {totals['power_limit_w']:.0f} W; "
          f"sum of the families' times {totals['ms_sum']:.1f} ms" + (f"; not measured: {totals['missing']}"
          if totals["missing"] else ""))  # fmt: skip
    for name, j in sorted(totals["joules_by_family"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:20s} {j:7.2f} J ({100 * j / totals['joules']:4.1f}%)")
    return _written(dict(device=torch.cuda.get_device_name(), size=a.size, rows=rows, totals=totals), a.out)


def _written(result: dict, path: str) -> dict:
    """result, also written to `path` as JSON when one is given (--out)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
