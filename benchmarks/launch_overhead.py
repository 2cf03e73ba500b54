"""Host time of one Triton kernel launch: `kernel[grid](...)` against `fast_launch(kernel)[grid](...)`
(models/kernels/fast_launch.py), with 2 and with 40 arguments (our SSD kernels take 20-60), and a torch op for scale.

    bash .gpu/setup.sh && python3 benchmarks/launch_overhead.py [--iters 2000] [--out launch.json]
    python3 benchmarks/launch_overhead.py --iters 20     # CPU smoke run: Triton's interpreter, where every launch
                                                         # takes Triton's path (the figures mean nothing there)

The kernels do almost nothing (one program, 128 elements), so the time per launch is the host's; the GPU is
synchronised only before and after each timed loop. A step that launches ~770 of our kernels (the 370M) spends
launches x this figure of host time on them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before the kernels are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models.kernels.fast_launch import fast_launch  # noqa: E402


@triton.jit
def _two_args(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)


# fmt: off
@triton.jit
def _forty_args(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9,
                i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, i14, i15, i16, i17, i18, i19,
                i20, i21, i22, i23, i24, i25, i26, i27, i28, i29,
                BLOCK: tl.constexpr, FLAG: tl.constexpr, MODE: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(a0 + i, tl.load(a1 + i, mask=i < i0), mask=i < i0)
# fmt: on


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=2000, help="timed launches per row (after 50 untimed)")
    ap.add_argument("--out", default="", help="also write the rows as JSON here")
    return ap.parse_args(argv)


def _us_per_call(fn, iters: int, sync) -> float:
    for _ in range(min(50, iters)):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = time.perf_counter() - t0
    sync()
    return elapsed / iters * 1e6


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    x = torch.zeros(256, device=device)
    tensors = [torch.zeros(256, device=device, dtype=torch.bfloat16) for _ in range(10)]
    ints = [128, 64, 128, 1, 2, 256, 8192, 33, 17, 4096] * 3
    fast_two, fast_forty = fast_launch(_two_args), fast_launch(_forty_args)
    cases = {
        "kernel[grid], 2 arguments": lambda: _two_args[(1,)](x, 100, BLOCK=128),
        "fast_launch, 2 arguments": lambda: fast_two[(1,)](x, 100, BLOCK=128),
        "kernel[grid], 40 arguments": lambda: _forty_args[(1,)](*tensors, *ints, BLOCK=128, FLAG=True, MODE=2),
        "fast_launch, 40 arguments": lambda: fast_forty[(1,)](*tensors, *ints, BLOCK=128, FLAG=True, MODE=2),
        "torch.add of two tensors (scale)": lambda: torch.add(x, x),
    }
    rows = [dict(launch=name, host_us=_us_per_call(fn, a.iters, sync)) for name, fn in cases.items()]
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU, Triton's interpreter (smoke run)"
    print(f"{where}, triton {triton.__version__}, torch {torch.__version__}, {a.iters} launches per row")
    print(f"fast_launch active: {fast_forty.enabled}\n\n| launch | host us per launch |\n| --- | --- |")
    for r in rows:
        print(f"| {r['launch']} | {r['host_us']:.1f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=where, triton=triton.__version__, torch=torch.__version__, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
