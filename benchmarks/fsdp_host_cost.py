"""One GPU's step against FSDP2 layouts of the same model, in turn inside one process per rank: the host-bound rows'
A/B without the between-process noise.

Why: the 370M's step waits for the host (one Python thread per rank), and on the lent virtual machines the speed of
that thread moves by 20-40% between processes (docs/multi_gpu_sessions.md, session 29), more than the gaps FSDP2's
layouts are judged by. Here every variant is built in the same process (through the trainer's one build path,
parallelisms/parallelize.py, as train.py builds it), and the variants take turns, a few steps each, for several
rounds, so each sees the same host. Variants:

    one                 this rank's whole model, as train.py builds it on one GPU (bf16 autocast over float32
                        weights, the optimizer's bf16 weight copies); each rank its own, no collectives
    oneNAME=OVERRIDES   the same with these config overrides, e.g. "onegraph=--training.cuda_graph true"
    fsdp                FSDP2 over the ranks, the defaults (parallelisms/fsdp.py)
    NAME=OVERRIDES      FSDP2 with these config overrides, e.g. "units15=--parallelism.fsdp_blocks_per_unit 15"

With `--training.cuda_graph true` (a variant's overrides, or --overrides for all) a variant replays its forward +
backward from a CUDA graph as train.py does (components/cuda_graph.py; under FSDP2 with its collectives captured).

Every rank feeds the same tokens, so FSDP's averaged gradient equals one rank's: the variants' losses agree step by
step (to float32 rounding on the CPU, to bf16 noise on the GPU), which the table prints as a check. A step is what
train.py runs: forward, backward, gradient norm, clipped fused AdamW (our kernel on CUDA), zero_grad. Printed per
variant: the median step time at the real batch (host and GPU together, synchronised at the end of each turn) and at
--tiny (where the host alone sets it), and the ratio to `one`.

    bash .gpu/setup.sh && NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node 2 benchmarks/fsdp_host_cost.py \\
        --config configs/mamba2_370m.toml --rows 8 --seq 2048 \\
        --variants "one,fsdp,all=--parallelism.fsdp_replicate_params_below 0,u5=--parallelism.fsdp_blocks_per_unit 5"
    ... --variants "one,fsdp,onegraph=--training.cuda_graph true,fsdpgraph=--training.cuda_graph true"
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from components.cuda_graph import GraphedMicrobatch  # noqa: E402
from components.optimizer import build_optimizer, take_optimizer_steps  # noqa: E402
from components.step_outcome import nonfinite  # noqa: E402
from configs.checks import resolve_job  # noqa: E402
from configs.parser import load_config  # noqa: E402
from parallelisms.grad_norm import global_grad_norm  # noqa: E402
from parallelisms.parallelize import build_model_parts  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/mamba2_370m.toml", help="the job's TOML (model, optimizer, ...)")
    ap.add_argument("--overrides", default="", help="config overrides for every variant, as on train.py's command")
    ap.add_argument(
        "--variants", default="one,fsdp", help="comma-separated: one, oneNAME=OVERRIDES, fsdp, NAME=OVERRIDES"
    )
    ap.add_argument("--rows", type=int, default=8, help="rows per rank of the real batch")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--tiny", default="1x256", help="rows x tokens of the host-cost batch ('' to skip)")
    ap.add_argument("--rounds", type=int, default=5, help="turns of every variant, after one untimed turn")
    ap.add_argument("--steps", type=int, default=3, help="steps per turn")
    ap.add_argument(
        "--profile",
        default="",
        help="after the timed rounds, trace --steps steps of every variant at the real batch with torch.profiler into "
        "DIR/<variant>/rank<r>_trace.json; on CUDA rank 0 prints each trace's split per step (trace_summary.py: GPU "
        "compute, NCCL and its exposed part, GPU idle, kernels)",
    )
    return ap.parse_args(argv)


def one_gpu_layout(name: str) -> bool:
    """Whether variant `name` is this rank alone (one, oneNAME), not FSDP2 over the ranks."""
    return name.startswith("one")


def variant_specs(text: str) -> list[tuple[str, list[str]]]:
    """'one,fsdp,units15=--parallelism.fsdp_blocks_per_unit 15' -> [(name, overrides)]; one and fsdp take none (a name
    that starts with "one" is a one-GPU layout, any other an FSDP2 one)."""
    specs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, overrides = item.partition("=")
        if name in ("one", "fsdp") and overrides:
            raise ValueError(f"variant {name!r} takes no overrides; name the variant otherwise, e.g. '{name}2=...'")
        specs.append((name, shlex.split(overrides)))
    names = [n for n, _ in specs]
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"--variants needs distinct names, got {names}")
    return specs


class Variant:
    """One layout of the model, built as train.py builds it, with its optimizer (and its CUDA graph)."""

    def __init__(self, name: str, argv: list[str], world_size: int, device: torch.device, mesh_cache: dict):
        self.name = name
        one = one_gpu_layout(name)
        cfg = load_config(argv)
        if one:  # this rank alone: a one-process layout
            cfg.parallelism.data_parallel_shard_degree = 1
            cfg.parallelism.data_parallel_replicate_degree = 1
        world = 1 if one else world_size
        job = resolve_job(cfg, world)  # the trainer's one validation pass (a ConfigError names the fix)
        pdims, model_args = job.pdims, job.model_args
        if not one and not pdims.fsdp_enabled:
            raise ValueError(f"variant {name}: not an FSDP layout ({pdims}); give it FSDP2 overrides")
        key = (pdims.pp, pdims.dp_replicate, pdims.dp_shard, pdims.cp)
        if not one and key not in mesh_cache:  # one mesh per shape (its process groups are made once)
            mesh_cache[key] = pdims.build_mesh(device.type)
        mesh = None if one else mesh_cache[key]
        on_gpu = device.type == "cuda"
        bf16 = on_gpu and cfg.training.mixed_precision_param == "bfloat16"
        compute_dtype = torch.bfloat16 if bf16 else torch.float32
        built = build_model_parts(cfg, pdims, mesh, model_args, device, compute_dtype)
        self.model, self.replicated_grads = built.parts[0], built.replicated_grads
        # as train.py: autocast (and the optimizer's weight copies) where FSDP2 does not cast the weights itself
        autocast_dtype = compute_dtype if bf16 and not pdims.fsdp_enabled else None
        graph = cfg.training.cuda_graph
        self.optimizer = build_optimizer([self.model], cfg.optimizer, device.type, None if graph else autocast_dtype)
        # training.cuda_graph: one graph per batch shape (the real batch and --tiny), all adding into the same .grad
        self.graph_args = (self.model, autocast_dtype, cfg.training.loss_chunk_tokens) if graph else None
        self.graphs: dict[tuple[int, ...], GraphedMicrobatch] = {}
        self.params = list(self.model.parameters())
        self.amp = (lambda: torch.autocast("cuda", dtype=autocast_dtype)) if autocast_dtype else contextlib.nullcontext
        self.max_norm = cfg.training.max_norm
        self.loss_chunk_tokens = cfg.training.loss_chunk_tokens
        self.vocab_size = model_args.vocab_size
        self.losses: list[float] = []
        self.times: dict[str, list[float]] = {}

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        if self.graph_args is not None:  # as train.py: the summed loss, the gradients of its mean added to .grad
            graphed = self.graphs.get(tuple(ids.shape))
            if graphed is None:
                graphed = self.graphs[tuple(ids.shape)] = GraphedMicrobatch(*self.graph_args)
            scale = torch.full((), 1.0 / ids.numel(), device=ids.device)
            loss = graphed(ids, ids, None, scale) / ids.numel()
        else:
            with self.amp():
                loss = self.model(ids, labels=ids, loss_chunk_tokens=self.loss_chunk_tokens) / ids.numel()
            loss.backward()
        if self.replicated_grads is not None:  # as train.py: FSDP's small parameters, held whole on every rank
            self.replicated_grads.all_reduce()
        grad_norm = global_grad_norm(self.params)
        take_optimizer_steps([self.optimizer], self.params, grad_norm, self.max_norm, nonfinite(loss, grad_norm))
        self.optimizer.zero_grad(set_to_none=self.graph_args is None)  # a graph adds into the same .grad tensors
        return loss.detach()


def timed_turn(v: Variant, ids: torch.Tensor, steps: int, sync) -> float:
    """Seconds per step over `steps` steps, the device drained before and after."""
    sync()
    t0 = time.perf_counter()
    losses = [v.step(ids) for _ in range(steps)]
    sync()
    v.losses.extend(float(x) for x in losses)
    return (time.perf_counter() - t0) / steps


def profile_turn(v: Variant, ids: torch.Tensor, steps: int, sync, folder: str, rank: int) -> None:
    """`steps` steps of `v` under torch.profiler, each a "ProfilerStep#N" (trace_summary.py's window), the trace
    written to folder/rank<rank>_trace.json."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    os.makedirs(folder, exist_ok=True)
    sync()
    with profile(activities=activities) as prof:
        losses = []
        for i in range(steps):
            with record_function(f"ProfilerStep#{i}"):
                losses.append(v.step(ids))
                if i == steps - 1:
                    sync()  # the steps run as in training (the host ahead); the window ends with the last kernel
    v.losses.extend(float(x) for x in losses)
    prof.export_chrome_trace(os.path.join(folder, f"rank{rank}_trace.json"))


def print_profiles(folder: str, names: list[str], steps: int) -> None:
    """Rank 0's trace of each variant, split by trace_summary.py, in ms per profiled step (the summary's window spans
    the `steps` steps, from the first one's start to the last one's last kernel)."""
    from benchmarks.trace_summary import summarize

    print(f"| variant (rank 0, ms per step of {steps}) | wall | GPU compute | NCCL (exposed) | GPU idle | kernels |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        s = summarize(os.path.join(folder, name, "rank0_trace.json"))
        per = {k: s[k] / steps for k in ("wall_ms", "compute_ms", "nccl_ms", "nccl_exposed_ms", "idle_ms")}
        print(
            f"| {name} | {per['wall_ms']:.1f} | {per['compute_ms']:.1f} | {per['nccl_ms']:.1f} "
            f"({per['nccl_exposed_ms']:.1f}) | {per['idle_ms']:.1f} | {s['kernels'] // steps} |"
        )


def main(argv=None) -> dict:
    a = parse_args(argv)
    specs = variant_specs(a.variants)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if on_gpu else "gloo")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    base = ["--job.config_file", a.config, *shlex.split(a.overrides)]
    mesh_cache: dict = {}
    variants = [Variant(name, base + extra, world, device, mesh_cache) for name, extra in specs]
    vocab = variants[0].vocab_size
    g = torch.Generator().manual_seed(0)  # the same tokens on every rank: FSDP's mean gradient = one rank's
    batches = {"real": torch.randint(0, vocab, (a.rows, a.seq), generator=g).to(device)}
    if a.tiny:
        rows, seq = (int(x) for x in a.tiny.split("x"))
        batches["tiny"] = torch.randint(0, vocab, (rows, seq), generator=g).to(device)
    gc.collect()
    gc.disable()  # as train.py between collections
    try:
        for kind, ids in batches.items():
            for v in variants:  # an untimed turn each: kernels compiled, allocator warm
                timed_turn(v, ids, 1, sync)
            for _ in range(a.rounds):
                for v in variants:
                    v.times.setdefault(kind, []).append(timed_turn(v, ids, a.steps, sync))
        if a.profile:
            for v in variants:
                profile_turn(v, batches["real"], a.steps, sync, os.path.join(a.profile, v.name), rank)
    finally:
        gc.enable()
        for v in variants:  # before the process group goes (a graph holding FSDP's collectives)
            for graphed in v.graphs.values():
                graphed.release()
    result = {}
    for v in variants:
        result[v.name] = {kind: 1e3 * statistics.median(t) for kind, t in v.times.items()}
        result[v.name]["losses"] = v.losses
    if rank == 0:
        print_table(result, a, world, device)
        if a.profile and on_gpu:
            print_profiles(a.profile, [v.name for v in variants], a.steps)
    return result


def print_table(result: dict, a: argparse.Namespace, world: int, device: torch.device) -> None:
    ref = result.get("one")
    kinds = [k for k in ("real", "tiny") if k in next(iter(result.values()))]
    print(f"{a.config} {a.overrides} on {world} rank(s), {device.type}; median of {a.rounds} turns x {a.steps} steps")
    shapes = {"real": f"{a.rows}x{a.seq}", "tiny": a.tiny}
    head = " | ".join(f"ms per step, {shapes[k]}" for k in kinds)
    print(f"| variant | {head} | tok/s vs one ({shapes['real']}) | first / last loss | max loss gap vs one |")
    for name, r in result.items():
        ratio = f"{ref['real'] / r['real']:.3f}" if ref else "-"
        gap = "-"
        if ref and name != "one":
            gap = f"{max(abs(x - y) / abs(y) for x, y in zip(r['losses'], ref['losses'])):.1e}"
        times = " | ".join(f"{r[k]:.1f}" for k in kinds)
        print(f"| {name} | {times} | {ratio} | {r['losses'][0]:.4f} / {r['losses'][-1]:.4f} | {gap} |")


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
