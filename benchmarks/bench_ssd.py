"""Chunked SSD forward + backward: our Triton kernels next to mamba_ssm's, in one run, on one GPU.

    bash .gpu/setup.sh && python3 benchmarks/bench_ssd.py --out $OUT/bench_ssd.json

For each shape (1.3B: batch 4 x 4096, 64 heads; 370M: batch 8 x 2048, 32 heads; both headdim 64,
d_state 128, ngroups 1, chunk 256, bf16), with and without seq_idx (documents), it reports:
  - time of forward + backward (median of triton.testing.do_bench, inputs rotated over 3 sets so the
    50 MB L2 does not hold them) and of the forward alone, for mamba_ssm and for ours, and the ratio;
  - per-stage device time (torch.profiler, kernel names aggregated over 5 iterations), both sides;
  - numerics at a smaller shape: ||out - ref|| / ||ref|| of y, final states and every gradient against the
    float64 PyTorch reference on the same inputs, for both kernels, and our error over mamba_ssm's.
"GPU time" is the sum of the profiled kernel times of one forward + backward: what the step pays when
the host runs ahead (as in training); the do_bench time of an isolated call also contains host gaps.
With --tune 1.3b, first times our kernels under each tile variant in TUNE_VARIANTS (per-kernel times,
and each variant's outputs against the first's), then runs the comparison with the best per kernel group.
Prints the tables last and writes every number to --out (JSON).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import os
import sys
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch
import triton
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from models.kernels.ssd_reference import ssd_chunk_scan_ref
from models.kernels.ssd_triton import autograd as ours_autograd
from models.kernels.ssd_triton import ssd_chunk_scan_triton
from models.kernels.ssd_triton.config import BlockConfig, block_config

SHAPES = {
    "1.3b": dict(b=4, L=4096, H=64, P=64, N=128, G=1, Q=256),
    "370m": dict(b=8, L=2048, H=32, P=64, N=128, G=1, Q=256),
    "small": dict(b=2, L=1000, H=8, P=64, N=128, G=1, Q=256),  # numerics (float64 reference) and smoke
    "small_even": dict(b=2, L=1024, H=8, P=64, N=128, G=1, Q=256),  # numerics of the whole-tile (EVEN) kernels
}


# Tile variants for --tune: overrides of models.kernels.ssd_triton.config.block_config's choice. Each sets several
# kernels at once; the profiler attributes time per kernel, so the best of each kernel group is then combined.
_WARPS = ("cb_warps", "state_warps", "scan_warps", "dx_warps", "dc_warps", "db_warps")
_STAGES = ("cb_stages", "state_stages", "scan_stages", "dx_stages", "dc_stages", "db_stages")
_BIG = dict(scan_m=128, scan_n=128, state_n=128, dx_n=128, dx_k=128, db_k=128, cb_m=128, pass_block=2048)
TUNE_VARIANTS = {
    "base": {},
    "w8": {**{k: 8 for k in _WARPS}, "pass_block": 256},
    "s3": {k: 3 for k in _STAGES},
    "s3_w8": {**{k: 3 for k in _STAGES}, **{k: 8 for k in _WARPS}},
    "big": _BIG,
    "big_w8": {**_BIG, **{k: 8 for k in _WARPS}},
    "small_s3": dict(scan_k=32, state_k=32, dx_m=32, heads_per_prog=4, pass_block=512, **{k: 3 for k in _STAGES}),
    "hpp16_s1": dict(heads_per_prog=16, **{k: 1 for k in _STAGES}),
    "hpp8": dict(heads_per_prog=8),  # heads per dCB / dB program: partial sums over head blocks (bc_finish.py)
    # Wider inner loops / deeper pipelines for every kernel with an inner loop over positions.
    "k64": dict(scan_k=64, dx_m=64),
    "k64_s4": dict(scan_k=64, dx_m=64, **{k: 4 for k in _STAGES}),
    "m128_w8": dict(scan_m=128, dx_k=128, db_k=128, scan_warps=8, dx_warps=8, db_warps=8),
    # After the mask-free inner loops (session 7): fewer registers leave room for wider tiles / more warps.
    "scan_k64": dict(scan_k=64),
    "scan_k64_w8": dict(scan_k=64, scan_warps=8),
    "dx_w8": dict(dx_warps=8),
    "dc_w8": dict(dc_warps=8),
    "dc_s2": dict(dc_stages=2),  # kernel_resources: 4 warps, 3 stages spill 40 bytes in dCB; 2 stages do not
    # Session 9: dx holds only its accumulator through the inner loop (105 registers at 8 warps: 2 programs per SM).
    "dx_w8_dc_w8": dict(dx_warps=8, dc_warps=8),
    "dx_w8_s2": dict(dx_warps=8, dx_stages=2),
    # dx with two heads per program: the group's CBᵀ and B tiles read once for both.
    "dx_h1": dict(dx_heads=1),
    "dx_h2": dict(dx_heads=2),
    "dx_h2_w8": dict(dx_heads=2, dx_warps=8),
    "dx_h2_s2": dict(dx_heads=2, dx_stages=2),
    "scan_h1": dict(scan_heads=1),
    "state_h2": dict(state_heads=2),
    "state_h2_w8": dict(state_heads=2, state_warps=8),
    "scan_h2_w8": dict(scan_heads=2, scan_warps=8),
    "scan_h2_k64": dict(scan_heads=2, scan_k=64),
    "hpp4": dict(heads_per_prog=4),
    "hpp16": dict(heads_per_prog=16),
    "hpp32": dict(heads_per_prog=32),
    "hpp64": dict(heads_per_prog=64),
    "s2": {k: 2 for k in _STAGES},
    # Session 12: the chunk states and the recurrence between chunks chained in one kernel each way (default) or
    # staged in two (chained_states.py), and the chained kernels' tiles.
    "staged": dict(chained=False),
    "chained": dict(chained=True),
    "chained_h2": dict(chained_heads=2, chained_bwd_heads=2),
    "chained_n128": dict(chained_fwd_n=128),
    "chained_bwd_n128": dict(chained_bwd_n=128, chained_bwd_maxnreg=None),  # before session 26: 2 programs per SM
    "chained_bwd_n64": dict(chained_bwd_n=64, chained_bwd_maxnreg=None),
    # N tiles of 64 in the chained dstates at <= 128 registers: four programs per SM instead of two (session 26)
    "chained_bwd_n64_cap": dict(chained_bwd_n=64, chained_bwd_maxnreg=128),
    "chained_s2": dict(chained_stages=2),
    "chained_s4": dict(chained_stages=4),
    "chained_w8": dict(state_warps=8),
    # ... the chunk scan / dx / dCB / dB grids in chunk-major order (launch.program_ids) or not, and dx's order.
    "outer_first": dict(inner_first=False),
    "dx_state_first": dict(dx_state_first=True),
    "dx_state_first_h1": dict(dx_state_first=True, dx_heads=1),
    # Session 14: the chained kernels' [P, N] tiles split over P instead of N (x read once in the forward).
    "chained_p32": dict(state_p=32),
    "chained_p32_n128": dict(state_p=32, chained_fwd_n=128),
    # ... and the forward's entering states kept for the backward (no recompute; more memory; session 15).
    "keep_states": dict(keep_states=True),
    # Session 15: the backward's chain hands dH on as high + low parts (more registers: N tiles of 64 spill none).
    "chained_bwd_n64_keep": dict(chained_bwd_n=64, keep_states=True),
    # bc_finish's programs over blocks of N (dC and dB apart), and their warps.
    "bcf_n128_w8": dict(bcf_n=128, bcf_warps=8),
    "bcf_n64_w8": dict(bcf_n=64, bcf_warps=8),
    "bcf_n32": dict(bcf_n=32),
    "bcf_n128": dict(bcf_n=128),
    # Session 13: register caps, so that three programs fit per SM (with fewer stages where shared memory is short).
    "cap168": dict(dx_maxnreg=168, dc_maxnreg=168, db_maxnreg=168, chained_bwd_maxnreg=168),
    "cap168_s2": dict(
        dx_maxnreg=168, dc_maxnreg=168, db_maxnreg=168, chained_bwd_maxnreg=168, dx_stages=2, dc_stages=2
    ),
    "dx_h1_cap128": dict(dx_heads=1, dx_maxnreg=128),
    "cap128_s2": dict(
        dx_maxnreg=128, dc_maxnreg=128, db_maxnreg=128, chained_bwd_maxnreg=128, dx_stages=2, dc_stages=2
    ),
    # Session 22: dx with one accumulator live (state term first) at higher occupancy (kernel_resources.py: one head
    # 128 registers at 4 warps, 80 at 8; two heads 244 / 202).
    "dx_sf_h1_w8": dict(dx_state_first=True, dx_heads=1, dx_warps=8),
    "dx_sf_h1_s2": dict(dx_state_first=True, dx_heads=1, dx_stages=2),
    "dx_sf_h1_m32": dict(dx_state_first=True, dx_heads=1, dx_m=32),
    "dx_sf_h1_w8_s2": dict(dx_state_first=True, dx_heads=1, dx_warps=8, dx_stages=2),
    "dx_sf_m32": dict(dx_state_first=True, dx_m=32),
    "dx_h1_w8": dict(dx_heads=1, dx_warps=8),
    # ... around the winner (now the default: one head, state first, inner blocks of 32)
    "dx_h2_sf_m64": dict(dx_heads=2, dx_state_first=True, dx_m=64),
    "dx_m16": dict(dx_m=16),
    "dx_s2": dict(dx_stages=2),
    "dx_s4": dict(dx_stages=4),
    "dx_n32": dict(dx_n=32),
    "dx_n128": dict(dx_n=128),
    "dx_k128_w8": dict(dx_k=128, dx_warps=8),
    "scan_h1_k16": dict(scan_heads=1, scan_k=16),
    "scan_k16": dict(scan_k=16),
    # Session 24's dCB variants (per head), pinned to what they measured then (docs/ssd_sessions.md), whatever the
    # defaults now: the heads loop's stages, per-head column sums in one sum (dcb_col_parts 1) or in parts.
    "dcb_heads_s3_per_head": dict(dcb_heads_stages=3, dcb_col_parts=1),
    "dcb_heads_s2_per_head": dict(dcb_heads_stages=2, dcb_col_parts=1),
    "dcb_heads_s4_per_head": dict(dcb_heads_stages=4, dcb_col_parts=1),
    "dcb_per_head": dict(dcb_heads_stages=None, dcb_col_parts=1),
    "dcb_col_parts_1": dict(dcb_col_parts=1),  # per-head column sums reduced across warps (before session 24)
    "dcb_col_parts_2": dict(dcb_col_parts=2, dcb_diag_col_parts=False),
    "dcb_diag_parts": dict(dcb_diag_col_parts=True),  # the default since session 25
    "dcb_no_diag_parts": dict(dcb_diag_col_parts=False),  # session 24's default: the diagonal's sums reduced
    "dx_sums_1d": dict(dx_row_sums_2d=False),  # dx's row sums as 1-D tensors (before session 25)
    # ptxas's registers and the chained dstates' N tiles of 128: the SSD's config before session 26
    "uncapped": dict(dx_maxnreg=None, chained_fwd_maxnreg=None, chained_bwd_n=128, chained_bwd_maxnreg=None),
    "dx_uncapped": dict(dx_maxnreg=None),
    "chained_fwd_uncapped": dict(chained_fwd_maxnreg=None),
    "scan_s2": dict(scan_stages=2),  # the chunk scan's forward in 2 stages (48 KB of shared memory) ...
    "scan_s2_cap": dict(scan_stages=2, scan_maxnreg=128),  # ... and at <= 128 registers: four programs per SM
    "scan_cap": dict(scan_maxnreg=128),
    # Session 57: two heads per dx program capped at 168 registers compile without spills (Triton 3.6; uncapped 206,
    # two programs per SM): three programs per SM, the chunk scan forward's shape (kernel_resources.py).
    "dx_h2_cap168": dict(dx_heads=2, dx_maxnreg=168, keep_states=True),
    "dx_h2_cap168_s2": dict(dx_heads=2, dx_maxnreg=168, dx_stages=2, keep_states=True),
    # ... and the chained forward alone with two heads a program (kept states: 192 registers, 48 bytes of spills at 168)
    "chained_fwd_h2": dict(chained_heads=2, chained_fwd_maxnreg=None, keep_states=True),
    "chained_fwd_h2_cap168": dict(chained_heads=2, chained_fwd_maxnreg=168, keep_states=True),
    # ... and dCB's state term in a launch of its own, the tiles capped at 168 (three programs per SM)
    "dcb_apart": dict(dcb_state_apart=True, keep_states=True),
    "dcb_apart_cap168": dict(dcb_state_apart=True, dc_maxnreg=168, keep_states=True),
    # Session 58: apart is the default (dCB 0.368 -> 0.345 ms at the 1.3B, H100); one launch for comparison
    "dcb_one_launch": dict(dcb_state_apart=False, keep_states=True),
    # ... and the chained forward's pair at 168 is the default: one head a program at 128 for comparison
    "chained_fwd_one_head": dict(chained_heads=1, keep_states=True),
    # Session 60: the staged states (chunk states, then the recurrence; dS_in, then the reverse recurrence) against
    # the chained kernels with kept states, the 1.3B's config (H100, documents: forward 0.220 against 0.153-0.155 ms,
    # backward 0.311 against 0.230-0.261; the chained kernels stay)
    "staged_keep": dict(chained=False, keep_states=True),
    "keep_states_again": dict(keep_states=True),  # the baseline once more, after the variants (order effects)
}
# Kernel groups -> the config fields that only they use.
TUNE_GROUPS = {
    "cb": (("cb_fwd_kernel",), ("cb_",)),
    "state": (
        ("chunk_state_fwd_kernel", "chunk_scan_bwd_dstates_kernel", "chained_states_fwd", "chained_dstates_bwd"),
        ("state_",),
    ),
    "pass": (("state_passing_fwd_kernel", "state_passing_bwd_kernel"), ("pass_",)),
    "scan": (("chunk_scan_fwd_kernel",), ("scan_",)),
    "dx": (("chunk_scan_bwd_dx_kernel",), ("dx_",)),
    "dcdb": (
        (
            "chunk_state_bwd_db_kernel",
            "chunk_scan_bwd_dcb_kernel",
            "*gemm",
            "*xmma",
            "*cutlass",
        ),
        ("dc_", "db_", "heads_per_prog", "dcb_"),
    ),
    "bcf": (("bc_finish_kernel",), ("bcf_",)),
}


def _in_group(kernel_name, names):
    # "*x" matches any kernel whose name contains x (cuBLAS / CUTLASS matmuls of the grouped dB / dC).
    return any(kernel_name.startswith(n) if not n.startswith("*") else n[1:] in kernel_name for n in names)


def make_inputs(shape, with_seq, seed, device="cuda", dtype=torch.bfloat16, with_init=False):
    b, L, H, P, N, G = (shape[k] for k in "bLHPNG")
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*s, scale=1.0, dt=dtype):
        return (torch.randn(*s, generator=g) * scale).to(device, dt)

    # mamba_ssm's initialisation: dt in [1e-3, 1e-1] through softplus(dt + dt_bias), A in -[1, 16].
    dt0 = torch.exp(torch.rand(H, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    inp = dict(
        x=r(b, L, H, P),
        dt=r(b, L, H, scale=0.5),
        A=-torch.empty(H).uniform_(1, 16, generator=g).to(device),
        B=r(b, L, G, N),
        C=r(b, L, G, N),
        D=r(H, dt=torch.float32),
        dt_bias=(dt0 + torch.log(-torch.expm1(-dt0))).to(device),
        initial_states=r(b, H, P, N, dt=torch.float32) if with_init else None,
        seq_idx=None,
    )
    if with_seq:
        # Packed documents of random lengths (mean ~700 tokens), as the data loader makes them.
        lens = torch.randint(64, 1400, (b, 64), generator=g)
        seq = torch.zeros(b, L, dtype=torch.int32)
        for row in range(b):
            starts = torch.cumsum(lens[row], 0)
            for s in starts[starts < L].tolist():
                seq[row, s:] += 1
        inp["seq_idx"] = seq.to(device)
    return inp


def call(fn, inp, Q, return_final=False):
    return fn(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        Q,
        D=inp["D"],
        dt_bias=inp["dt_bias"],
        dt_softplus=True,
        seq_idx=inp["seq_idx"],
        initial_states=inp["initial_states"],
        return_final_states=return_final,
    )


def kernels(our_chunk: int = 0):
    """mamba_ssm's and our entry points; with our_chunk, ours runs at that chunk size whatever the caller's (the
    result does not depend on it beyond rounding; session 14 timed 128 and 64 against the model's 256)."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined  # lazy: optional, its CUDA build

    return {"mamba_ssm": mamba_chunk_scan_combined, "ours": at_chunk(ssd_chunk_scan_triton, our_chunk)}


def at_chunk(fn, chunk: int):
    """fn with its chunk-size argument replaced by ``chunk`` (0: fn itself)."""
    if not chunk:
        return fn

    def with_chunk(x, dt, A, B, C, _chunk_size, **kw):
        return fn(x, dt, A, B, C, chunk, **kw)

    return with_chunk


def fwd_bwd_fn(fn, inp, Q, dy):
    leaves = {
        k: (v.detach().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in inp.items()
    }

    def step():
        for v in leaves.values():
            if isinstance(v, torch.Tensor):
                v.grad = None
        call(fn, leaves, Q).backward(dy)

    def fwd():
        with torch.no_grad():
            call(fn, leaves, Q)

    return step, fwd


def time_shape(name, shape, with_seq, fns, reps_ms):
    sets = [make_inputs(shape, with_seq, seed) for seed in range(3)]
    dy = torch.randn_like(sets[0]["x"])
    out = {}
    for kname, fn in fns.items():
        steps = [fwd_bwd_fn(fn, s, shape["Q"], dy) for s in sets]
        it = {"i": 0}

        def rotate(which):
            i = it["i"] = (it["i"] + 1) % len(steps)
            steps[i][which]()

        t_fb = do_bench(lambda: rotate(0), warmup=100, rep=reps_ms, return_mode="median")
        t_fb2 = do_bench(lambda: rotate(0), warmup=25, rep=reps_ms, return_mode="median")
        t_f = do_bench(lambda: rotate(1), warmup=25, rep=reps_ms, return_mode="median")
        out[kname] = dict(
            fwd_bwd_ms=t_fb,
            fwd_bwd_ms_repeat=t_fb2,
            fwd_ms=t_f,
            stages=stage_times(steps[0][0]),
            ops=op_times(steps[0][0]),
        )
    out["ratio_fwd_bwd"] = out["ours"]["fwd_bwd_ms"] / out["mamba_ssm"]["fwd_bwd_ms"]
    out["ratio_fwd"] = out["ours"]["fwd_ms"] / out["mamba_ssm"]["fwd_ms"]
    return out


def stage_times(step, iters=5):
    """Device time per kernel name (ms per iteration), from the profiler."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = e.self_cuda_time_total
        if t > 0:
            times[e.key[:60]] += t / 1000.0 / iters
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def op_times(step, iters=5):
    """Device time (ms per iteration) and launches per iteration of each PyTorch op that launches kernels itself
    (aten::...: the glue around the Triton kernels), from a profile with CPU ops."""
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    ops = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = e.self_cuda_time_total
        if t > 0 and e.key.startswith("aten::"):
            ops[e.key] = (round(t / 1000.0 / iters, 4), e.count / iters)
    return dict(sorted(ops.items(), key=lambda kv: -kv[1][0]))


def gpu_time(stages):
    return sum(stages.values())


def patched_config(over):
    """Our SSD kernels run with block_config's choice updated by `over` (config fields; also bench_energy.py --set)."""
    ours_autograd.block_config = lambda q, p, n: dataclasses.replace(block_config(q, p, n), **over)


def parse_sets(ap, sets, names=None, flag: str = "--set"):
    """NAME=VALUE pairs (of `flag`) as a dict; a name outside `names` (default: our SSD kernels' config fields) or a
    value that is no Python literal is refused."""
    names = BlockConfig.__dataclass_fields__ if names is None else names
    over = {}
    for item in sets:
        name, _, value = item.partition("=")
        if name not in names:
            ap.error(f"{flag} {item}: {name!r} is none of {', '.join(names)}")
        try:
            over[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            ap.error(f"{flag} {item}: {value!r} is not a Python literal (e.g. True, 64, None)")
    return over


def _outputs_and_grads(fn, inp, Q, dy):
    leaves = {
        k: (v.detach().clone().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in inp.items()
    }
    y = call(fn, leaves, Q)
    y.backward(dy)
    return [y.detach().float()] + [
        v.grad.float() for v in leaves.values() if isinstance(v, torch.Tensor) and v.grad is not None
    ]


def tune(shape_names, variants=None, seq_modes=(False, True), our_chunk=0):
    """Our kernels' per-kernel device times under each tile variant; returns (record, best overrides)."""
    fn = kernels(our_chunk)["ours"]
    record, group_times = {}, defaultdict(lambda: defaultdict(float))
    for sname in shape_names:
        Q = SHAPES[sname]["Q"]
        for with_seq in seq_modes:
            inp = make_inputs(SHAPES[sname], with_seq, seed=0)
            dy = torch.randn_like(inp["x"])
            base_out = None
            for vname, over in TUNE_VARIANTS.items():
                if variants and vname not in variants:
                    continue
                patched_config(over)
                try:
                    step, _ = fwd_bwd_fn(fn, inp, Q, dy)
                    st = stage_times(step, iters=3)
                    outs = _outputs_and_grads(fn, inp, Q, dy)
                except Exception as e:  # e.g. out of shared memory for a tile shape
                    print(f"tune {sname} seq={with_seq} {vname}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                    for grp in TUNE_GROUPS:
                        group_times[grp][vname] += float("inf")
                    continue
                if base_out is None:
                    base_out = outs
                diff = max(((a - b).norm() / b.norm()).item() for a, b in zip(outs, base_out))
                record[f"{sname} seq={with_seq} {vname}"] = dict(stages=st, max_rel_diff_vs_base=diff)
                for grp, (names, _) in TUNE_GROUPS.items():
                    group_times[grp][vname] += sum(v for k, v in st.items() if _in_group(k, names))
                ours = {k: v for k, v in st.items() if "kernel" in k and "at::" not in k}
                print(
                    f"tune {sname} seq={with_seq} {vname:9s} gpu {gpu_time(st):.3f} ms, diff vs base {diff:.1e}: "
                    + ", ".join(f"{k.replace('_kernel', '')} {v:.3f}" for k, v in ours.items()),
                    flush=True,
                )
                if diff > 2e-2:  # a variant must compute the same function; never pick a broken one
                    for grp in TUNE_GROUPS:
                        group_times[grp][vname] += float("inf")
    patched_config({})
    base = block_config(SHAPES[shape_names[0]]["Q"], SHAPES[shape_names[0]]["P"], SHAPES[shape_names[0]]["N"])
    best = {}
    for grp, (_, prefixes) in TUNE_GROUPS.items():
        winner = min(group_times[grp], key=group_times[grp].get)
        full = {**{f: getattr(base, f) for f in base.__dataclass_fields__}, **TUNE_VARIANTS[winner]}
        best.update({f: v for f, v in full.items() if f.startswith(prefixes)})
        print(
            f"tune best {grp}: {winner} ({', '.join(f'{v}={t:.3f}' for v, t in group_times[grp].items())})", flush=True
        )
    record["best_overrides"] = best
    print("tune best overrides:", json.dumps(best), flush=True)
    return record, best


def numerics(fns, shape, with_seq, with_init, seed=7):
    """Relative errors of both kernels against the float64 reference, forward and every gradient."""
    inp = make_inputs(shape, with_seq, seed=seed, with_init=with_init)
    g = torch.Generator(device="cuda").manual_seed(seed - 7)  # seed 7: the cotangents of the first version
    b, L, H, P, N = (shape[k] for k in "bLHPN")
    gy = torch.randn(b, L, H, P, device="cuda", generator=g, dtype=torch.float64)
    gf = torch.randn(b, H, P, N, device="cuda", generator=g, dtype=torch.float64)
    grads, outs = {}, {}
    for kname, fn in list(fns.items()) + [("ref", ssd_chunk_scan_ref)]:
        leaves = {
            k: (
                v.detach().clone().to(torch.float64 if kname == "ref" else v.dtype).requires_grad_()
                if isinstance(v, torch.Tensor) and v.is_floating_point()
                else v
            )
            for k, v in inp.items()
        }
        y, fin = call(fn, leaves, shape["Q"], return_final=True)
        ((y.double() * gy).sum() + (fin.double() * gf).sum()).backward()
        outs[kname] = (y.double(), fin.double())
        grads[kname] = {
            k: v.grad.double() for k, v in leaves.items() if isinstance(v, torch.Tensor) and v.grad is not None
        }

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    res = {}
    for kname in fns:
        e = {"y": rel(outs[kname][0], outs["ref"][0]), "final_states": rel(outs[kname][1], outs["ref"][1])}
        for k, v in grads["ref"].items():
            e["d" + k] = rel(grads[kname][k], v)
        res[kname] = e
    res["ratio_ours_over_mamba"] = {k: res["ours"][k] / max(res["mamba_ssm"][k], 1e-30) for k in res["ours"]}
    return res


def numerics_over_seeds(fns, shape, with_seq, with_init, n_seeds):
    """numerics() for seeds 7 .. 7 + n_seeds - 1, and per output the ratio of the summed errors (ours / mamba_ssm's)
    with the per-seed ratios' range. dA and dD have H entries (8 at the "small" shapes): one draw's ratio of their
    errors scatters (0.46-1.11 over six seeds of one case, docs/ssd_sessions.md, session 14), the sum over draws
    does not."""
    runs = [numerics(fns, shape, with_seq, with_init, seed=7 + i) for i in range(n_seeds)]
    if n_seeds == 1:
        return runs[0]
    res = {k: {o: sum(r[k][o] for r in runs) / n_seeds for o in runs[0][k]} for k in ("ours", "mamba_ssm")}
    res["ratio_ours_over_mamba"] = {o: res["ours"][o] / max(res["mamba_ssm"][o], 1e-30) for o in res["ours"]}
    res["per_seed_ratio_range"] = {
        o: (min(r["ratio_ours_over_mamba"][o] for r in runs), max(r["ratio_ours_over_mamba"][o] for r in runs))
        for o in res["ours"]
    }
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1.3b,370m")
    ap.add_argument("--variants", default="", help="with --tune: only these TUNE_VARIANTS (comma-separated)")
    ap.add_argument("--tune_seq", default="both", choices=("both", "no", "yes"), help="with --tune: seq_idx cases")
    ap.add_argument("--rep_ms", type=int, default=200, help="do_bench repetition time per measurement (ms)")
    ap.add_argument("--skip_numerics", action="store_true")
    ap.add_argument(
        "--numerics",
        default="small:seq:init,small:noseq:noinit,small_even:seq:init",
        help="numerics cases, shape:seq|noseq:init|noinit (small_even: whole tiles, the kernels' mask-free loads); "
        "they run before the timings, and mamba_ssm's autotuning then keeps the small shape's picks (1.3B: 3.36 "
        "instead of 2.67 ms in session 15): time with --skip_numerics, check numerics with --shapes ''",
    )
    ap.add_argument("--our_chunk", type=int, default=0, help="run our kernels at this chunk size (0: the shape's)")
    ap.add_argument(
        "--numerics_seeds",
        type=int,
        default=1,
        help="inputs drawn this many times per numerics case (seeds 7, 8, ...): the ratio of the mean errors, and "
        "the per-seed ratios' range",
    )
    ap.add_argument(
        "--tune",
        default="",
        help="shapes (e.g. 1.3b) to tune our tiles on first (TUNE_VARIANTS); "
        "the comparison then runs the best combination",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="our kernels' config field for the comparison (repeatable; e.g. keep_states=True), over --tune's pick",
    )
    ap.add_argument("--out", default="outputs/bench_ssd.json")
    args = ap.parse_args()
    overrides = parse_sets(ap, args.set)
    if args.numerics_seeds < 1 or args.our_chunk < 0:
        ap.error("--numerics_seeds must be >= 1 and --our_chunk >= 1 (or 0: the shape's chunk size)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    record = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if args.tune:
        seq_modes = {"both": (False, True), "no": (False,), "yes": (True,)}[args.tune_seq]
        record["tune"], best = tune(
            args.tune.split(","), args.variants.split(",") if args.variants else None, seq_modes, args.our_chunk
        )
        overrides = {**best, **overrides}  # the comparison below runs the combined best tiles
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    patched_config(overrides)
    record["config_overrides"] = overrides
    fns = kernels(args.our_chunk)
    record["triton"] = triton.__version__
    lines = []
    if not args.skip_numerics:
        for spec in args.numerics.split(","):
            shape, seq_mode, init_mode = spec.split(":")
            with_seq, with_init = seq_mode == "seq", init_mode == "init"
            key = f"numerics {shape} seq={with_seq} init={with_init}"
            record[key] = r = numerics_over_seeds(fns, SHAPES[shape], with_seq, with_init, args.numerics_seeds)
            over = f" (mean over {args.numerics_seeds} seeds)" if args.numerics_seeds > 1 else ""
            lines.append(f"{key}{over}:")
            for k in r["ours"]:
                spread = r.get("per_seed_ratio_range", {}).get(k)
                lines.append(
                    f"  {k:18s} ours {r['ours'][k]:.2e}  mamba_ssm {r['mamba_ssm'][k]:.2e}  "
                    f"ratio {r['ratio_ours_over_mamba'][k]:.2f}"
                    + (f"  (per seed {spread[0]:.2f}-{spread[1]:.2f})" if spread else "")
                )
            print("\n".join(lines[-len(r["ours"]) - 1 :]), flush=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    for sname in [s for s in args.shapes.split(",") if s]:
        for with_seq in (False, True):
            key = f"{sname} seq_idx={with_seq}"
            record[key] = r = time_shape(sname, SHAPES[sname], with_seq, fns, args.rep_ms)
            m, o = r["mamba_ssm"], r["ours"]
            r["gpu_ms"] = {k: gpu_time(r[k]["stages"]) for k in ("mamba_ssm", "ours")}
            r["ratio_gpu"] = r["gpu_ms"]["ours"] / r["gpu_ms"]["mamba_ssm"]
            lines.append(
                f"{key:22s} fwd+bwd mamba_ssm {m['fwd_bwd_ms']:.3f} ({m['fwd_bwd_ms_repeat']:.3f}) ms  ours "
                f"{o['fwd_bwd_ms']:.3f} ({o['fwd_bwd_ms_repeat']:.3f}) ms  ratio {r['ratio_fwd_bwd']:.2f} | fwd "
                f"mamba_ssm {m['fwd_ms']:.3f}  ours {o['fwd_ms']:.3f}  ratio {r['ratio_fwd']:.2f} | GPU time fwd+bwd "
                f"mamba_ssm {r['gpu_ms']['mamba_ssm']:.3f}  ours {r['gpu_ms']['ours']:.3f}  ratio {r['ratio_gpu']:.2f}"
            )
            print(lines[-1], flush=True)
            for kname in ("mamba_ssm", "ours"):
                top = list(r[kname]["stages"].items())[:20]
                print(f"  stages {kname}: " + ", ".join(f"{k} {v:.3f}" for k, v in top), flush=True)
                glue = list(r[kname]["ops"].items())[:16]
                print(f"  aten ops {kname} (ms, launches): " + ", ".join(f"{k} {v[0]:.3f} x{v[1]:g}" for k, v in glue))
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
