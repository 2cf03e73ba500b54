"""Where the time of a profiled step goes, from a torch profiler chrome trace (profiling.enable_profiling).

    python3 benchmarks/trace_summary.py outputs/run/profile_traces/iteration_10/rank0_trace.json [--top 15]

Prints, for the GPU of that trace: the step's wall time (the ProfilerStep annotation, else the span of its
kernels), the time the GPU computes (union of the non-NCCL kernels), the time NCCL kernels run and how much of
it no compute kernel hides, the idle time (no kernel at all: the GPU waits for the host), the number of kernel
launches, and the kernels that take the most time. A GPU idle for a large share of the step means the step is
host-bound (launch or Python overhead); exposed NCCL means communication is not overlapped. For the host, the
busiest thread's ops by self time, and how much of the step no traced op covers (Python between ops).
"""

from __future__ import annotations

import argparse
import collections
import json
import os

# Kernel families of a Mamba / hybrid training step, first match wins; a key matches anywhere in the lower-cased
# kernel name, or at its start when written "^key". "ssd (ours)" are models/kernels/ssd_triton's kernels (Triton
# names them after their functions); "ssd (mamba_ssm)" mamba_ssm's _chunk_* / _state_passing_* / _bmm_*.
KERNEL_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nccl", ("nccl",)),
    (
        "ssd (ours)",
        (
            "^chunk_scan_fwd_kernel",
            "^chunk_state_fwd_kernel",
            "^state_passing_fwd_kernel",
            "^state_passing_bwd_kernel",
            "^cb_fwd_kernel",
            "^bc_finish_kernel",
            "^dt_fwd_kernel",
            "^dt_bwd_kernel",
            "^chunk_scan_bwd_",
            "^chunk_state_bwd_",
            "^chained_states_fwd_kernel",
            "^chained_dstates_bwd_kernel",
        ),
    ),
    ("ssd (mamba_ssm)", ("_chunk_scan", "_chunk_state", "_chunk_cumsum", "_state_passing", "_bmm_chunk")),
    ("conv1d", ("causal_conv1d", "conv1d", "^conv_fwd_kernel", "^conv_bwd_kernel")),
    ("norms", ("rmsnorm", "layer_norm", "_norm_")),
    ("attention", ("flash", "attention", "fmha", "sdpa")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "gemv", "splitkreduce", "sm90_", "sm80_")),
    ("loss", ("cross_entropy", "log_softmax", "softmax", "nll_loss")),
    ("optimizer", ("multi_tensor", "adam", "fused_sgd")),
    ("memcpy / memset", ("memcpy", "memset")),
    (
        "elementwise / reductions",
        ("elementwise", "reduce_kernel", "reduce", "fill", "copy", "cat", "index", "scatter", "gather"),
    ),
)


def kernel_group(name: str) -> str:
    """The family of a kernel name (KERNEL_GROUPS), "other" when none matches."""
    low = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(low.startswith(k[1:]) if k.startswith("^") else k in low for k in keys):
            return group
    return "other"


