"""Pipeline step time and bubble fraction per schedule.

    torchrun --nproc_per_node 2 benchmarks/pp_bubble.py --flavor 370M --seq_len 2048 --microbatches 8
    torchrun --nproc_per_node 2 benchmarks/pp_bubble.py --flavor debug --seq_len 128 --steps 3   # CPU smoke run
    torchrun --nproc_per_node 2 benchmarks/pp_bubble.py --flavor 1.3B --seq_len 4096 --microbatches 8 \
        --schedules 1F1B,Interleaved1F1B --head_weight -1       # the LM head weighted into the split

For every schedule: the median step time of schedule.step over --steps steps (after one warm-up step), and the
bubble fraction 1 - compute / step, where `compute` is the time this rank needs to run the forward and backward of
all its stages for every microbatch back to back, without any pipeline (same shapes, no communication). The slowest
rank's values are reported, next to the textbook bubble (p-1)/(v*m+p-1) for p ranks, v stages per rank and m
microbatches; for ZBVZeroBubble 0 (its aim when forward, input-gradient and weight-gradient steps take equal time;
it splits the backward in two, which itself costs time). Rank 0 prints one line per schedule and, with --json, appends
the records to that file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs.job_config import JobConfig
from models import build_model_args, build_model_on_meta
from models.init import init_weights
from parallelisms.mesh import ParallelDims
from parallelisms.pipeline import SCHEDULES, pipeline_model, validate_pipeline


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_only_time(parts, first_ids, last_ids, n_mb, tokens_mb, device, dtype) -> float:
    """Seconds for forward + backward of every local stage on n_mb microbatches, back to back, no pipeline."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n_mb):
        for part, is_first, is_last in zip(parts, first_ids, last_ids):
            if is_first:
                x = tokens_mb
            else:
                d = part.args.d_model
                shape = (2, *tokens_mb.shape, d) if part.pack_format == "stack" else (*tokens_mb.shape, d)
                x = torch.randn(shape, device=device, dtype=torch.float32, requires_grad=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                out = part(x)
            if is_last:
                F.cross_entropy(out.flatten(0, 1).float(), tokens_mb.flatten()).backward()
            else:
                out.backward(torch.randn_like(out))
    sync(device)
    return time.perf_counter() - t0


def textbook_bubble(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> float:
    """Idle fraction of an ideal pipeline: (p-1)/(v*m+p-1) for GPipe / 1F1B / interleaved; 0 for ZB-V."""
    if schedule == "ZBVZeroBubble":
        return 0.0
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--n_layers", type=int, default=0, help="override the flavor's layer count")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--microbatch_size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--pack", default="sum", choices=("sum", "stack"))
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="CPU always uses float32")
    ap.add_argument("--json", default="", help="append the records to this JSON-lines file (rank 0)")
    ap.add_argument(
        "--head_weight", type=float, default=0.0,
        help="parallelism.pipeline_parallel_head_weight: the LM head + loss as this many layers more when splitting "
        "(-1: estimated from the FLOPs, ~3.7 at the 1.3B's width and vocabulary)",
    )  # fmt: skip
    a = ap.parse_args()

    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world < 2:
        sys.exit("run under torchrun with at least 2 processes (one pipeline rank each)")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dtype = torch.bfloat16 if device.type == "cuda" and a.dtype == "bfloat16" else torch.float32
    overrides = {"tie_embeddings": False, **({"n_layers": a.n_layers} if a.n_layers else {})}
    model_args = build_model_args(a.flavor, overrides)
    pdims = ParallelDims(pp=world, dp_replicate=1, dp_shard=1, cp=1, ep=1, world_size=world)
    mesh = pdims.build_mesh(device.type)
    rows = a.microbatches * a.microbatch_size
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model_args.vocab_size, (rows, a.seq_len), generator=g).to(device)
    seq_idx = torch.zeros(rows, a.seq_len, dtype=torch.int32, device=device)
    n_tokens = float(tokens.numel())

    def loss_fn(logits_BSV, labels_BS):
        return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten(0, 1), reduction="sum") / n_tokens

    for name in a.schedules.split(","):
        cfg = JobConfig()
        cfg.training.global_batch_size, cfg.training.seq_len = rows, a.seq_len
        p = cfg.parallelism
        p.pipeline_parallel_degree, p.pipeline_parallel_schedule = world, name
        p.pipeline_parallel_microbatch_size, p.pipeline_parallel_pack = a.microbatch_size, a.pack
        p.pipeline_parallel_head_weight = a.head_weight
        model = build_model_on_meta(model_args)
        errs = validate_pipeline(cfg, pdims, model_args, a.microbatches)
        if errs:
            if rank == 0:
                print(f"{name}: skipped ({'; '.join(errs)})", flush=True)
            continue
        schedule, parts, has_first, has_last = pipeline_model(
            model, mesh, pdims, cfg, device, loss_fn, lambda part: part, a.microbatches
        )
        for part in parts:
            part.to_empty(device=device)
            init_weights(part, seed=0, init_std=model_args.initializer_range)
            part.train()
        times = []
        for step in range(a.steps + 1):
            sync(device)
            t0 = time.perf_counter()
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                target, losses = (tokens, []) if has_last else (None, None)
                if has_first:
                    schedule.step(tokens, seq_idx=seq_idx, target=target, losses=losses)
                else:
                    schedule.step(seq_idx=seq_idx, target=target, losses=losses)
            sync(device)
            dist.barrier()
            if step:  # step 0 also infers the inter-stage shapes
                times.append(time.perf_counter() - t0)
            for part in parts:
                part.zero_grad(set_to_none=True)
        step_s = statistics.median(times)
        firsts = [part.tok_embeddings is not None for part in parts]
        lasts = [part.lm_head is not None for part in parts]
        mb = tokens[: a.microbatch_size]
        compute_only_time(parts, firsts, lasts, 1, mb, device, dtype)  # warm-up
        compute_s = compute_only_time(parts, firsts, lasts, a.microbatches, mb, device, dtype)
        mine = torch.tensor([step_s, 1.0 - compute_s / step_s, compute_s], dtype=torch.float64, device=device)
        gathered = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine)
        if rank == 0:
            v = len(parts)
            worst = max(gathered, key=lambda t: t[1].item())
            rec = dict(
                schedule=name,
                pp=world,
                stages_per_rank=v,
                microbatches=a.microbatches,
                microbatch_size=a.microbatch_size,
                seq_len=a.seq_len,
                flavor=a.flavor,
                head_weight=a.head_weight,
                layers_per_stage=[len(part.layers) for part in parts],
                step_s=float(worst[0]),
                bubble=float(worst[1]),
                compute_s=float(worst[2]),
                textbook_bubble=textbook_bubble(name, world, v, a.microbatches),
                device=str(device),
            )
            print(
                f"{name:>22}: step {rec['step_s'] * 1e3:9.1f} ms  bubble {rec['bubble']:6.1%}  "
                f"(textbook {rec['textbook_bubble']:6.1%}, {v} stage(s)/rank; rank 0's layers per stage "
                f"{rec['layers_per_stage']})",
                flush=True,
            )
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(rec) + "\n")
        del schedule, parts
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
