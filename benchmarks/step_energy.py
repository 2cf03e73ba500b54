"""A whole training step's time, energy and mean power in situ, ours or mamba-ssm's loop, optionally with extra
low-power work put into every step: does that work cost the step its time or only its joules?

    bash .gpu/setup.sh && python3 benchmarks/step_energy.py --side ours [--size 1.3b] [--extra copy4]
    bash .gpu/setup.sh && python3 benchmarks/step_energy.py --side theirs
    python3 benchmarks/step_energy.py --side ours --size debug --warmup 1 --steps 2      # CPU smoke run: times only

Each side runs as compare_mamba_ssm.py runs it (ours: train.py in this process with its overrides for the size;
theirs: its worker's loop). Once a step, where the gradient norm is taken (ours: train.global_grad_norm; theirs:
clip_grad_norm_), the host reads a clock and NVML's energy counter; over the timed steps the differences give ms,
J and W per step. Our host runs up to a step ahead of the GPU: a constant lag, which the differences cancel.
--extra puts work on the stream at that point in every step:
  sleep<ms>  one thread spinning for <ms> at the idle SM clock (torch.cuda._sleep): ~idle power
  copy<n>    n element-wise copies of 1 GiB (HBM-bound, below the power limit on an H100)
Session 49 (docs/ssd_sessions.md) found on an H100 that four copies added their time (3.0 ms against 2.85 ms alone)
and not their joules (1.5 ms at 700 W): a phase below the power limit costs the step its time.
A thread also reads the GPU's SM clock, power draw and clock-event reasons every --sample_ms: over the timed steps
their median SM clock and draw and the share of samples the power cap (or a thermal limit) was holding the clock down.
Session 34 read the 1.3B's SM clocks ~13% lower in our step than in their loop's: run each side on the same card
(`for side in theirs ours theirs ours; do python3 benchmarks/step_energy.py --side $side; done`) to see how much of
each step the cap governs there, and whether the card-to-card spread of the pair (docs/performance.md, item 4's
machine table) follows the clock.
Prints one line "STEP_ENERGY {json}" (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from benchmarks.bench_energy import _written  # noqa: E402
from benchmarks.compare_sides import SIZES, ours_command, read_jsonl, summarize_ours, theirs_worker  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", choices=("ours", "theirs"), required=True)
    ap.add_argument("--size", default="1.3b", help=f"one of {', '.join(SIZES)} (compare_mamba_ssm.py's batch)")
    ap.add_argument("--extra", default="none", help="none, sleep<ms> or copy<n> (module docstring)")
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=12, help="timed steps")
    ap.add_argument("--dump_folder", default="/tmp/step_energy", help="ours: train.py's dump folder (replaced)")
    ap.add_argument("--out", default="", help="also write the result as JSON here")
    ap.add_argument(
        "--sample_ms",
        type=float,
        default=50.0,
        help="read the SM clock, power and clock-event reasons this often (CUDA only; 0: not at all)",
    )
    a = ap.parse_args(argv)
    if a.sample_ms < 0:
        ap.error(f"--sample_ms must be >= 0 (0 turns the sampling off), got {a.sample_ms}")
    if a.size not in SIZES:
        ap.error(f"unknown --size {a.size!r}; choose from {list(SIZES)}")
    if a.warmup < 1 or a.steps < 1:
        ap.error("--warmup and --steps must be >= 1 (the first step compiles kernels)")
    try:
        parse_extra(a.extra)
    except ValueError as e:
        ap.error(str(e))
    if a.side == "theirs" and a.size == "debug":
        ap.error("their loop has no debug size: use 370m or 1.3b")
    return a


def parse_extra(extra: str) -> tuple[str, float]:
    """'none' -> ('none', 0); 'sleep3' -> ('sleep', 3.0) ms; 'copy4' -> ('copy', 4) GiB copies."""
    for kind in ("sleep", "copy"):
        if extra.startswith(kind):
            try:
                amount = float(extra[len(kind) :])
            except ValueError:
                break
            if amount > 0 and (kind == "sleep" or amount == int(amount)):
                return kind, amount
            break
    if extra == "none":
        return "none", 0.0
    raise ValueError(f"--extra must be none, sleep<ms> (e.g. sleep3) or copy<n> (e.g. copy4), got {extra!r}")


def per_step(marks: list[tuple[float, float | None]], warmup: int) -> dict:
    """Marks (host seconds, energy in mJ or None), one per step taken at the same point of every step: mark k
    (0-based) falls in step k + 1. Over the timed steps warmup + 1 ... (the marks from the last warm-up step's to the
    last step's): ms and J per step and the mean W (None without energy readings)."""
    if len(marks) <= warmup:
        raise ValueError(f"{len(marks)} marks for {warmup} warm-up steps: no timed step was marked")
    (t0, e0), (t1, e1) = marks[warmup - 1], marks[-1]
    n = len(marks) - warmup
    joules = None if e0 is None or e1 is None else (e1 - e0) / 1e3
    return dict(
        timed_steps=n,
        ms_per_step=1e3 * (t1 - t0) / n,
        joules_per_step=None if joules is None else joules / n,
        watts=None if joules is None else joules / (t1 - t0),
    )


def gpu_nvml():
    """NVML's handle on this process's GPU (bench_energy._Nvml: the energy counter, the clocks, the power draw), or
    None without CUDA."""
    if not torch.cuda.is_available():
        return None
    from benchmarks.bench_energy import _Nvml  # lazily: needs NVML

    return _Nvml()


# NVML's clock-event reasons (nvmlClocksEventReason*, called ClocksThrottleReason* before): the bits read here
CLOCK_EVENT_BITS = {
    "sw_power_cap": 0x4,  # the power limit holds the clock down: the 1.3B's step (sessions 25, 34, 37)
    "thermal": 0x8 | 0x20 | 0x40 | 0x80,  # HW slowdown, SW / HW thermal slowdown, HW power brake
}


class ClockSampler:
    """Calls read() -> (SM MHz, W, clock-event reasons) every period_s on a daemon thread from start() to stop(),
    keeping (host seconds, MHz, W, reasons) per sample: the same clock (time.perf_counter) as the step marks, so the
    timed steps' samples can be picked out afterwards (clock_summary)."""

    def __init__(self, read, period_s: float):
        self.read, self.period_s = read, period_s
        self.samples: list[tuple[float, float, float, int]] = []
        self.error: str | None = None  # what stopped the sampling early (an NVML call this GPU does not support)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="clock-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                mhz, watts, reasons = self.read()
            except Exception as e:  # noqa: BLE001 - the step goes on; the result says why it has no samples
                self.error = f"{type(e).__name__}: {e}"
                return
            self.samples.append((time.perf_counter(), mhz, watts, reasons))
            self._stop.wait(self.period_s)

    def start(self) -> "ClockSampler":
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, float, float, int]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def clock_summary(samples: list[tuple[float, float, float, int]], t0: float, t1: float) -> dict:
    """The samples taken between host times t0 and t1 (the timed steps): their count, the SM clock's median, 10th and
    90th percentiles (MHz), the median sampled power (W), and the share of them with the power cap, or a thermal
    limit, holding the clock down (CLOCK_EVENT_BITS). None for each figure where no sample fell inside."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    out = dict(clock_samples=len(inside))
    if not inside:
        return dict(out, sm_mhz_median=None, sm_mhz_p10=None, sm_mhz_p90=None, sampled_watts_median=None,
                    power_cap_share=None, thermal_share=None)  # fmt: skip
    mhz = sorted(s[1] for s in inside)
    pick = lambda q: mhz[min(len(mhz) - 1, int(q * len(mhz)))]  # noqa: E731
    share = lambda bits: sum(1 for s in inside if s[3] & bits) / len(inside)  # noqa: E731
    return dict(
        out,
        sm_mhz_median=statistics.median(mhz),
        sm_mhz_p10=pick(0.1),
        sm_mhz_p90=pick(0.9),
        sampled_watts_median=statistics.median(s[2] for s in inside),
        power_cap_share=share(CLOCK_EVENT_BITS["sw_power_cap"]),
        thermal_share=share(CLOCK_EVENT_BITS["thermal"]),
    )


def clock_sampler(nvml, period_ms: float) -> ClockSampler | None:
    """A started ClockSampler reading `nvml` (gpu_nvml()), or None without it or with period_ms 0."""
    if nvml is None or period_ms <= 0:
        return None
    return ClockSampler(lambda: (nvml.sm_clock(), nvml.power_w(), nvml.clock_event_reasons()), period_ms / 1e3).start()


def extra_work(extra: str):
    """The callable that queues --extra's work on the current stream (nothing for none)."""
    kind, amount = parse_extra(extra)
    if kind == "none":
        return lambda: None
    if not torch.cuda.is_available():
        raise SystemExit(f"--extra {extra} queues GPU work: run it on a CUDA machine")
    if kind == "sleep":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        torch.cuda.synchronize()
        cycles = int(2_000_000 * amount / start.elapsed_time(end))
        return lambda: torch.cuda._sleep(cycles)
    src = torch.ones(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def copies():
        for _ in range(int(amount)):
            dst.copy_(src)

    return copies


def main(argv=None) -> dict:
    a = parse_args(argv)
    size = SIZES[a.size]
    nvml, work = gpu_nvml(), extra_work(a.extra)
    read_energy = nvml.energy_mj if nvml is not None else lambda: None
    marks: list[tuple[float, float | None]] = []
    sampler = clock_sampler(nvml, a.sample_ms)

    def mark_then(fn):
        def wrapped(*args, **kwargs):
            marks.append((time.perf_counter(), read_energy()))
            work()
            return fn(*args, **kwargs)

        return wrapped

    if a.side == "ours":
        import train

        original = train.global_grad_norm
        train.global_grad_norm = mark_then(original)
        try:
            if os.path.isdir(a.dump_folder):
                shutil.rmtree(a.dump_folder)
            train.main(ours_command(size, a.warmup, a.steps, a.dump_folder, [])[2:])
        finally:
            train.global_grad_norm = original
        result = summarize_ours(read_jsonl(os.path.join(a.dump_folder, "metrics.jsonl")), a.warmup)
    else:
        original = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = mark_then(original)
        try:
            run = theirs_worker(size, a.warmup, a.steps)
        finally:
            torch.nn.utils.clip_grad_norm_ = original
        result = {k: run[k] for k in ("tokens_per_sec", "memory_gib")}
    result.update(per_step(marks, a.warmup), side=a.side, size=a.size, extra=a.extra,
                  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")  # fmt: skip
    if sampler is not None:  # the timed steps' window: the last warm-up step's mark to the last step's (per_step)
        result.update(clock_summary(sampler.stop(), marks[a.warmup - 1][0], marks[-1][0]))
        if sampler.error:
            result["clock_error"] = sampler.error
    print("STEP_ENERGY " + json.dumps(result), flush=True)
    return _written(result, a.out)


if __name__ == "__main__":
    main()
