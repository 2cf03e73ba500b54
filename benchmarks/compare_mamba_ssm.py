"""Throughput and memory of our trainer next to mamba-ssm's own model in a plain PyTorch loop, on one GPU.

    bash .gpu/setup.sh && python3 benchmarks/compare_mamba_ssm.py --out outputs/compare.json
    python3 benchmarks/compare_mamba_ssm.py --sizes 370m -- --compile.enable true     # extra train.py overrides
    python3 benchmarks/compare_mamba_ssm.py --variant='--training.cuda_graph true' -- --training.loss_chunk_tokens 8192
    python3 benchmarks/compare_mamba_ssm.py --sizes debug --skip_theirs --warmup 1 --steps 2   # CPU smoke run

For every size, two subprocesses run one after the other (each starts with an empty GPU, so peaks are its own):
  theirs  mamba_ssm's MambaLMHeadModel with Mamba2 layers (vocabulary 50277 padded to 8 = 50280, tied embeddings,
          fused add-norm), fp32 weights, bf16 autocast, fused AdamW, gradient clipping at 1.0, random tokens, one
          document per row (with --their_documents the seq_idx of our run's rows, so that both sides do the same
          document resets); this script re-run with --_worker theirs.
  ours    train.py with the size's config on the embedded corpus (packed documents, so the kernels also handle
          seq_idx), at their loop's gradient precision (ONE_GPU_AS_THEIRS: --training.grad_dtype bfloat16, the
          blocks' linear weights' gradients in bf16, as autocast leaves theirs; `-- --training.grad_dtype float32`
          for the configs' own), vocabulary from the flavor (50277 padded to 16 = 50288), checkpoints, validation and
          TensorBoard off, metrics every step, model.kernels from the config (auto: our Triton SSD on CUDA; add
          --variant='--model.kernels mamba_ssm' for mamba_ssm's kernels in our trainer); anything after `--` is
          passed on (e.g. --compile.enable true).
Both run N warm-up + M timed steps at the same batch: 370m 8 x 2048, 1.3b 4 x 4096 (seq_len overridden).
--their_runs R runs their loop R times (fresh processes) and compares with its fastest run (all of them in the JSON
as "runs_tokens_per_sec"): their kernels autotune in every process, so one run of theirs is a noisy baseline.
--rounds R repeats the whole comparison R times, the sides taking turns (theirs, then each run of ours, per round),
and compares each side's median run (the lower middle one for even R; every round's figures and ratio in the JSON as
"rounds" and printed below the table): the GPU's clock moves with the power cap and the temperature through a call,
so runs taken one after another pair up, and one slow run of either side no longer decides the ratio. Below the
table, and as "ratio_vs_their_fastest", our median run against their fastest one: the strict reading where a host
slows some of their runs.
Throughput is over the timed steps (total tokens / total time); memory is torch.cuda.max_memory_allocated.
MFU is reported on two FLOP counts, for both sides alike: "6N" (6 x the matmul parameters a token uses, lm_head
included) and "SSD" (that plus the conv and chunked-SSD terms, components.metrics.model_flops_per_token), against
--peak_tflops (H100 / H200 dense bf16: 989.4). Prints a table and writes every record to --out (JSON), with the host's
CPU and the time of a plain CPython loop (host_probe) in its settings: a host-bound step (the 370M eager, their loop's
idle gaps) moves with the host, so each figure says which host it came from.

--profile_step K (a warm-up step, K <= --warmup, so that the timed steps are not traced) also takes a torch.profiler
trace of step K on both sides (ours: profiling.profile_steps [K]; theirs: the same tracer around their loop, one
warm-up step of the tracer first, as ours) and prints where each side's step goes, kernel family by family
(benchmarks/trace_summary.py --groups), side by side:

    python3 benchmarks/compare_mamba_ssm.py --sizes 1.3b --warmup 5 --steps 5 --profile_step 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.compare_sides import (
    SIZES,
    Size,
    model_args_for,
    ours_command,
    read_jsonl,
    summarize_ours,
    theirs_worker,
)
from components.metrics import model_flops_per_token

H100_BF16_TFLOPS = 989.4


# ---------------------------------------------------------------------------------------------------------
# Pure helpers (tested on CPU in tests/test_compare_mamba_ssm.py)
# ---------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    """Our options before `--`, train.py overrides after it (in a.overrides)."""
    overrides: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, overrides = argv[:cut], argv[cut + 1 :]
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--sizes", default="370m,1.3b", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--steps", type=int, default=15, help="timed steps")
    ap.add_argument("--out", default="outputs/compare_mamba_ssm/results.json", help="JSON results file")
    ap.add_argument("--work_dir", default="outputs/compare_mamba_ssm", help="our runs' dump folders go here")
    ap.add_argument("--peak_tflops", type=float, default=H100_BF16_TFLOPS, help="dense bf16 peak for MFU")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per subprocess")
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="OVERRIDES",
        help="more runs of ours, each with these train.py overrides added to those after `--`, "
        "next to the same run of theirs; repeatable; write it as --variant='--training.x y'",
    )
    ap.add_argument(
        "--profile_step",
        type=int,
        default=0,
        help="trace this warm-up step on both sides and compare their kernel families (0: no traces)",
    )
    ap.add_argument(
        "--their_runs",
        type=int,
        default=1,
        help="run their loop this many times per size (fresh processes) and compare with the fastest: mamba_ssm "
        "autotunes its kernels in every process, and its tokens/s moved by 12%% between calls at 1.3B (session 17)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the comparison this many times, the sides taking turns, and compare each side's median run "
        "(session 56: their loop's tokens/s spread 33.3k-38.7k over four runs on one H100)",
    )
    ap.add_argument(
        "--their_documents",
        action="store_true",
        help="their loop gets our run's document ids (seq_idx of the same packed rows), so both sides reset the conv "
        "and SSM state at the same document starts; by default theirs trains on one document per row",
    )
    ap.add_argument("--skip_theirs", action="store_true")
    ap.add_argument("--skip_ours", action="store_true")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--_worker", choices=("theirs",), help=argparse.SUPPRESS)
    ap.add_argument("--_size", help=argparse.SUPPRESS)
    ap.add_argument("--_trace", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.overrides = overrides
    a.variant_overrides = [overrides] + [overrides + v.split() for v in a.variant]  # the base run first
    a.size_list = [s.strip() for s in a.sizes.split(",") if s.strip()]
    unknown = [s for s in a.size_list if s not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    if a.their_runs < 1:
        ap.error("--their_runs must be >= 1")
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    if a.rounds > 1 and a.profile_step:
        ap.error("--profile_step traces one run of each side: drop --rounds (or --profile_step)")
    if a.warmup < 1 or a.steps < 1:
        ap.error("--warmup and --steps must be >= 1 (the first step compiles / autotunes kernels)")
    if a.profile_step and not 2 <= a.profile_step <= a.warmup:
        ap.error(
            f"--profile_step {a.profile_step} must be a warm-up step after the first (2..{a.warmup}): the tracer's "
            "own warm-up step runs before it, and traced steps are slower, so they must not be timed"
        )
    return a


def flops_per_token(size: Size, side: str) -> dict:
    """{"6n": 6 x matmul params per token, "ssd": with the conv / SSD terms} (training FLOPs per token)."""
    ssd, six_n = model_flops_per_token(model_args_for(size, side), size.seq_len)
    return {"6n": six_n, "ssd": ssd}


def mfu(tokens_per_sec: float, flops: float, peak_tflops: float) -> float:
    return tokens_per_sec * flops / (peak_tflops * 1e12)


def add_mfu(rec: dict, size: Size, peak_tflops: float) -> dict:
    for side in ("ours", "theirs"):
        r = rec.get(side)
        if r and "tokens_per_sec" in r:
            f = flops_per_token(size, side)
            r["mfu_6n"] = mfu(r["tokens_per_sec"], f["6n"], peak_tflops)
            r["mfu_ssd"] = mfu(r["tokens_per_sec"], f["ssd"], peak_tflops)
    return rec


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


COLUMNS = (
    "model",
    "config",
    "tok/s ours",
    "tok/s theirs",
    "ours/theirs",
    "GiB ours",
    "GiB theirs",
    "MFU 6N ours",
    "MFU 6N theirs",
    "MFU SSD ours",
    "MFU SSD theirs",
)


def _runs_note(side: dict) -> str:
    """' (median of R)', ' (best of N)' or both, where the figure is one of several runs."""
    notes = []
    for kind, key in (("median of", "rounds_tokens_per_sec"), ("best of", "runs_tokens_per_sec")):
        if len(side.get(key) or []) > 1:
            notes.append(f"{kind} {len(side[key])}")
    return f" ({', '.join(notes)})" if notes else ""


def table_row(rec: dict) -> list[str]:
    o, t = rec.get("ours") or {}, rec.get("theirs") or {}
    ratio = o["tokens_per_sec"] / t["tokens_per_sec"] if o.get("tokens_per_sec") and t.get("tokens_per_sec") else None
    config = " ".join([f"{rec['batch']}x{rec['seq_len']}", *rec.get("ours_args", []), *rec.get("overrides", [])])
    if t.get("documents"):
        config += " (theirs with our documents)"
    return [
        rec["size"],
        config,
        _fmt(o.get("tokens_per_sec"), ",.0f") + _runs_note(o),
        _fmt(t.get("tokens_per_sec"), ",.0f") + _runs_note(t),
        _fmt(ratio, ".3f"),
        _fmt(o.get("memory_gib"), ".1f"),
        _fmt(t.get("memory_gib"), ".1f"),
        _fmt(o.get("mfu_6n"), ".1%"),
        _fmt(t.get("mfu_6n"), ".1%"),
        _fmt(o.get("mfu_ssd"), ".1%"),
        _fmt(t.get("mfu_ssd"), ".1%"),
    ]


def format_table(records: list[dict]) -> str:
    """A Markdown table (renders in docs/performance.md as is); failed sides show their error below it."""
    rows = [list(COLUMNS)] + [table_row(r) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in records:
        for side in ("ours", "theirs"):
            if (r.get(side) or {}).get("error"):
                lines.append(f"{r['size']} {side} failed: {r[side]['error']}")
    return "\n".join(lines)


def last_result_line(stdout: str) -> dict:
    """The worker prints `RESULT {json}` as its last such line."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        raise ValueError("the worker printed no RESULT line")
    return json.loads(lines[-1][len("RESULT ") :])


