"""Host cost of an expert-parallel training step on the CPU: EP over `--ep` gloo processes, the hybrid MoE 1B
layer pattern at a tiny width, built as train.py builds it (expert parallel, then FSDP, meta init).

    python3 benchmarks/ep_host_cost.py                    # EP2, the experts' grouped-GEMM path (as on GPUs)
    python3 benchmarks/ep_host_cost.py --loop --profile 25

What it prints per forward + backward, each rank (the optimizer is left out: the MoE work is all in forward and
backward): the median wall time; the least CPU time of the main thread over the steps, less the CPU time inside the
all-to-alls (what the host spends, without gloo's work, its waiting for the other rank or other processes of a
shared machine; the backward runs on this thread for CPU tensors; FSDP's collectives stay in); Python calls
(cProfile); torch ops reaching the dispatcher below autograd (a TorchDispatchMode: every aten op of forward and
backward, on DTensors their local ops not counted); host reads of device values (Tensor.tolist / item: one per MoE
layer is the dropless all-to-all's split sizes) and other ops that sync on CUDA (SYNCING_OPS). On the CPU the
experts' grouped-GEMM path (`torch._grouped_mm`, the CUDA path for bf16) runs through torch's CPU fallback unless
--loop, so that the op counts are those of the GPU path. CPU timings show neither a GPU's launch cost nor the
overlap of a device -> host copy; the op and call counts are what carry over.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = dict(d_model=64, headdim=16, d_state=16, chunk_size=16, vocab_size=258, n_heads=4, n_kv_heads=2)
TINY.update(moe_hidden_dim=32, mlp_hidden_dim=64)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flavor", default="hybrid_moe_1B")
    ap.add_argument("--pattern", default="", help="model.layer_pattern instead of the flavor's (e.g. 15 x E: MoE only)")
    ap.add_argument("--ep", type=int, default=2, help="processes = ep (ep = dp_shard: one replica per expert)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10, help="timed steps, after 3 untimed")
    ap.add_argument("--loop", action="store_true", help="the experts' per-expert loop (the CPU default)")
    ap.add_argument("--param-dtype", default="bfloat16", help="FSDP's param_dtype (bfloat16 as on GPUs)")
    ap.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions (rank 0)")
    ap.add_argument("--dump", default="", help="write rank 0's cProfile stats (pstats) to this file")
    return ap.parse_args(argv)


# aten ops that read device values on the host on CUDA (a stream sync each): bincount reads the min / max of its
# input, nonzero / masked_select / unique their output sizes, repeat_interleave without output_size its total
SYNCING_OPS = ("bincount", "_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive")


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched below autograd, and those of SYNCING_OPS."""

    def __init__(self):
        super().__init__()
        self.n = 0
        self.syncing = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        name = func.overloadpacket.__name__
        self.syncing += name in SYNCING_OPS or (name == "repeat_interleave" and "output_size" not in (kwargs or {}))
        return func(*args, **(kwargs or {}))


def _rank_main(rank: int, world: int, a: argparse.Namespace) -> dict:
    import torch.distributed as dist

    from configs.job_config import Parallelism
    from models import build_model_args, build_model_on_meta
    from models.hybrid.moe import GroupedExperts, MoE
    from models.init import init_weights
    from parallelisms.expert_parallel import apply_expert_parallel
    from parallelisms.fsdp import apply_fsdp
    from parallelisms.mesh import ParallelDims

    if not a.loop:  # the CUDA path's op structure, through torch's CPU fallback of _grouped_mm
        GroupedExperts._use_grouped_mm = lambda self, x: True
    overrides = dict(TINY, moe_load_balance_coeff=0.0, **({"layer_pattern": a.pattern} if a.pattern else {}))
    args = build_model_args(a.flavor, overrides)
    pdims = ParallelDims(pp=1, dp_replicate=1, dp_shard=world, cp=1, ep=a.ep, world_size=world)
    mesh = pdims.build_mesh("cpu")
    model = build_model_on_meta(args)
    apply_expert_parallel(model, pdims)
    apply_fsdp(model, mesh, Parallelism(), param_dtype=getattr(torch, a.param_dtype), pdims=pdims)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    n_moe = sum(isinstance(m, MoE) for m in model.modules())
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, args.vocab_size, (a.rows, a.seq), generator=g)

    def step():
        model(ids, labels=ids).backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(3):
        step()
    a2a_cpu = [0.0]  # CPU time inside the all-to-alls (gloo's work and its waiting for the other rank), left out
    all_to_all_single = dist.all_to_all_single

    def timed_all_to_all(*args, **kwargs):
        c0 = time.thread_time()
        try:
            return all_to_all_single(*args, **kwargs)
        finally:
            a2a_cpu[0] += time.thread_time() - c0

    dist.all_to_all_single = timed_all_to_all
    reads = []
    tolist, item = torch.Tensor.tolist, torch.Tensor.item
    torch.Tensor.tolist = lambda t: reads.append(1) or tolist(t)
    torch.Tensor.item = lambda t: reads.append(1) or item(t)
    try:
        gc.collect()
        gc.disable()
        dist.barrier()
        walls, cpus = [], []
        for _ in range(a.steps):
            t0, c0, a0 = time.perf_counter(), time.thread_time(), a2a_cpu[0]
            step()
            walls.append(time.perf_counter() - t0)
            cpus.append(time.thread_time() - c0 - (a2a_cpu[0] - a0))
        wall, cpu = statistics.median(walls), min(cpus)  # the least CPU time: the least disturbed by other processes
        n_reads = len(reads) / a.steps
        prof = cProfile.Profile()
        prof.enable()
        step()
        prof.disable()
        counter = _OpCounter()
        with counter:
            step()
    finally:
        torch.Tensor.tolist, torch.Tensor.item = tolist, item
        dist.all_to_all_single = all_to_all_single
        gc.enable()
    stats = pstats.Stats(prof)
    out = dict(wall_ms=wall * 1e3, cpu_ms=cpu * 1e3, python_calls=stats.total_calls, torch_ops=counter.n)
    out["host_reads"] = n_reads
    out["syncing_ops"] = counter.syncing
    out["moe_layers"] = n_moe
    if a.dump and rank == 0:
        stats.dump_stats(a.dump)
    if a.profile and rank == 0:
        stats.sort_stats("tottime").print_stats(a.profile)
    return out


def main(argv=None) -> list[dict]:
    from tests.dist_utils import run_distributed

    a = parse_args(argv)
    per_rank = run_distributed(_rank_main, a.ep, a)
    path = "loop" if a.loop else "grouped_mm"
    for rank, r in enumerate(per_rank):
        print(
            f"rank {rank} ({a.flavor} EP{a.ep}, experts: {path}, {a.rows} x {a.seq} tokens): forward + backward "
            f"{r['wall_ms']:.1f} ms wall, {r['cpu_ms']:.1f} ms CPU (main thread, all-to-alls left out), "
            f"{r['python_calls']} Python calls, {r['torch_ops']} torch ops, "
            f"{r['host_reads']:.0f} host reads (tolist / item) + {r['syncing_ops']} other ops that sync on CUDA "
            f"({r['moe_layers']} MoE layers)"
        )
    return per_rank


if __name__ == "__main__":
    main()
