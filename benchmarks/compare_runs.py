"""Summarise several training runs' metrics.jsonl against a reference run (GPU parity and scaling tables).

    python benchmarks/compare_runs.py --ref OUT/1gpu OUT/fsdp2 OUT/fsdp4 [--skip 3] [--rtol 0.02] [--json out.json]

For each run: the largest relative loss difference from the reference over the common steps, mean tokens/s per
device and mean MFU over the steps after --skip (warm-up, autotuning), and peak memory. Exit status 1 when a run
differs by more than --rtol (bf16 runs on different layouts agree to about 1e-2, not bitwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read(run: str) -> dict[int, dict]:
    path = Path(run) / "metrics.jsonl"
    if not path.exists():
        return {}
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


def summarise(ref: dict[int, dict], run: dict[int, dict], skip: int) -> dict:
    common = sorted(set(ref) & set(run))
    rel = [abs(run[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in common]
    timed = [run[s] for s in sorted(run) if s > skip]
    mean = (lambda key: sum(r[key] for r in timed) / len(timed)) if timed else (lambda key: float("nan"))
    return {
        "steps": len(run),
        "max_rel_loss_diff": max(rel) if rel else float("nan"),
        "final_loss": run[max(run)]["loss"] if run else float("nan"),
        "tokens_per_sec_per_device": mean("tokens_per_sec"),
        "mfu": mean("mfu"),
        "memory_gib": max((r["memory_gib"] for r in run.values()), default=float("nan")),
        "moe_max_load_ratio": timed[-1].get("moe_max_load_ratio") if timed else None,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref", required=True)
    p.add_argument("runs", nargs="*")
    p.add_argument("--skip", type=int, default=3)
    p.add_argument("--rtol", type=float, default=0.02)
    p.add_argument("--json")
    a = p.parse_args(argv)
    ref = read(a.ref)
    rows = {run: summarise(ref, read(run), a.skip) for run in [a.ref, *a.runs]}
    print(
        f"{'run':<40} {'steps':>5} {'max rel dloss':>13} {'final loss':>10} {'tok/s/dev':>10} {'mfu':>6} {'mem GiB':>8}"
    )
    for run, r in rows.items():
        print(
            f"{Path(run).name:<40} {r['steps']:>5} {r['max_rel_loss_diff']:>13.2e} {r['final_loss']:>10.4f} "
            f"{r['tokens_per_sec_per_device']:>10,.0f} {100 * r['mfu']:>5.1f}% {r['memory_gib']:>8.2f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    bad = [run for run, r in rows.items() if not r["max_rel_loss_diff"] <= a.rtol]
    if bad:
        print("differs from the reference by more than rtol (or missing):", ", ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
