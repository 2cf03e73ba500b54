"""Throughput, FLOPs / MFU, memory, and the metrics sinks (console, metrics.jsonl, TensorBoard, W&B) on rank 0."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import resource
import sys
import time
from datetime import datetime, timezone

import torch

from components.cuda_graph import graph_pool_hidden_bytes
from components.log import format_seconds
from configs.job_config import JobConfig, Metrics
from models.args import ModelArgs
from models.hybrid.mlp import mlp_hidden_dim
from models.hybrid.moe import moe_hidden_dim
from models.mamba2.mixer import mixer_flops_per_token

logger = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s by device-name substring (datasheet values).
_PEAK_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "GH200": 989.4e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def peak_flops(device: torch.device) -> float:
    """bf16 dense peak of this device; 0 where unknown (CPU): mfu is then reported as 0."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in _PEAK_BF16.items() if k in name), 0.0)


def model_flops_per_token(args: ModelArgs, seq_len: int) -> tuple[float, float]:
    """(training FLOPs per token counting the SSD / conv / attention terms, 6 x active matmul parameters).

    Forward FLOPs: 2 per multiply-add of every matmul parameter a token uses (MoE: only top_k experts),
    plus the conv and chunked-SSD terms of Mamba layers and the causal attention scores; training = 3x.
    """
    d, matmul, extra = args.d_model, 0.0, 0.0
    for letter in args.layer_types:
        if letter == "M":
            matmul += d * (2 * args.d_inner + 2 * args.ngroups * args.d_state + args.nheads) + args.d_inner * d
            extra += mixer_flops_per_token(args, seq_len)
        elif letter == "*":
            hd = args.attn_head_dim or d // args.n_heads
            kv = args.n_kv_heads or args.n_heads
            matmul += d * hd * (2 * args.n_heads + 2 * kv)
            extra += 2 * seq_len * args.n_heads * hd  # QK^T and AV over the causal half, 2 FLOPs per MAC
        elif letter == "-":
            matmul += 3 * d * mlp_hidden_dim(args)
        elif letter == "E":  # the layers' own size formulas, so the count cannot drift from what is built
            moe_hidden = moe_hidden_dim(args)
            matmul += d * args.moe_num_experts + 3 * d * moe_hidden * (args.moe_top_k + args.moe_shared_experts)
    matmul += d * args.padded_vocab_size  # lm_head
    return 3.0 * (2.0 * matmul + extra), 6.0 * matmul


def memory_gib(device: torch.device) -> float:
    """Peak allocated device memory (CUDA), or the process' peak RSS (CPU), in GiB. With training.cuda_graph, at
    least what is allocated now plus what the graph's memory pool uses at every replay beyond its live outputs
    (components/cuda_graph.graph_pool_hidden_bytes: torch's peak stops counting the replays' activations once the
    capture ends)."""
    if device.type == "cuda":
        replay = torch.cuda.memory_allocated(device) + graph_pool_hidden_bytes()
        return max(torch.cuda.max_memory_allocated(device), replay) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


_WANDB_MISSING = (
    "metrics.enable_wandb needs the wandb package, which is not installed: `pip install wandb` "
    "(it logs offline, without network, unless WANDB_API_KEY is set), or set metrics.enable_wandb false"
)


def wandb_errors(cfg: Metrics) -> list[str]:
    """metrics.enable_wandb without wandb installed, found at config time (a spec lookup: importing is slow)."""
    if not cfg.enable_wandb:
        return []
    installed = (
        sys.modules["wandb"] is not None if "wandb" in sys.modules else importlib.util.find_spec("wandb") is not None
    )
    return [] if installed else [_WANDB_MISSING]


def wandb_mode(mode: str) -> str:
    """metrics.wandb_mode resolved: auto = $WANDB_MODE, else online with an API key, else offline (no network)."""
    if mode != "auto":
        return mode
    return os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")


