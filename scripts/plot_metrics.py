"""Draws one or several runs' metrics.jsonl into one PNG: a panel per metric, the runs overlaid.

    python scripts/plot_metrics.py outputs/a [outputs/b/metrics.jsonl ...] --labels a,b --out plot.png \
        [--metrics loss,val_loss,lr,grad_norm,tokens_per_sec] [--smooth N] [--x step|time]

Each input is a metrics.jsonl or the run folder (job.dump_folder) holding it. Invariants of what is drawn:
- one point per step, the last record of a step winning (a resumed run appends the steps it repeats again);
- non-finite values (a skipped step's grad_norm) are left out of the lines; skipped steps get a dotted vertical
  line in their run's colour on every panel instead;
- a panel no run has data for is left out, unless --metrics asked for it (then that is an error).
Needs only numpy and matplotlib (Agg: no display), not the trainer's packages.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from datetime import datetime

import numpy as np
from matplotlib.figure import Figure  # no pyplot: no global figure state and no GUI backend (headless)

DEFAULT_METRICS = ("loss", "val_loss", "lr", "grad_norm", "tokens_per_sec", "moe_max_load_ratio")
TITLES = {
    "loss": "training loss",
    "val_loss": "validation loss",
    "val_ppl": "validation perplexity",
    "lr": "learning rate",
    "grad_norm": "gradient norm (before clipping)",
    "tokens_per_sec": "tokens/s per device",
    "mfu": "MFU",
    "memory_gib": "memory (GiB)",
    "moe_max_load_ratio": "MoE busiest expert / mean load",
}
PANEL_INCHES = (6.4, 3.4)  # (width, height) of one panel
LINESTYLES = ("-", "--", "-.", ":")  # runs that agree (two layouts of one job) overlap: keep each one visible


class PlotError(ValueError):
    """Bad input, with its fix; the command line prints it and exits non-zero."""


def metrics_file(path: str) -> str:
    """The metrics.jsonl a command-line argument names: the file itself, or <folder>/metrics.jsonl."""
    if os.path.isdir(path):
        inner = os.path.join(path, "metrics.jsonl")
        if not os.path.isfile(inner):
            raise PlotError(
                f"{path} is a folder without metrics.jsonl; pass a run's job.dump_folder (written by a "
                "run with metrics.save_jsonl true) or the metrics.jsonl file itself"
            )
        return inner
    if not os.path.isfile(path):
        raise PlotError(f"{path}: no such file or folder; pass a metrics.jsonl or the run folder holding it")
    return path


def read_records(path: str) -> list[dict]:
    """Every record of a metrics.jsonl, in file order (json accepts the NaN / Infinity a skipped step writes)."""
    records = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise PlotError(
                    f"{path}:{line_no} is not JSON ({e.msg}); metrics.jsonl holds one JSON object per "
                    "line: remove or repair that line"
                ) from e
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise PlotError(f"{path}:{line_no} has no integer 'step'; is this a mambatitan metrics.jsonl?")
            records.append(record)
    if not records:
        raise PlotError(f"{path} is empty: the run has logged no step yet; wait for its first log_freq step")
    return records


def last_record_per_step(records: list[dict]) -> list[dict]:
    """One record per step, sorted by step; where a step repeats (a resumed run), the last record wins."""
    by_step = {r["step"]: r for r in records}
    return [by_step[s] for s in sorted(by_step)]


def wall_seconds(records: list[dict]) -> list[float] | None:
    """Seconds since the first record, from 'time' (a Unix time or ISO string: also right across resumes) or
    else 'elapsed_s'; None when the records carry neither."""
    if all("time" in r for r in records):
        t = [
            datetime.fromisoformat(r["time"]).timestamp() if isinstance(r["time"], str) else float(r["time"])
            for r in records
        ]
        return [x - t[0] for x in t]
    if all("elapsed_s" in r for r in records):
        return [float(r["elapsed_s"]) for r in records]
    return None


def trailing_mean(y: np.ndarray, window: int) -> np.ndarray:
    """Mean of each point and the window - 1 before it (fewer at the start): no point sees later steps."""
    csum = np.cumsum(np.insert(y, 0, 0.0))
    idx = np.arange(1, len(y) + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def make_figure(
    runs: list[tuple[str, list[dict]]],
    metrics: list[str] | None = None,
    smooth: int = 1,
    x: str = "step",
    title: str = "",
    dpi: int = 100,
) -> Figure:
    """One panel per metric with every run overlaid. runs: (label, records) with records as read_records gives.

    metrics None: DEFAULT_METRICS that some run has. A data line's gid is "<label>:<metric>" (its points are the
    run's last-record-wins series); with smooth > 1 that line is drawn faint and "<label>:<metric>:smoothed" on top.
    """
    if smooth < 1:
        raise PlotError(f"--smooth {smooth} must be >= 1 (1 = no smoothing)")
    if x not in ("step", "time"):
        raise PlotError(f"--x {x} must be step or time")
    runs = [(label, last_record_per_step(records)) for label, records in runs]
    present = {k for _, recs in runs for r in recs for k, v in r.items() if _is_number(v) and k != "step"}
    if metrics is None:
        metrics = [m for m in DEFAULT_METRICS if m in present]
    else:
        missing = [m for m in metrics if m not in present]
        if missing:
            raise PlotError(f"no run has {missing}; these runs log {sorted(present)}")
    if not metrics:
        raise PlotError(f"none of {list(DEFAULT_METRICS)} is in these runs; name some with --metrics")
    xs = {}
    for label, recs in runs:
        xs[label] = [r["step"] for r in recs] if x == "step" else wall_seconds(recs)
        if xs[label] is None:
            raise PlotError(
                f"--x time needs a 'time' or 'elapsed_s' field in every record, which run {label!r} "
                "lacks (written by newer trainers); use --x step"
            )

    ncols = 1 if len(metrics) == 1 else 2
    nrows = math.ceil(len(metrics) / ncols)
    fig = Figure(figsize=(PANEL_INCHES[0] * ncols, PANEL_INCHES[1] * nrows), dpi=dpi, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(metrics) :]:
        ax.remove()
    for ax, metric in zip(axes, metrics):
        for i, (label, recs) in enumerate(runs):
            color, style = f"C{i}", LINESTYLES[i % len(LINESTYLES)]
            points = [
                (xv, r[metric])
                for xv, r in zip(xs[label], recs)
                if _is_number(r.get(metric)) and math.isfinite(r[metric])
            ]
            if points:
                px, py = (np.array(v, dtype=float) for v in zip(*points))
                ax.plot(
                    px,
                    py,
                    color=color,
                    linestyle=style,
                    label=label,
                    gid=f"{label}:{metric}",
                    alpha=0.3 if smooth > 1 else 1.0,
                    marker="o" if len(px) == 1 else None,
                )
                if smooth > 1:
                    ax.plot(
                        px, trailing_mean(py, smooth), color=color, linestyle=style, gid=f"{label}:{metric}:smoothed"
                    )
            for xv, r in zip(xs[label], recs):
                if r.get("skipped"):
                    ax.axvline(xv, color=color, linestyle=":", linewidth=0.8, gid=f"{label}:skipped")
        ax.set_title(TITLES.get(metric, metric) + (f" (mean of {smooth})" if smooth > 1 else ""), fontsize=10)
        ax.set_xlabel("step" if x == "step" else "wall time (s)")
        ax.grid(alpha=0.3)
    if len(runs) > 1:
        axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return fig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("runs", nargs="+", help="metrics.jsonl files or run folders (job.dump_folder); overlaid")
    p.add_argument("--labels", default="", help="comma-separated legend names, one per run (default: folder names)")
    p.add_argument("--out", default="metrics.png", help="the PNG to write")
    p.add_argument(
        "--metrics",
        default="",
        help="comma-separated panels (default: "
        + ",".join(DEFAULT_METRICS)
        + ", those present); any numeric field works, e.g. val_ppl, mfu, memory_gib",
    )
    p.add_argument("--smooth", type=int, default=1, help="trailing mean over N logged points, drawn over the raw line")
    p.add_argument(
        "--x",
        choices=("step", "time"),
        default="step",
        help="x axis: training step, or wall-clock seconds (needs 'time' or 'elapsed_s' records)",
    )
    p.add_argument("--title", default="", help="figure title")
    p.add_argument("--dpi", type=int, default=100, help="pixels per inch; a panel is 6.4 x 3.4 inches")
    return p.parse_args(argv)


def default_labels(files: list[str]) -> list[str]:
    """Each run's folder name; the full path where two runs share a folder name."""
    names = [os.path.basename(os.path.dirname(os.path.abspath(f))) for f in files]
    return [n if names.count(n) == 1 else f for n, f in zip(names, files)]


def main(argv: list[str] | None = None) -> Figure:
    """Reads the runs, writes --out, returns the figure (for tests); bad input exits naming the problem."""
    args = parse_args(argv)
    try:
        files = [metrics_file(p) for p in args.runs]
        labels = [s.strip() for s in args.labels.split(",")] if args.labels else default_labels(files)
        if len(labels) != len(files):
            raise PlotError(f"--labels names {len(labels)} runs but {len(files)} were given; give one label per run")
        if len(set(labels)) != len(labels):
            raise PlotError(f"--labels {args.labels} repeats a name; give each run its own")
        metrics = [m.strip() for m in args.metrics.split(",")] if args.metrics else None
        fig = make_figure(
            [(lb, read_records(f)) for lb, f in zip(labels, files)], metrics, args.smooth, args.x, args.title, args.dpi
        )
    except PlotError as e:
        sys.exit(f"plot_metrics: {e}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out)  # no bbox_inches="tight": the PNG is exactly figsize x dpi pixels
    print(f"wrote {args.out}")
    return fig


if __name__ == "__main__":
    main()
