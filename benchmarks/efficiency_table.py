"""The multi-GPU efficiency table: each layout's tokens/s per GPU against one GPU running the same model.

    python3 benchmarks/efficiency_table.py OUT/efficiency [OUT/efficiency/rep2 ...] \\
        --row "FSDP2 1.3B=fsdp2_1.3b:1gpu_1.3b:0.90" --row "CP2 32k=cp2_32k:cp1_32k:0.75:0.55" \\
        [--skip 3] [--json t.json]

A row is LABEL=RUN:REF:TARGET[:MEMORY_TARGET], RUN and REF being run folders (with metrics.jsonl) under the first
argument. Several folders (multi_gpu.sh's EFF_REPEAT: the same runs repeated, each row next to its own reference): the
row's ratio is the median of the per-folder ratios, its range printed beside it (host-bound rows move by 20-40% between
runs on some hosts, docs/multi_gpu_sessions.md session 29), the tok/s columns the medians. Per GPU tokens/s is the
median over the steps after --skip (warm-up, autotuning; and up to --until) of what train.py logs (tokens this rank's
data-parallel replica processed / pp stages, per second). ratio = run / ref; memory ratio = run's peak memory per GPU /
ref's. A row passes when ratio >= TARGET (and memory ratio <= MEMORY_TARGET when given). For pipeline rows give TARGET
as 0.9 x (1 - textbook bubble), and --bubble RUN=TEXTBOOK (e.g. pp2_1f1b=0.111, (p-1)/(v*m+p-1)): the row then also
needs its measured bubble, 1 - ratio (the share of one GPU's throughput the pipeline loses), within --bubble_points
(0.05) of the textbook. Exit status 1 when a row fails or a run is missing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def run_figures(folder: Path, skip: int, until: int = 0) -> dict | None:
    """Median tokens/s per GPU over the steps after `skip` (up to `until` when > 0: profiled steps at the end stay
    out), peak memory and last loss of one run, or None if it did not log."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    timed = [r for r in records if r["step"] > skip and (until <= 0 or r["step"] <= until)]
    if not timed:
        return None
    return {
        "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in timed),
        "memory_gib": max(r["memory_gib"] for r in records),
        "steps": len(records),
        "final_loss": records[-1]["loss"],
    }


def parse_row(spec: str) -> dict:
    label, _, rest = spec.partition("=")
    parts = rest.split(":")
    if not label or len(parts) not in (3, 4):
        raise SystemExit(f"--row {spec!r}: expected LABEL=RUN:REF:TARGET[:MEMORY_TARGET]")
    return {
        "label": label,
        "run": parts[0],
        "ref": parts[1],
        "target": float(parts[2]),
        "memory_target": float(parts[3]) if len(parts) == 4 else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="+", help="the folder holding the run folders (several: repeats of the same runs)")
    p.add_argument("--row", action="append", default=[], help="LABEL=RUN:REF:TARGET[:MEMORY_TARGET]")
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--until", type=int, default=0, help="last step to count (0: all; leaves profiled steps out)")
    p.add_argument("--bubble", action="append", default=[], help="RUN=TEXTBOOK bubble of a pipeline row's run")
    p.add_argument("--bubble_points", type=float, default=0.05, help="allowed |measured - textbook| bubble")
    p.add_argument("--json")
    a = p.parse_args(argv)
    textbook = {run: float(b) for run, _, b in (spec.partition("=") for spec in a.bubble)}
    bubble_lines = []
    rows, failed = [], False
    print("| layout | tok/s per GPU | 1 GPU | ratio | target | memory per GPU | vs 1 GPU | |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for spec in a.row:
        row = parse_row(spec)
        pairs = [
            (run_figures(Path(out) / row["run"], a.skip, a.until), run_figures(Path(out) / row["ref"], a.skip, a.until))
            for out in a.out
        ]
        present = [(run, ref) for run, ref in pairs if run is not None and ref is not None]
        if not present:
            run, ref = pairs[0]
            print(
                f"| {row['label']} | missing ({row['run'] if run is None else row['ref']} logged no timed step) "
                "| | | | | | FAIL |"
            )
            failed = True
            continue
        ratios = [run["tokens_per_sec"] / ref["tokens_per_sec"] for run, ref in present]
        ratio = statistics.median(ratios)
        run = dict(present[0][0], tokens_per_sec=statistics.median(r["tokens_per_sec"] for r, _ in present))
        ref = dict(present[0][1], tokens_per_sec=statistics.median(r["tokens_per_sec"] for _, r in present))
        mem_ratio = run["memory_gib"] / ref["memory_gib"]
        spread = f" ({min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} pairs)" if len(a.out) > 1 else ""
        ok = ratio >= row["target"] and (row["memory_target"] is None or mem_ratio <= row["memory_target"])
        bubble = None
        if row["run"] in textbook:  # pipeline: the measured bubble against the schedule's textbook one
            bubble = {"measured": 1 - ratio, "textbook": textbook[row["run"]]}
            bubble["ok"] = abs(bubble["measured"] - bubble["textbook"]) <= a.bubble_points
            ok &= bubble["ok"]
            verdict = "within" if bubble["ok"] else "NOT within"
            bubble_lines.append(
                f"{row['label']}: bubble {bubble['measured']:.1%} (1 - ratio) against the textbook "
                f"{bubble['textbook']:.1%}: {verdict} {a.bubble_points * 100:.0f} points"
            )
        failed |= not ok
        mem_target = f" (<= {row['memory_target']:.2f})" if row["memory_target"] is not None else ""
        print(
            f"| {row['label']} | {run['tokens_per_sec'] / 1e3:.1f}k | {ref['tokens_per_sec'] / 1e3:.1f}k | "
            f"{ratio:.2f}{spread} | {row['target']:.2f} | {run['memory_gib']:.1f} GiB | {mem_ratio:.2f}{mem_target} | "
            f"{'ok' if ok else 'FAIL'} |"
        )
        rows.append(
            {
                **row,
                "ratio": ratio,
                "ratios": ratios,
                "memory_ratio": mem_ratio,
                "ok": ok,
                "run_figures": run,
                "ref_figures": ref,
            }
            | ({"bubble": bubble} if bubble else {})
        )
    for line in bubble_lines:
        print(line)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
