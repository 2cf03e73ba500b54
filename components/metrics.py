"""Throughput, FLOPs / MFU, memory, and the metrics sinks (console, metrics.jsonl, TensorBoard) on rank 0."""

from __future__ import annotations

import json
import os
import resource
import time

import torch

from models.args import ModelArgs
from models.hybrid.mlp import mlp_hidden_dim
from models.hybrid.moe import moe_hidden_dim

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
    from models.mamba2.mixer import mixer_flops_per_token

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
    """Peak allocated device memory (CUDA), or the process' peak RSS (CPU), in GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


class MetricsLogger:
    """Console progress on every rank that logs (LOG_RANK filters in run_train.sh); files on rank 0 only."""

    def __init__(self, dump_folder: str, is_rank0: bool, jsonl: bool, tensorboard: bool, total_steps: int):
        self.is_rank0, self.total_steps = is_rank0, total_steps
        self.jsonl_path = os.path.join(dump_folder, "metrics.jsonl") if (is_rank0 and jsonl) else None
        self.tb = None
        if is_rank0:
            os.makedirs(dump_folder, exist_ok=True)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(dump_folder, "tb"))
        self.t_start = time.perf_counter()
        self.first_step: int | None = None

    def log(self, step: int, metrics: dict) -> None:
        if self.first_step is None:
            self.first_step, self.t_start = step - 1, time.perf_counter()  # ETA from the steps this run did
        elapsed = time.perf_counter() - self.t_start
        done = max(step - self.first_step, 1)
        eta = elapsed / done * (self.total_steps - step)
        print(
            f"step {step:>6} | loss {metrics['loss']:.4f} | grad_norm {metrics['grad_norm']:.3f} | "
            f"lr {metrics['lr']:.2e} | tok/s {metrics['tokens_per_sec']:,.0f} | mfu {100 * metrics['mfu']:.1f}% | "
            f"mem {metrics['memory_gib']:.2f} GiB | eta {time.strftime('%H:%M:%S', time.gmtime(eta))}",
            flush=True,
        )
        if self.jsonl_path:
            with open(self.jsonl_path, "a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
