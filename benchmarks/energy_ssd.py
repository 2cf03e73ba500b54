"""bench_energy.py's two SSD modes: --variant (config variants of our SSD between baselines) and --ssd_stages (our
SSD's forward + backward split by kernel, each launched twice in turn). bench_energy.py's docstring says what each
measures; here is only the bookkeeping (the order of a run, the launch counter, the tables), given a function that
measures one step (bench_energy.measure under NVML), so the CPU tests can run it with stand-ins.
"""

from __future__ import annotations

import collections
import contextlib


def variant_plan(n_variants: int, baseline_every: int = 2) -> list[int | None]:
    """The order of an --variant run: None for a baseline, i for variant i; a baseline first, after every
    `baseline_every` variants and last, so every variant has a baseline on either side."""
    plan: list[int | None] = [None]
    for i in range(n_variants):
        plan.append(i)
        if (i + 1) % baseline_every == 0 or i == n_variants - 1:
            plan.append(None)
    return plan


def ssd_variants(problem: dict, variants: list[dict], base: dict, measure_fn, outputs_fn=None,
                 max_rel_diff: float = 2e-2) -> list[dict]:  # fmt: skip
    """Rows of an --variant run in variant_plan's order: each config (base, or base updated by a variant) patched
    into our SSD (bench_ssd.patched_config), its outputs and gradients taken once (outputs_fn, default
    bench_ssd._outputs_and_grads: this also compiles it) and compared with the first baseline's, then measure_fn on
    its forward + backward. A variant that fails (e.g. shared memory) is a row with its error; one whose outputs
    differ by more than max_rel_diff is marked "differs". The base config is patched back at the end."""
    from benchmarks.bench_ssd import _outputs_and_grads, fwd_bwd_fn, patched_config

    outputs_fn = outputs_fn or _outputs_and_grads
    fn, inp, Q, dy = problem["fn"], problem["inp"], problem["Q"], problem["dy"]
    step, _ = fwd_bwd_fn(fn, inp, Q, dy)  # reads the patched config at every call
    rows, reference = [], None
    try:
        for i in variant_plan(len(variants)):
            over = {} if i is None else variants[i]
            row = dict(variant="baseline" if i is None else ",".join(f"{k}={v!r}" for k, v in over.items()), index=i)
            patched_config({**base, **over})
            try:
                outs = outputs_fn(fn, inp, Q, dy)
                if reference is None:
                    reference = outs
                row["max_rel_diff"] = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item()
                                          for a, b in zip(outs, reference))  # fmt: skip
                row["differs"] = not row["max_rel_diff"] <= max_rel_diff
                row.update(measure_fn(step))
            except Exception as e:  # a variant the kernels cannot run (shared memory, registers, a refused value)
                if i is None:
                    raise
                row["failed"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
    finally:
        patched_config(base)
    return variant_table(rows)


def variant_table(rows: list[dict]) -> list[dict]:
    """rows (ssd_variants') with each measured variant's energy against the mean of the nearest baselines before
    and after it (vs_baselines, a fraction) and the baselines' spread over the run."""
    base_at = [k for k, r in enumerate(rows) if r["index"] is None]
    for k, r in enumerate(rows):
        if r["index"] is None or "mj_per_call" not in r:
            continue
        before = max(j for j in base_at if j < k)
        after = min((j for j in base_at if j > k), default=before)
        ref_mj = (rows[before]["mj_per_call"] + rows[after]["mj_per_call"]) / 2
        ref_ms = (rows[before]["ms"] + rows[after]["ms"]) / 2
        r["vs_baselines"], r["ms_vs_baselines"] = r["mj_per_call"] / ref_mj - 1, r["ms"] / ref_ms - 1
    mjs = [rows[j]["mj_per_call"] for j in base_at]
    for j in base_at:
        rows[j]["baselines_spread"] = (max(mjs) - min(mjs)) / min(mjs)
    return rows


# Kernels that cannot be launched twice in a row: their programs take tickets from a counter and wait on chain
# counters (ssd_triton/chained_states.py) that the launcher zeroes once per call, so a second launch would wait forever.
NOT_DOUBLED = frozenset(("chained_states_fwd_kernel", "chained_dstates_bwd_kernel"))


@contextlib.contextmanager
def kernel_launches(counts: collections.Counter, double: str | None = None):
    """Counts the launches of our Triton kernels by name into `counts` (every SSD kernel launches through
    fast_launch.FastLaunch, on the GPU and under the interpreter alike), and launches kernel `double` twice each
    time. A CUDA graph captured inside keeps the doubled launches."""
    if double in NOT_DOUBLED:
        raise ValueError(f"{double} cannot be launched twice in a row (NOT_DOUBLED)")
    from models.kernels.fast_launch import FastLaunch

    original = FastLaunch.launch

    def launch(self, grid, args, kwargs):
        name = self.kernel.fn.__name__
        counts[name] += 1
        original(self, grid, args, kwargs)
        if name == double:
            original(self, grid, args, kwargs)

    FastLaunch.launch = launch
    try:
        yield counts
    finally:
        FastLaunch.launch = original


def stage_table(baselines: list[dict], doubled: dict[str, dict], launches: dict[str, int]) -> list[dict]:
    """Per kernel measured doubled: launches per call of the whole, and per launch its ms, mJ and mean W (the excess
    of the doubled whole over the baselines' mean, divided by its launches); then "rest": the whole's mean minus
    every measured kernel's share (the kernels not doubled and torch's own ops), and "whole"."""
    base_ms = sum(r["ms"] for r in baselines) / len(baselines)
    base_mj = sum(r["mj_per_call"] for r in baselines) / len(baselines)
    rows, ms_left, mj_left = [], base_ms, base_mj
    for name, r in doubled.items():
        n = launches[name]
        ms, mj = (r["ms"] - base_ms) / n, (r["mj_per_call"] - base_mj) / n
        rows.append(dict(kernel=name, launches=n, ms=ms, mj=mj, watts=mj / ms if ms > 0 else float("nan")))
        ms_left, mj_left = ms_left - n * ms, mj_left - n * mj
    rest = sorted(set(launches) - set(doubled))
    rows.append(dict(kernel="rest: " + (", ".join(rest) or "torch ops"), launches=1, ms=ms_left, mj=mj_left,
                     watts=mj_left / ms_left if ms_left > 0 else float("nan")))  # fmt: skip
    spread = max(r["mj_per_call"] for r in baselines) - min(r["mj_per_call"] for r in baselines)
    rows.append(dict(kernel="whole", launches=1, ms=base_ms, mj=base_mj, watts=base_mj / base_ms, mj_spread=spread))
    return rows


def ssd_stages(step, measure_fn) -> list[dict]:
    """stage_table of our SSD's forward + backward (`step`): a baseline, then each kernel doubled in turn with a
    baseline after every fourth, and a last baseline; measure_fn(step) -> bench_energy.measure's row."""
    launches = collections.Counter()
    step()  # compiled before counting
    with kernel_launches(launches):
        step()
    baselines, doubled = [measure_fn(step)], {}
    for i, name in enumerate(n for n in launches if n not in NOT_DOUBLED):
        with kernel_launches(collections.Counter(), double=name):
            doubled[name] = measure_fn(step)
        if i % 4 == 3:
            baselines.append(measure_fn(step))
    baselines.append(measure_fn(step))
    return stage_table(baselines, doubled, dict(launches))


def print_variants(rows: list[dict]) -> None:
    """ssd_variants' rows, one line each: ms, W, mJ per call, against the baselines, and the outputs' check."""
    for r in rows:
        if "failed" in r:
            print(f"{r['variant']:50s} FAILED {r['failed']}", flush=True)
            continue
        vs = ""
        if "vs_baselines" in r:
            vs = f"{100 * r['vs_baselines']:+6.2f}% mJ {100 * r['ms_vs_baselines']:+6.2f}% ms"
        check = "  OUTPUTS DIFFER" if r["differs"] else f"  (diff {r['max_rel_diff']:.1e})"
        print(f"{r['variant']:50s} {r['ms']:7.4f} ms {r['watts']:6.1f} W {r['mj_per_call']:8.1f} mJ {vs}{check}")
    print(f"baselines' spread: {100 * rows[0]['baselines_spread']:.2f}%", flush=True)