# ---------------------------------------------------------------------------------------------------------
# The two sides
# ---------------------------------------------------------------------------------------------------------
def _tail(text: str, n: int = 1500) -> str:
    return text[-n:].strip().replace("\n", " | ")


def _run(cmd: list[str], a: argparse.Namespace, parse, env: dict | None = None) -> dict:
    """Run one side's subprocess (in `env`, else this process's environment); `parse(stdout)` gives its record (or an
    error record), plus wall_s."""
    print("+ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(
            cmd,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=a.timeout,
            env=dict(env or os.environ, PYTHONUNBUFFERED="1"),
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {a.timeout} s"}
    if r.returncode != 0:
        return {"error": f"exit {r.returncode}: {_tail(r.stdout + r.stderr)}"}
    out = parse(r.stdout)
    out["wall_s"] = time.perf_counter() - t0
    return out


def run_ours(size: Size, a: argparse.Namespace, overrides: list[str] | None = None, index: int = 0) -> dict:
    dump = os.path.join(a.work_dir, f"{size.name}-ours" + (f"-{index}" if index else ""))
    if os.path.isdir(dump):
        shutil.rmtree(dump)  # ours alone: a stale metrics.jsonl would mix into this run's records
    overrides = list(a.overrides if overrides is None else overrides)
    if a.profile_step:
        overrides += ["--profiling.enable_profiling", "true", "--profiling.profile_steps", f"[{a.profile_step}]"]
    cmd = ours_command(size, a.warmup, a.steps, dump, overrides, a.python)
    rec = _run(cmd, a, lambda _: summarize_ours(read_jsonl(os.path.join(dump, "metrics.jsonl")), a.warmup))
    if a.profile_step and "error" not in rec:
        rec["trace"] = os.path.join(dump, "profile_trace", f"iteration_{a.profile_step}", "rank0_trace.json")
    return rec


def fastest_of(runs: list[dict]) -> dict:
    """The run with the most tokens/s (their loop's baseline: the best it managed), with every run's tokens/s in
    "runs_tokens_per_sec" (None for a run that failed); the first run as it is when none succeeded."""
    ok = [r for r in runs if r.get("tokens_per_sec")]
    best = dict(max(ok, key=lambda r: r["tokens_per_sec"]) if ok else runs[0])
    if len(runs) > 1:
        best["runs_tokens_per_sec"] = [r.get("tokens_per_sec") for r in runs]
    return best


def median_of(runs: list[dict]) -> dict:
    """The median run by tokens/s (the lower middle one of an even count) among the successful ones, with every
    run's tokens/s in "rounds_tokens_per_sec" (None for a failed run) when there are several; the first run as it is
    when none succeeded."""
    ok = sorted((r for r in runs if r.get("tokens_per_sec")), key=lambda r: r["tokens_per_sec"])
    mid = dict(ok[(len(ok) - 1) // 2] if ok else runs[0])
    if len(runs) > 1:
        mid["rounds_tokens_per_sec"] = [r.get("tokens_per_sec") for r in runs]
    return mid


def rounds_of(ours: list[dict], theirs: list[dict]) -> list[dict]:
    """Round by round: both sides' tokens/s and their ratio (None where a side did not run or failed)."""
    out = []
    for i in range(max(len(ours), len(theirs))):
        o = (ours[i] if i < len(ours) else {}).get("tokens_per_sec")
        t = (theirs[i] if i < len(theirs) else {}).get("tokens_per_sec")
        out.append({"ours": o, "theirs": t, "ratio": o / t if o and t else None})
    return out


def run_theirs(size: Size, a: argparse.Namespace, profile: bool = True) -> dict:
    cmd = [
        a.python,
        os.path.abspath(__file__),
        "--_worker",
        "theirs",
        "--_size",
        size.name,
        "--warmup",
        str(a.warmup),
        "--steps",
        str(a.steps),
    ]
    if a.their_documents:
        cmd.append("--their_documents")
    trace = None
    if a.profile_step and profile:
        trace = os.path.join(os.path.abspath(a.work_dir), f"{size.name}-theirs", "rank0_trace.json")
        cmd += ["--profile_step", str(a.profile_step), "--_trace", trace]
    # Their kernels autotune in the process, as in a user's run, never from Triton's on-disk autotuning cache
    # (TRITON_CACHE_AUTOTUNING=1): its keys are (chunk size, headdim, dstate), so a pick made at another shape (e.g.
    # by bench_ssd.py earlier in the same session) would be reused. After bench_ssd.py runs, their 1.3B loop ran 30.5k
    # tokens/s, and 34.0k with a fresh cache on the same machine (docs/ssd_sessions.md, session 22).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_AUTOTUNING"}
    rec = _run(cmd, a, last_result_line, env)
    if trace and "error" not in rec and os.path.exists(trace):
        rec["trace"] = trace
    return rec


def profile_table(records: list[dict]) -> str:
    """Every traced run's kernel families side by side (trace_summary.groups_table), theirs once per size."""
    from benchmarks.trace_summary import groups_table, summarize

    traces, labels = [], []
    for rec in records:
        for side in ("theirs", "ours"):
            path = (rec.get(side) or {}).get("trace")
            if path and path not in traces and os.path.exists(path):
                traces.append(path)
                extra = " ".join(rec["overrides"]) if side == "ours" and rec["overrides"] else ""
                labels.append(f"{rec['size']} {side}" + (f" {extra}" if extra else ""))
    if not traces:
        return "(no traces were written)"
    try:
        summaries = [summarize(p) for p in traces]
    except SystemExit as e:  # a CPU run's trace has no kernels
        return f"(no kernel families: {e})"
    legend = "\n".join(f"  {label}: {path}" for label, path in zip(labels, traces))
    return groups_table(summaries, labels) + "\n" + legend


def size_records(
    size: Size, name: str, a: argparse.Namespace, theirs_runs: list[dict], ours_runs: list[list[dict]]
) -> list[dict]:
    """One record per variant of ours from the runs so far: each side's median run (the run itself for one round),
    with "rounds" (round by round figures) when --rounds > 1."""
    recs = []
    for i, overrides in enumerate(a.variant_overrides):
        rec = {
            **{k: v for k, v in asdict(size).items() if k != "name"},
            "size": name,
            "overrides": overrides,
            "ours": median_of(ours_runs[i]) if ours_runs[i] else None,
            "theirs": median_of(theirs_runs) if theirs_runs else None,
        }
        if a.rounds > 1:
            rec["rounds"] = rounds_of(ours_runs[i], theirs_runs)
            rec["ratio_vs_their_fastest"] = ratio_vs_their_fastest(rec["ours"], theirs_runs)
        recs.append(add_mfu(rec, size, a.peak_tflops))
    return recs


def ratio_vs_their_fastest(ours: dict | None, theirs_runs: list[dict]) -> float | None:
    """Our median run's tokens/s over their fastest run's: the strict reading of a pair of medians where their runs
    spread (session 66's host slowed some of their runs by ~20%, and a median of theirs then flatters ours)."""
    best = max((r.get("tokens_per_sec") or 0.0 for r in theirs_runs), default=0.0)
    mine = (ours or {}).get("tokens_per_sec")
    return mine / best if mine and best else None


def rounds_lines(records: list[dict]) -> str:
    """Each record's ratio round by round, and our median against their fastest run, under the table."""
    lines = []
    for rec in records:
        ratios = ", ".join(_fmt(r["ratio"], ".3f") for r in rec.get("rounds", []))
        config = " ".join(
            [rec["size"], f"{rec['batch']}x{rec['seq_len']}", *rec.get("ours_args", []), *rec.get("overrides", [])]
        )
        strict = _fmt(rec.get("ratio_vs_their_fastest"), ".3f")
        lines.append(f"{config}: ours/theirs round by round {ratios}; our median / their fastest run {strict}")
    return "\n".join(lines)


def host_probe(iterations: int = 2_000_000) -> dict:
    """What the host can do where a step is host-bound (the 370M eager on either side, their loop's idle gaps at the
    1.3B): CPU model and count, load average, and nanoseconds per iteration of a plain CPython loop. Session 61 (two
    H100 calls on one machine at 117 ns): the 370M eager ran 85.4k and 113.9k tokens/s and their loop 54.0k and 40.4k,
    against 129.9k and 59.3k in session 53, while our CUDA-graph step ran 133.7k there: such figures belong to the
    host, and this says which host it was."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    t0 = time.perf_counter()
    total = 0
    for i in range(iterations):
        total += i
    loop_ns = (time.perf_counter() - t0) / iterations * 1e9
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {"cpu_model": model, "cpus": os.cpu_count(), "load_avg_1m": load[0], "python_loop_ns": loop_ns}


def host_line(host: dict) -> str:
    return (
        f"host: {host['cpu_model'] or 'unknown CPU'}, {host['cpus']} CPUs, load {host['load_avg_1m']:.2f}, "
        f"{host['python_loop_ns']:.0f} ns per CPython loop iteration (host_probe)"
    )


def write_json(path: str, records: list[dict], a: argparse.Namespace) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    meta = {"warmup": a.warmup, "steps": a.steps, "peak_tflops": a.peak_tflops, "overrides": a.overrides}
    if getattr(a, "host", None) is not None:
        meta["host"] = a.host
    with open(path, "w") as f:
        json.dump({"settings": meta, "results": records}, f, indent=1)


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    if a._worker == "theirs":
        result = theirs_worker(
            SIZES[a._size], a.warmup, a.steps, profile_step=a.profile_step, trace=a._trace, documents=a.their_documents
        )
        print("RESULT " + json.dumps(result), flush=True)
        return []
    a.host = host_probe()  # before any run: nothing of ours or theirs is loading the CPU yet
    records = []
    for name in a.size_list:
        size = SIZES[name]
        theirs_runs: list[dict] = []  # per round: the fastest of --their_runs, shared by every variant of ours
        ours_runs: list[list[dict]] = [[] for _ in a.variant_overrides]  # per variant, per round
        done = len(records)
        for r in range(a.rounds):
            if not a.skip_theirs:
                theirs_runs.append(
                    fastest_of([run_theirs(size, a, profile=r == 0 and i == 0) for i in range(a.their_runs)])
                )
            for i, overrides in enumerate(a.variant_overrides):
                if not a.skip_ours:
                    ours_runs[i].append(run_ours(size, a, overrides, i))
                records[done:] = size_records(size, name, a, theirs_runs, ours_runs)
                write_json(a.out, records, a)  # after every run: a later timeout keeps what finished
    print(format_table(records), flush=True)
    if a.rounds > 1:
        print(rounds_lines(records), flush=True)
    if a.profile_step:
        print(profile_table(records), flush=True)
    print(host_line(a.host), flush=True)
    print(f"results: {a.out}", flush=True)
    return records


if __name__ == "__main__":
    main()
