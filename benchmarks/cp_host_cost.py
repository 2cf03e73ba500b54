"""Host cost of a context-parallel (CP) training step on the CPU: 2 gloo ranks, a tiny Mamba-2, full activation
checkpointing (as the cp2_32k efficiency row runs). Counts, per step, torch.profiler's CPU ops and autograd nodes
and cProfile's Python calls, and times the step; with --cp 1 the same model in one process, no CP (the baseline the
CP path's extra host work is measured against).

    python3 benchmarks/cp_host_cost.py --cp 2
    python3 benchmarks/cp_host_cost.py --cp 1

The CPU runs the PyTorch references of the conv / SSD / norm, so absolute counts are larger than on a GPU; what the
CP hooks add (cp 2 minus cp 1, per layer) is the same Python and aten work as on the GPU.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import os
import pstats
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, default=2, help="context parallel degree (1: one process, no CP)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256, help="tokens of the (one-row) sequence, before the CP split")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after 3 untimed)")
    ap.add_argument("--top", type=int, default=0, help="print the N most frequent profiler ops")
    ap.add_argument("--pstats", type=int, default=0, help="print cProfile's N most called functions (rank 0)")
    ap.add_argument(
        "--hooks-only",
        action="store_true",
        help="per layer only the CP hooks' part of the mixer (in_proj + all-to-all, the parameter slices, the "
        "inverse all-to-all; no conv / SSD / norm / out_proj): the host work the CP path adds, without the references",
    )
    return ap.parse_args(argv)


def _build(a):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from models import build_model_args, build_model_on_meta
    from models.init import init_weights
    from parallelisms.context_parallel import apply_context_parallel

    args = build_model_args("debug", dict(n_layers=a.layers, ngroups=1))  # ngroups 1 (replicated B/C) as 1.3B
    model = build_model_on_meta(args)
    model.to_empty(device="cpu")
    init_weights(model, 0)
    if a.cp > 1:
        apply_context_parallel(model, dist.group.WORLD)
    for name, block in list(model.layers.items()):
        model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
    return args, model


def _cp_params(cp):
    """This rank's conv / SSD parameters as the mixer takes them: one node where the hook has local_params, else the
    per-parameter slices and A = -exp(A_log) (the code before it)."""
    if hasattr(cp, "local_params"):
        return cp.local_params()
    return (
        cp.get_conv1d_weight().squeeze(1),
        cp.get_conv1d_bias(),
        cp.get_dt_bias(),
        -torch.exp(cp.get_A_log()),
        cp.get_D(),
    )


def _hooks_layer(mixer, h):
    cp = mixer.cp
    z_BSE, xBCdt_BSd = cp.in_proj_pre_conv_ssm(h, mixer.in_proj)
    w, b, dt_bias, A, D = _cp_params(cp)
    scale = w.sum() + b.sum() + dt_bias.sum() + A.sum() + D.sum()
    y_BSd = xBCdt_BSd[..., : cp.d_inner_local] * scale
    return mixer.out_proj(cp.post_conv_ssm(y_BSd) * z_BSE)


def _hooks_only(model, args, local_ids):
    """The CP hooks of every mixer in a chain (a stand-in product joins the parameters to the activations, so that
    every parameter gets a gradient): u -> in_proj + all-to-all -> x * (every parameter slice, summed) -> inverse
    all-to-all -> z * y -> next layer. A loss of the last output's sum."""
    h = model.tok_embeddings(local_ids)
    for layer in model.layers.values():
        mixer = layer._checkpoint_wrapped_module.mixer if hasattr(layer, "_checkpoint_wrapped_module") else layer.mixer
        # full activation checkpointing, as the real layers run: the forward again in the backward
        h = torch.utils.checkpoint.checkpoint(_hooks_layer, mixer, h, use_reentrant=False)
    return h.sum()


def _measure(rank: int, a) -> dict:
    from parallelisms.sequence_sharding import shard_sequence

    torch.manual_seed(0)
    args, model = _build(a)
    ids = torch.randint(0, args.vocab_size, (1, a.seq))
    local = shard_sequence(ids, rank, a.cp, False)
    seq_idx = torch.zeros(1, a.seq, dtype=torch.int32)

    def step():
        loss = _hooks_only(model, args, local) if a.hooks_only else model(local, seq_idx=seq_idx, labels=local)
        loss.backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(3):
        step()
    gc.collect()
    gc.disable()
    times, cpu_times = [], []
    for _ in range(a.steps):
        if a.cp > 1:
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)  # this process's CPU time: less noisy than the wall on a shared host
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    names = collections.Counter()
    for e in prof.events():
        names[e.name] += 1
    nodes = sum(v for k, v in names.items() if k.startswith("autograd::engine::evaluate_function"))
    pr = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):  # the backward on this thread, visible to cProfile
        pr.enable()
        step()
        pr.disable()
    stats = pstats.Stats(pr)
    calls = stats.total_calls
    if a.pstats and rank == 0:
        stats.sort_stats("ncalls").print_stats(a.pstats)
    gc.enable()
    return dict(
        step_ms=statistics.median(times) * 1e3,
        cpu_ms=statistics.median(cpu_times) * 1e3,
        ops=sum(names.values()),
        autograd_nodes=nodes,
        python_calls=calls,
        top=names.most_common(a.top),
    )


def _worker(rank, a, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(a.cp))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=a.cp)
    try:
        q.put((rank, _measure(rank, a)))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.cp == 1:
        torch.set_num_threads(1)
        result = _measure(0, a)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, a, port, q)) for r in range(a.cp)]
        for p in procs:
            p.start()
        results = dict(q.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
        result = results[0]
    L = a.layers
    print(
        f"cp={a.cp} layers={L} seq={a.seq}: step {result['step_ms']:.1f} ms (CPU {result['cpu_ms']:.1f} ms), "
        f"per step {result['ops']} profiler ops "
        f"({result['ops'] / L:.0f} per layer), {result['autograd_nodes']} autograd nodes "
        f"({result['autograd_nodes'] / L:.1f} per layer), {result['python_calls']} Python calls "
        f"({result['python_calls'] / L:.0f} per layer)"
    )
    for name, n in result["top"]:
        print(f"  {n:6d} {name}")
    return result


if __name__ == "__main__":
    main()
