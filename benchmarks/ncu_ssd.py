"""One forward + backward of our Triton SSD at a benchmark shape, inside cudaProfilerStart / Stop, for Nsight Compute.

After two untimed passes (Triton compiles and the allocator warms up), exactly one pass is bracketed, so ncu
with ``--profile-from-start off`` sees each of our kernels once per call site:

    bash .gpu/setup.sh && /usr/local/cuda/bin/ncu --profile-from-start off \\
        --kernel-name regex:"chunk_scan|chained|dcb|chunk_state" \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \\
        --section SchedulerStats --section LaunchStats python3 benchmarks/ncu_ssd.py --shape 1.3b > ncu.txt

(ncu locks the SM clock, so its durations are longer than bench_ssd.py's; read the ratios, occupancy, L2 hit rates
and stall figures, docs/ssd_sessions.md "Session 12".) --keep_states runs the configs' path (the chained forward once,
no recompute in the backward); the gate the configs fuse into the chunk scan (fuse_gate_into_scan) is not on this
entry point, so the chunk scan profiled here is the ungated one (~26% fewer instructions, docs/ssd_sessions.md
"Session 72").
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def profiled_function(keep_states: bool):
    """Our SSD entry point as the profiled pass calls it (bench_ssd.call's signature), with keep_states bound."""
    from models.kernels.ssd_triton import ssd_chunk_scan_triton

    return functools.partial(ssd_chunk_scan_triton, keep_states=keep_states)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1.3b", help="a bench_ssd.py shape: 1.3b, 370m, small, small_even")
    ap.add_argument("--seq", action="store_true", help="with seq_idx (packed documents)")
    ap.add_argument(
        "--keep_states",
        action="store_true",
        help="the forward's entering states kept for the backward, as the 1.3B and 370M configs run it "
        "(model.ssd_keep_states): the chained forward then runs once, the backward recomputes only CB",
    )
    args = ap.parse_args(argv)
    from benchmarks.bench_ssd import SHAPES, call, make_inputs

    if args.shape not in SHAPES:
        sys.exit(f"--shape {args.shape!r}: expected one of {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        sys.exit("ncu_ssd.py profiles the Triton kernels on a GPU: no CUDA device here (run it on the GPU machine).")
    ours = profiled_function(args.keep_states)
    shape = SHAPES[args.shape]
    inp = make_inputs(shape, args.seq, seed=0)
    leaves = {
        k: (v.detach().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in inp.items()
    }
    dy = torch.randn_like(inp["x"])
    for _ in range(2):
        call(ours, leaves, shape["Q"]).backward(dy)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call(ours, leaves, shape["Q"]).backward(dy)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled one forward + backward at {args.shape} (seq_idx {args.seq}, keep_states {args.keep_states})")


if __name__ == "__main__":
    main()
