"""Nsight Compute's CSV (its long "details" form) as one markdown table: a row per kernel, a column per metric.

    /usr/local/cuda/bin/ncu --profile-from-start off --csv --kernel-name regex:"chunk_scan|chained|dcb" \\
        --metrics gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,\\
regex:sm__pipe_.*_cycles_active\\.avg\\.pct_of_peak_sustained_active \\
        python3 benchmarks/ncu_ssd.py --shape 1.3b --seq > ncu.csv
    python3 benchmarks/ncu_table.py ncu.csv [--metrics issue,pipe_fma] [--top 3]

ncu prints one line per (launch, metric) after a header naming its columns ("ID", "Kernel Name", "Metric Name",
"Metric Unit", "Metric Value", ...; lines before the header, such as ncu's own "==PROF==" lines and the program's
output, are skipped). Launches of one kernel (the chained forward runs twice per forward + backward, in the forward
and the backward's recompute) are averaged. A kernel's name is cut at its first "(" or "<". --metrics keeps the
metrics whose name contains one of the comma-separated parts (a substring: "issue_active" also keeps every
"..._per_issue_active.ratio" stall metric, so give a metric's full prefix, "smsp__issue_active", to keep it
alone); --top N shows, for each kernel, its N largest values among the metrics of one family instead of every
column (e.g. the busiest pipes, or the largest stall reasons: --metrics pipe_ --top 3).
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import defaultdict


def read_ncu_csv(text: str) -> dict[str, dict[str, float]]:
    """{kernel: {metric (with its unit): mean value over the kernel's launches}} from ncu's --csv output."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError('no ncu CSV header (a line starting with "ID") in the input: was ncu run with --csv?')
    rows = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    missing = {"Kernel Name", "Metric Name", "Metric Value"} - set(rows.fieldnames or ())
    if missing:
        raise ValueError(f"ncu CSV without the columns {sorted(missing)}: expected the details page (ncu --csv)")
    sums: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        try:
            value = float(row["Metric Value"].replace(",", ""))
        except ValueError:  # a text value (e.g. a rule's message): not a number to tabulate
            continue
        kernel = row["Kernel Name"].split("(")[0].split("<")[0].strip()
        unit = (row.get("Metric Unit") or "").strip()
        name = row["Metric Name"] + (f" ({unit})" if unit else "")
        sums[kernel][name].append(value)
    return {k: {m: sum(v) / len(v) for m, v in metrics.items()} for k, metrics in sums.items()}


def markdown(table: dict[str, dict[str, float]], keep: list[str] | None = None, top: int = 0) -> str:
    """The table as markdown: every (kept) metric a column, or with top > 0 each kernel's `top` largest values."""
    kept = {k: {m: v for m, v in ms.items() if not keep or any(p in m for p in keep)} for k, ms in table.items()}
    if top > 0:
        out = ["| kernel | largest |", "| --- | --- |"]
        for kernel, ms in kept.items():
            best = sorted(ms.items(), key=lambda kv: -kv[1])[:top]
            out.append(f"| {kernel} | " + ", ".join(f"{m} {v:.3g}" for m, v in best) + " |")
        return "\n".join(out)
    columns = sorted({m for ms in kept.values() for m in ms})
    out = ["| kernel | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
    for kernel, ms in kept.items():
        out.append(f"| {kernel} | " + " | ".join(f"{ms[c]:.3g}" if c in ms else "" for c in columns) + " |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --csv output (a file, or - for standard input)")
    ap.add_argument("--metrics", default="", help="keep metrics whose name contains one of these (comma-separated)")
    ap.add_argument("--top", type=int, default=0, help="per kernel, only its N largest kept values")
    args = ap.parse_args(argv)
    if args.top < 0:
        ap.error(f"--top {args.top}: give N >= 1 for each kernel's N largest values, or 0 for every column")
    try:
        text = sys.stdin.read() if args.csv == "-" else open(args.csv).read()
    except OSError as e:
        ap.error(f"cannot read {args.csv} ({e.strerror}): give the file ncu --csv wrote, or - for standard input")
    try:
        table = read_ncu_csv(text)
    except ValueError as e:
        ap.error(f"{args.csv}: {e}")
    print(markdown(table, [p for p in args.metrics.split(",") if p], args.top))


if __name__ == "__main__":
    main()