def short_name(name: str | None, width: int = 90) -> str:
    """A kernel or op name cut to fit a table column ("-" for none)."""
    if name is None:
        return "-"
    return name if len(name) < width else name[: width - 3] + "..."


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the (start, end) intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def intersect_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length covered by both interval sets: |A| + |B| - |A u B|."""
    return union_length(a) + union_length(b) - union_length(a + b)


def nccl_kind(name: str) -> str:
    """The collective of an NCCL kernel name: SendRecv (all-to-alls and point-to-point), AllGather, ReduceScatter,
    AllReduce, Broadcast, else "other"."""
    for kind in ("SendRecv", "AllGather", "ReduceScatter", "AllReduce", "Broadcast"):
        if kind.lower() in name.lower():
            return kind
    return "other"


def exposed_by_kind(
    comm_kernels: list[tuple[str, tuple[float, float]]], compute
) -> list[tuple[str, int, float, float]]:
    """Per collective kind (nccl_kind): (kind, kernels, time, exposed time) in trace units, most exposed first. A
    kind's exposed time is its own kernels' time with no compute kernel running (two kinds running at once, both
    exposed, count in both)."""
    by_kind: dict[str, list] = collections.defaultdict(list)
    for name, interval in comm_kernels:
        by_kind[nccl_kind(name)].append(interval)
    rows = [
        (kind, len(iv), union_length(iv), union_length(iv) - intersect_length(iv, compute))
        for kind, iv in by_kind.items()
    ]
    return sorted(rows, key=lambda r: -r[3])


def host_self_times(events: list[dict], window: tuple[float, float]) -> dict:
    """The busiest host thread's ops in the window: their union (traced host time) and each name's self time
    (duration minus that of the ops nested inside it), from the cpu_op / user_annotation / cuda_runtime events."""
    by_tid: dict = collections.defaultdict(list)
    for e in events:
        if (
            e.get("ph") == "X"
            and e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime")
            and window[0] <= e["ts"] < window[1]
            and not str(e.get("name", "")).startswith("ProfilerStep#")
        ):
            by_tid[e.get("tid")].append(e)
    if not by_tid:
        return {"traced_ms": 0.0, "self_ms": []}
    covered = {tid: union_length([(e["ts"], e["ts"] + e["dur"]) for e in evs]) for tid, evs in by_tid.items()}
    tid = max(covered, key=covered.get)
    evs = by_tid[tid]
    evs = sorted(evs, key=lambda e: (e["ts"], -e["dur"]))  # a parent starts first (or together, and is longer)
    self_us: dict = collections.defaultdict(float)
    stack: list[tuple[float, str]] = []  # (end, name) of the open ops
    for e in evs:
        start, end = e["ts"], e["ts"] + e["dur"]
        while stack and stack[-1][0] <= start:
            stack.pop()
        self_us[e["name"]] += e["dur"]
        if stack:
            self_us[stack[-1][1]] -= min(e["dur"], stack[-1][0] - start)  # the child's time is not its parent's
        stack.append((end, e["name"]))
    return {
        "thread": tid,
        "traced_ms": covered[tid] / 1e3,
        "self_ms": sorted(((n, t / 1e3) for n, t in self_us.items()), key=lambda r: -r[1]),
    }


def hook_times(events: list[dict], window: tuple[float, float]) -> list[tuple[str, int, float]]:
    """Host time of FSDP2's hooks in the window: (name, calls, inclusive ms) per annotation, the unit's name left
    out ("FSDP::pre_forward (layers.3)" counts as "FSDP::pre_forward"), largest first. Each unit's hooks cost host
    time whatever its size, which is what limits FSDP on host-bound steps."""
    per_name: dict = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        name = str(e.get("name", ""))
        if (
            e.get("ph") == "X"
            and e.get("cat") == "user_annotation"
            and name.startswith("FSDP::")
            and window[0] <= e["ts"] < window[1]
        ):
            short = name.split(" (")[0].split(" for ")[0]
            per_name[short][0] += 1
            per_name[short][1] += e["dur"]
    return sorted(((n, c, t / 1e3) for n, (c, t) in per_name.items()), key=lambda r: -r[2])


def idle_gaps(events: list[dict], kernels: list[dict], window: tuple[float, float], top: int) -> list[dict]:
    """The `top` longest stretches of the window with no GPU kernel running, longest first: each gap's length, the
    kernels before and after it, and what the host was doing when it launched the kernel that ended the gap (the
    innermost and the outermost traced op around that launch, found through the launch's correlation id). A gap
    ended by a kernel launched late points at host work (a sync, Python, a data copy) between the two kernels."""
    spans = sorted((max(e["ts"], window[0]), min(e["ts"] + e["dur"], window[1]), e) for e in kernels)
    spans = [sp for sp in spans if sp[0] < sp[1]]
    gaps, end, prev = [], window[0], None
    for start, stop, e in spans:
        if start > end:
            gaps.append((start - end, prev, e))
        if stop > end:
            end, prev = stop, e
    if window[1] > end:
        gaps.append((window[1] - end, prev, None))
    gaps = sorted(gaps, key=lambda g: -g[0])[:top]
    launches = {
        e.get("args", {}).get("correlation"): e
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and e.get("args", {}).get("correlation") is not None
    }
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]

    def around(launch):
        if launch is None:
            return "", ""
        t = launch["ts"]
        holding = [
            e
            for e in ops
            if e.get("tid") == launch.get("tid")
            and e["ts"] <= t <= e["ts"] + e["dur"]
            and not str(e["name"]).startswith("ProfilerStep#")
        ]
        if not holding:
            return "", ""
        return min(holding, key=lambda e: e["dur"])["name"], max(holding, key=lambda e: e["dur"])["name"]

    out = []
    for length, before, after in gaps:
        launch = None if after is None else launches.get(after.get("args", {}).get("correlation"))
        inner, outer = around(launch)
        out.append(
            {
                "ms": length / 1e3,
                "before": None if before is None else before["name"],
                "after": None if after is None else after["name"],
                "launched_by": inner,
                "inside": outer,
            }
        )
    return out


def launch_kind(name: str) -> str:
    """Who wrote a kernel: "cublas" (cuBLAS / CUTLASS products), "torch" (PyTorch's own kernels, memsets and
    copies), else "triton" (ours and any other Triton kernel)."""
    low = name.lower()
    if any(k in low for k in ("nvjet", "gemm", "xmma", "cutlass", "sm90_", "sm80_", "splitkreduce")):
        return "cublas"
    if "at::native" in low or low.startswith(("void at::", "memset", "memcpy")):
        return "torch"
    return "triton"


def gaps_by_kinds(kernels: list[dict], window: tuple[float, float]) -> list[tuple[str, str, int, float]]:
    """The window's stretches with no kernel running, by the kinds (launch_kind) of the kernels before and after
    each: (before, after, gaps, ms), most time first. Short gaps between kernels of one stream are the GPU's own
    launch latency (a CUDA graph keeps them); their kinds say which could be bridged (programmatic dependent launch
    works between kernels that opt in: our Triton kernels)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"], e) for e in kernels if window[0] <= e["ts"] < window[1])
    totals: dict = collections.defaultdict(lambda: [0, 0.0])
    end, prev = None, None
    for start, stop, e in spans:
        if end is not None and start > end:
            t = totals[launch_kind(prev["name"]), launch_kind(e["name"])]
            t[0] += 1
            t[1] += (start - end) / 1e3
        if end is None or stop > end:
            end, prev = stop, e
    return sorted(((b, a, n, ms) for (b, a), (n, ms) in totals.items()), key=lambda r: -r[3])


def summarize(path: str, top: int = 15) -> dict:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        raise SystemExit(f"{path}: no GPU kernels in this trace (was it taken on a CPU run?)")
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    if steps:
        window = (min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps))
    else:
        window = (min(e["ts"] for e in kernels), max(e["ts"] + e["dur"] for e in kernels))
    clip = lambda e: (max(e["ts"], window[0]), min(e["ts"] + e["dur"], window[1]))  # noqa: E731
    inside = [e for e in kernels if e["ts"] < window[1] and e["ts"] + e["dur"] > window[0]]
    is_comm = lambda e: "nccl" in e["name"].lower()  # noqa: E731
    comm = [clip(e) for e in inside if is_comm(e)]
    compute = [clip(e) for e in inside if not is_comm(e)]
    wall = window[1] - window[0]
    busy = union_length(comm + compute)
    # The op that launched each kernel: kernels and the aten op that dispatched them share an "External id".
    op_by_id = {
        e["args"]["External id"]: e["name"]
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and "External id" in e.get("args", {})
    }
    per_kernel = collections.defaultdict(lambda: [0, 0.0])
    per_group = collections.defaultdict(lambda: [0, 0.0])
    launched_by: dict = collections.defaultdict(collections.Counter)
    for e in inside:
        start, end = clip(e)
        name = short_name(e["name"])
        for table, key in ((per_kernel, name), (per_group, kernel_group(e["name"]))):
            table[key][0] += 1
            table[key][1] += end - start
        launched_by[name][op_by_id.get(e.get("args", {}).get("External id"), "?")] += 1
    launches = [
        e
        for e in events
        if e.get("ph") == "X"
        and e.get("cat") == "cuda_runtime"
        and "Launch" in str(e.get("name", ""))
        and window[0] <= e["ts"] <= window[1]
    ]
    host = host_self_times(events, window)
    return {
        "trace": path,
        "host_traced_ms": host["traced_ms"],
        "host_untraced_ms": wall / 1e3 - host["traced_ms"],
        "host_top": host["self_ms"][:top],
        "wall_ms": wall / 1e3,
        "compute_ms": union_length(compute) / 1e3,
        "nccl_ms": union_length(comm) / 1e3,
        "nccl_exposed_ms": (union_length(comm) - intersect_length(comm, compute)) / 1e3,
        "nccl_by_kind": [
            (kind, n, t / 1e3, x / 1e3)
            for kind, n, t, x in exposed_by_kind([(e["name"], clip(e)) for e in inside if is_comm(e)], compute)
        ],
        "idle_ms": (wall - busy) / 1e3,
        "kernels": len(inside),
        "launch_calls": len(launches),
        "launch_cpu_ms": sum(e["dur"] for e in launches) / 1e3,
        "groups": sorted(((g, c, t / 1e3) for g, (c, t) in per_group.items()), key=lambda r: -r[2]),
        "top": sorted(((n, c, t / 1e3) for n, (c, t) in per_kernel.items()), key=lambda r: -r[2])[:top],
        "fsdp_hooks": hook_times(events, window),
        "gaps": idle_gaps(events, inside, window, top),
        "gap_kinds": gaps_by_kinds(inside, window),
        "launched_by": {k: c.most_common(3) for k, c in launched_by.items()},
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument(
        "--groups",
        action="store_true",
        help="also print one markdown table of the kernel families (KERNEL_GROUPS) per trace, side by side: GPU ms "
        "per step and share of the step, to compare two loops (e.g. ours and mamba-ssm's) or two layouts",
    )
    ap.add_argument(
        "--launched_by",
        action="store_true",
        help="name, after each of the top kernels, the host ops that launched it (most frequent first)",
    )
    ap.add_argument(
        "--gaps",
        type=int,
        default=0,
        help="also print the N longest stretches with no kernel on the GPU, and the host op that launched the "
        "kernel ending each (where an idle GPU waited for the host)",
    )
    ap.add_argument(
        "--gap_kinds",
        action="store_true",
        help="also print the time with no kernel running by the kinds of kernel around each gap (cuBLAS, PyTorch, "
        "Triton): which launch gaps programmatic dependent launch or fewer PyTorch kernels could take",
    )
    ap.add_argument("--json", help="append one JSON line per trace (without the kernel table) to this file")
    args = ap.parse_args()
    summaries = []
    for path in args.traces:
        s = summarize(path, args.top)
        summaries.append(s)
        w = s["wall_ms"]
        print(
            f"== {path}\nstep {w:.1f} ms: compute {s['compute_ms']:.1f} ({s['compute_ms'] / w:.0%}), "
            f"nccl {s['nccl_ms']:.1f} (exposed {s['nccl_exposed_ms']:.1f}, {s['nccl_exposed_ms'] / w:.0%}), "
            f"GPU idle {s['idle_ms']:.1f} ({s['idle_ms'] / w:.0%}); {s['kernels']} kernels, "
            f"{s['launch_calls']} launch calls taking {s['launch_cpu_ms']:.1f} ms of host time"
        )
        if s["nccl_by_kind"]:
            print(
                "  NCCL by collective, exposed of its time: "
                + ", ".join(f"{k} {x:.1f} of {t:.1f} ms ({n}x)" for k, n, t, x in s["nccl_by_kind"])
            )
        for name, count, ms in s["top"]:
            ops = ", ".join(f"{op} {n}x" for op, n in s["launched_by"].get(name, []))
            print(f"  {ms:8.2f} ms {count:5d}x  {name}" + (f"  [from {ops}]" if args.launched_by else ""))
        print(
            f"host: traced ops {s['host_traced_ms']:.1f} ms; outside any traced op {s['host_untraced_ms']:.1f} ms "
            "(Python between ops: autograd glue, Triton launchers); self time of the busiest thread's ops:"
        )
        for name, ms in s["host_top"]:
            print(f"  {ms:8.2f} ms  {short_name(name)}")
        if s["fsdp_hooks"]:
            print(
                "FSDP hooks (host, inclusive): "
                + ", ".join(f"{n} {ms:.1f} ms ({c}x)" for n, c, ms in s["fsdp_hooks"] if ms >= 0.5)
            )
        if args.gaps:
            print("longest GPU idle gaps (the kernel that ended each was launched from the host op named):")
            for g in s["gaps"][: args.gaps]:
                before, after = short_name(g["before"], 60), short_name(g["after"], 60)
                print(
                    f"  {g['ms']:7.2f} ms  after {before} | before {after} | "
                    f"launched in {short_name(g['launched_by'], 60)} (inside {short_name(g['inside'], 60)})"
                )
        if args.gap_kinds:
            print("GPU idle between kernels, by the kinds of kernel before -> after:")
            for before, after, n, ms in s["gap_kinds"]:
                print(f"  {before:>6s} -> {after:<6s} {ms:7.3f} ms  {n:6d} gaps")
        if args.json:
            with open(args.json, "a") as f:
                skip = ("top", "host_top", "fsdp_hooks", "gaps", "launched_by", "gap_kinds")
                kept = {k: v for k, v in s.items() if k not in skip}
                f.write(json.dumps(kept) + "\n")
    if args.groups:
        print(groups_table(summaries))


def groups_table(summaries: list[dict], labels: list[str] | None = None) -> str:
    """Markdown: one row per kernel family, one column per trace (ms of GPU time in the step, % of its wall time),
    then the GPU idle time and the step. Families overlap only where kernels run concurrently (NCCL). Columns are
    headed by `labels`, else by each trace's folder name."""
    names = [g for g, _ in KERNEL_GROUPS] + ["other"]
    labels = labels or [os.path.basename(os.path.dirname(s["trace"])) or s["trace"] for s in summaries]
    head = "| kernels | " + " | ".join(labels)
    lines = [head + " |", "| --- |" + " --- |" * len(summaries)]
    for name in names:
        cells = []
        for s in summaries:
            ms = next((t for g, _, t in s["groups"] if g == name), 0.0)
            cells.append(f"{ms:.1f} ms ({ms / s['wall_ms']:.0%})" if ms else "-")
        if any(c != "-" for c in cells):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        "| GPU idle | "
        + " | ".join(f"{s['idle_ms']:.1f} ms ({s['idle_ms'] / s['wall_ms']:.0%})" for s in summaries)
        + " |"
    )
    lines.append("| step | " + " | ".join(f"{s['wall_ms']:.1f} ms" for s in summaries) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
