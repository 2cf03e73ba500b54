"""The two sides that compare_mamba_ssm.py runs (and step_energy.py, bench_energy.py reuse): the sizes, our train.py
command and the throughput from its metrics, and mamba-ssm's own model in a plain training loop (theirs_worker).

What each side does and why is in compare_mamba_ssm.py's docstring; this module holds no command line of its own.
theirs_worker runs in the process compare_mamba_ssm.py starts for it (`--_worker theirs`), so mamba_ssm is imported
only there, on first use.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from models.args import build_model_args  # noqa: E402

THEIR_VOCAB, THEIR_PAD = 50277, 8  # MambaConfig's defaults: the released checkpoints' 50280 rows


# Our side on one GPU at their loop's gradient precision: the blocks' linear weights' gradients in bf16, the value
# autocast gives their float32 weights (training.grad_dtype; the configs keep float32, which also runs multi-GPU)
ONE_GPU_AS_THEIRS = ("--training.grad_dtype", "bfloat16")


@dataclass(frozen=True)
class Size:
    name: str
    config: str
    flavor: str
    batch: int
    seq_len: int
    ours_args: tuple[str, ...] = ()  # train.py overrides of every run of ours at this size, before the user's


SIZES = {
    "370m": Size("370m", "configs/mamba2_370m.toml", "370M", batch=8, seq_len=2048, ours_args=ONE_GPU_AS_THEIRS),
    "1.3b": Size("1.3b", "configs/mamba2_1.3b.toml", "1.3B", batch=4, seq_len=4096, ours_args=ONE_GPU_AS_THEIRS),
    "debug": Size("debug", "configs/debug.toml", "debug", batch=2, seq_len=64),  # CPU smoke test of our side
}


def ours_command(
    size: Size, warmup: int, steps: int, dump_folder: str, overrides: list[str], python: str = sys.executable
) -> list[str]:
    """train.py for warmup + steps steps at the size's batch, metrics every step, the size's ours_args; overrides
    come last (win: `-- --training.grad_dtype float32` times the configs' float32 gradients)."""
    return [
        python,
        "train.py",
        "--job.config_file",
        size.config,
        "--job.dump_folder",
        dump_folder,
        "--training.steps",
        str(warmup + steps),
        "--training.local_batch_size",
        str(size.batch),
        "--training.global_batch_size",
        "-1",
        "--training.seq_len",
        str(size.seq_len),
        "--training.dataset",
        "default",
        "--metrics.log_freq",
        "1",
        "--metrics.enable_tensorboard",
        "false",
        "--checkpoint.enable",
        "false",
        "--validation.enable",
        "false",
        *size.ours_args,
        *overrides,
    ]


def summarize_ours(records: list[dict], warmup: int) -> dict:
    """Throughput over the timed steps from metrics.jsonl (one record per step, each step the same tokens):
    total tokens / total time = the harmonic mean of the per-step tokens/s. Memory: the peak so far (max)."""
    last = {r["step"]: r for r in records}  # the last record of a step wins
    timed = [last[s] for s in sorted(last) if s > warmup]
    if not timed:
        raise ValueError(f"no metrics after step {warmup} (steps logged: {sorted(last)})")
    tps = len(timed) / sum(1.0 / r["tokens_per_sec"] for r in timed)
    return {
        "tokens_per_sec": tps,
        "memory_gib": max(r["memory_gib"] for r in records),
        "timed_steps": len(timed),
        "final_loss": timed[-1]["loss"],
        "mfu_logged": timed[-1].get("mfu", 0.0),
    }


def summarize_times(step_seconds: list[float], warmup: int, tokens_per_step: int) -> dict:
    timed = step_seconds[warmup:]
    if not timed:
        raise ValueError(f"no timed steps: {len(step_seconds)} steps, warmup {warmup}")
    return {"tokens_per_sec": tokens_per_step * len(timed) / sum(timed), "timed_steps": len(timed)}


def model_args_for(size: Size, side: str):
    """ModelArgs of either side: ours from the flavor; theirs the same sizes with MambaConfig's vocabulary."""
    if side == "ours":
        return build_model_args(size.flavor, {})
    return build_model_args(size.flavor, {"vocab_size": THEIR_VOCAB, "pad_vocab_size_multiple": THEIR_PAD})


def their_config_kwargs(size: Size) -> dict:
    """MambaConfig for mamba_ssm's MambaLMHeadModel matching the flavor (Mamba2 layers, no MLP)."""
    args = model_args_for(size, "theirs")
    return dict(
        d_model=args.d_model,
        d_intermediate=0,
        n_layer=args.n_layers,
        vocab_size=THEIR_VOCAB,
        pad_vocab_size_multiple=THEIR_PAD,
        rms_norm=True,
        residual_in_fp32=True,
        fused_add_norm=True,
        tie_embeddings=True,
        ssm_cfg={
            "layer": "Mamba2",
            "d_state": args.d_state,
            "d_conv": args.d_conv,
            "expand": args.expand,
            "headdim": args.headdim,
            "ngroups": args.ngroups,
            "chunk_size": args.chunk_size,
        },
    )


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def our_document_ids(size: Size, n_steps: int) -> list[torch.Tensor]:
    """seq_idx [batch, seq_len] (int32, CPU) of the first n_steps batches that our run of `size` trains on: its
    config and train.py's arguments (ours_command), our loader, the same packing of the same documents."""
    from configs.checks import resolve_job
    from configs.parser import load_config
    from data.loader import build_loader

    argv = ours_command(size, 0, n_steps, os.path.join(REPO, "outputs", "unused"), [])[2:]  # train.py's arguments
    cfg = load_config(argv + ["--training.prefetch_batches", "0"])
    job = resolve_job(cfg, 1)
    loader = build_loader(cfg, job.tokenizer, job.batch, 0)
    return [loader.next_batch()["seq_idx"].to(torch.int32) for _ in range(n_steps)]


def theirs_worker(
    size: Size,
    warmup: int,
    steps: int,
    device_type: str = "cuda",
    profile_step: int = 0,
    trace: str | None = None,
    documents: bool = False,
) -> dict:
    """mamba-ssm's MambaLMHeadModel in a plain loop (runs in its own process; device_type cpu only for tests,
    with a stand-in mamba_ssm). With profile_step, step profile_step (1-based) is traced into `trace` (a chrome
    trace with a ProfilerStep#<k> annotation, as ours), the tracer started one step earlier. documents: each step
    passes seq_idx of our run's batch of that step (our_document_ids) to their model, which hands it to every
    Mamba2 mixer (mamba_ssm's mixer_kwargs): the conv and SSM state reset at the same positions as ours."""
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("the mamba_ssm side needs CUDA (use --skip_theirs elsewhere)")
    import mamba_ssm  # lazy: optional, needs its CUDA build (tests put a stand-in in sys.modules)
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    on_gpu = device_type == "cuda"
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as train.py does
    device = torch.device(device_type)

    def sync():
        if on_gpu:
            torch.cuda.synchronize(device)

    model = MambaLMHeadModel(MambaConfig(**their_config_kwargs(size)), device=device, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    gen = torch.Generator(device=device).manual_seed(0)
    seq_ids = our_document_ids(size, warmup + steps) if documents else None
    seconds, losses = [], []
    tracer = None
    for step in range(1, warmup + steps + 1):
        if profile_step and step == profile_step - 1:
            os.makedirs(os.path.dirname(os.path.abspath(trace)), exist_ok=True)
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if on_gpu else []
            )
            tracer = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1),
                on_trace_ready=lambda p: p.export_chrome_trace(trace),
            )
            tracer.start()
        tokens = torch.randint(0, THEIR_VOCAB, (size.batch, size.seq_len + 1), device=device, generator=gen)
        kwargs = {} if seq_ids is None else {"seq_idx": seq_ids[step - 1].to(device)}
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=on_gpu):
            logits = model(tokens[:, :-1], **kwargs).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        del logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # our trainer also reads the loss every step
        sync()
        seconds.append(time.perf_counter() - t0)
        if tracer is not None:
            tracer.step()  # the schedule's step k+1 is the traced one: its ProfilerStep#k annotation spans it
            if step == profile_step:
                tracer.stop()
                tracer = None
    out = summarize_times(seconds, warmup, size.batch * size.seq_len)
    out.update(
        memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else float("nan"),
        final_loss=losses[-1],
        losses=losses,
        n_params=n_params,
        vocab_rows=model.lm_head.weight.shape[0],
        documents=documents,
        gpu=torch.cuda.get_device_name(device) if on_gpu else "cpu",
        torch=torch.__version__,
        mamba_ssm=getattr(mamba_ssm, "__version__", "?"),
        step_seconds=seconds,
    )
    return out
