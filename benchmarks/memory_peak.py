"""What CUDA memory holds at its peak, from a snapshot of the allocator's history (profiling.enable_memory_snapshot).

    python3 train.py --job.config_file configs/mamba2_1.3b.toml --training.steps 3 \
        --profiling.enable_memory_snapshot true --profiling.profile_steps '[2]'
    python3 benchmarks/memory_peak.py outputs/mamba2_1.3b/memory_snapshot/iteration_2/rank0_memory_snapshot.pickle

The snapshot's event history (`device_traces`, the last profiling.memory_snapshot_max_entries allocator events) is
replayed from the allocated total it must have started from (the blocks live at the dump minus the history's net
change), and at the moment the allocated total peaks, the live blocks are grouped by where they were allocated:
the innermost stack frame in this repository (file:line function), or the innermost frame at all when none is
ours. Blocks allocated before the history begins (parameters, optimizer states of long-running jobs) cannot be
attributed and form one "before the history" row. Prints the groups largest first with their sizes in GiB and
counts, and the same totals per tensor size (the largest blocks), which is how activations kept for the backward
show up (48 layers' worth of one shape). torch.cuda.max_memory_allocated is the peak of the same counter.
"""

from __future__ import annotations

import argparse
import os
import pickle
from collections import defaultdict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = float(2**30)
BEFORE = "(allocated before the history)"


def _where(frames: list[dict], repo: str) -> str:
    """The innermost frame in the repository ('path:line function'), else the innermost frame, else '?'."""
    for f in frames:
        name = f.get("filename", "")
        if name.startswith(repo) and "/.gpu/" not in name:
            return f"{os.path.relpath(name, repo)}:{f.get('line', '?')} {f.get('name', '?')}"
    if frames:
        f = frames[0]
        return f"{os.path.basename(f.get('filename', '?'))}:{f.get('line', '?')} {f.get('name', '?')}"
    return "?"


def peak_composition(snapshot: dict, device: int = 0, repo: str = REPO) -> dict:
    """Replays one device's history: {'peak': bytes, 'start': bytes, 'end': bytes, 'events': n,
    'groups': {where: [bytes, count]}, 'sizes': {size: [bytes, count]}} at the (first) peak."""
    traces = snapshot["device_traces"][device]
    end = sum(
        b["size"]
        for seg in snapshot["segments"]
        if seg.get("device", device) == device
        for b in seg["blocks"]
        if b["state"] == "active_allocated"
    )
    net = 0
    for e in traces:
        if e["action"] == "alloc":
            net += e["size"]
        elif e["action"] == "free_completed":
            net -= e["size"]
    start = end - net
    # First pass: where the total peaks.
    total, peak, peak_at = start, start, -1
    for i, e in enumerate(traces):
        if e["action"] == "alloc":
            total += e["size"]
        elif e["action"] == "free_completed":
            total -= e["size"]
        else:
            continue
        if total > peak:
            peak, peak_at = total, i
    # Second pass: the blocks live at that moment.
    live: dict[int, tuple[int, list]] = {}
    before = start
    for e in traces[: peak_at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames", []))
        elif e["action"] == "free_completed":
            if live.pop(e["addr"], None) is None:
                before -= e["size"]  # a block from before the history
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    sizes: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    if before:
        groups[BEFORE] = [before, 0]
    for size, frames in live.values():
        g = groups[_where(frames, repo)]
        g[0] += size
        g[1] += 1
        s = sizes[size]
        s[0] += size
        s[1] += 1
    return {"peak": peak, "start": start, "end": end, "events": len(traces), "groups": groups, "sizes": sizes}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", help="a rank<r>_memory_snapshot.pickle")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--top", type=int, default=25, help="rows per table")
    p.add_argument("--repo", default=REPO, help="frames under this folder are 'ours' (default: this checkout)")
    args = p.parse_args(argv)
    with open(args.snapshot, "rb") as f:
        snap = pickle.load(f)
    r = peak_composition(snap, args.device, os.path.abspath(args.repo))
    print(
        f"peak {r['peak'] / GiB:.2f} GiB allocated ({r['events']} events replayed; {r['start'] / GiB:.2f} GiB when the "
        f"history begins, {r['end'] / GiB:.2f} GiB at the dump)"
    )
    print("\n| allocated at | GiB at the peak | blocks |\n| --- | --- | --- |")
    for where, (nbytes, count) in sorted(r["groups"].items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"| {where} | {nbytes / GiB:.3f} | {count or '-'} |")
    print("\n| block size (MiB) | GiB at the peak | blocks |\n| --- | --- | --- |")
    for size, (nbytes, count) in sorted(r["sizes"].items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"| {size / 2**20:.2f} | {nbytes / GiB:.3f} | {count} |")


if __name__ == "__main__":
    main()