def scalars(metrics: dict) -> dict:
    """The numbers of a record, as TensorBoard and W&B get them (bools such as skipped become 0 / 1)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float))}


class MetricsLogger:
    """Console progress on every rank that logs (components/log.py: rank 0 and the LOG_RANK ranks); files on rank 0.

    Each metrics.jsonl record is {"step", <the metrics>, "time": ISO 8601 UTC, "elapsed_s": seconds since this
    logger was created (the start of this process' training loop)}; `summary` is the end-of-run line.

    wandb_cfg (a [metrics] config with enable_wandb true): rank 0 also starts a W&B run in <dump_folder>/wandb and logs
    to it exactly what TensorBoard gets; run_config is recorded as the W&B run's config.
    """

    def __init__(
        self,
        dump_folder: str,
        is_rank0: bool,
        jsonl: bool,
        tensorboard: bool,
        total_steps: int,
        wandb_cfg: Metrics | None = None,
        run_config: dict | None = None,
    ):
        self.is_rank0, self.total_steps = is_rank0, total_steps
        self.jsonl_path = os.path.join(dump_folder, "metrics.jsonl") if (is_rank0 and jsonl) else None
        self.tb = self.wandb_run = None
        if is_rank0:
            os.makedirs(dump_folder, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter  # lazy: ~0.3 s, only when TensorBoard is on

                self.tb = SummaryWriter(os.path.join(dump_folder, "tb"))
            if wandb_cfg is not None and wandb_cfg.enable_wandb:
                self.wandb_run = _start_wandb_run(wandb_cfg, dump_folder, run_config)
        self.t_start = self.t_created = time.perf_counter()
        self.first_step: int | None = None
        self.val_losses: list[tuple[int, float]] = []  # (step, val_loss) of every validation logged, for summary

    def log(self, step: int, metrics: dict) -> None:
        if self.first_step is None:
            self.first_step, self.t_start = step - 1, time.perf_counter()  # ETA from the steps this run did
        elapsed = time.perf_counter() - self.t_start
        done = max(step - self.first_step, 1)
        eta = elapsed / done * (self.total_steps - step)
        logger.info(
            f"step {step:>6} | loss {metrics['loss']:.4f} | grad_norm {metrics['grad_norm']:.3f} | "
            f"lr {metrics['lr']:.2e} | tok/s {metrics['tokens_per_sec']:,.0f} | mfu {100 * metrics['mfu']:.1f}% | "
            f"mem {metrics['memory_gib']:.2f} GiB | eta {time.strftime('%H:%M:%S', time.gmtime(eta))}"
        )
        if "val_loss" in metrics:
            self.val_losses.append((step, metrics["val_loss"]))
        if self.jsonl_path:
            when = {
                "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
                "elapsed_s": round(time.perf_counter() - self.t_created, 3),
            }
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps({"step": step, **metrics, **when}) + "\n")
        if self.tb is not None:
            for k, v in scalars(metrics).items():
                self.tb.add_scalar(k, v, step)
        if self.wandb_run is not None:
            self.wandb_run.log(scalars(metrics), step=step)

    @classmethod
    def from_config(cls, cfg: JobConfig, is_rank0: bool) -> MetricsLogger:
        """The sinks [metrics] asks for, the whole job config recorded in the W&B run."""
        m = cfg.metrics
        return cls(
            cfg.job.dump_folder,
            is_rank0,
            m.save_jsonl,
            m.enable_tensorboard,
            cfg.training.steps,
            wandb_cfg=m,
            run_config=dataclasses.asdict(cfg) if m.enable_wandb else None,
        )

    def summary(self, first_step: int, last_step: int, tokens: int, wall_s: float, outputs: str) -> str:
        """The end-of-run line: the steps this run did (first_step..last_step), the tokens they consumed (global),
        the wall time, the final and best validation loss (when validation ran) and where the outputs are."""
        steps = f"steps {first_step}-{last_step}" if last_step >= first_step else "no step"
        val = ""
        if self.val_losses:
            best_step, best = min(self.val_losses, key=lambda sv: sv[1])
            val = f" | val_loss final {self.val_losses[-1][1]:.4f}, best {best:.4f} (step {best_step})"
        return (
            f"end of run: {steps} of {self.total_steps} | {tokens:,} tokens | wall {format_seconds(wall_s)}"
            f"{val} | outputs: {outputs}"
        )

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _start_wandb_run(cfg: Metrics, dump_folder: str, run_config: dict | None):
    """A W&B run named after the dump folder unless wandb_run_name says otherwise; imported only here."""
    try:
        import wandb  # lazy: optional
    except ImportError as e:
        raise ImportError(_WANDB_MISSING) from e
    name = cfg.wandb_run_name or os.path.basename(os.path.abspath(dump_folder))
    return wandb.init(
        project=cfg.wandb_project, name=name, mode=wandb_mode(cfg.wandb_mode), dir=dump_folder, config=run_config
    )
