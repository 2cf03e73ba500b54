"""Process set-up shared by train.py, evaluate.py and generation: this process' device, its process group,
and the determinism switches."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init_distributed(world_size: int) -> torch.device:
    """This process' device; a process group only when torchrun started several processes."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
        )
    return device


def set_determinism(seed: int, deterministic: bool, device: torch.device) -> None:
    """Seed torch; with `deterministic`, deterministic algorithms and no TF32 (slower on GPU); else TF32 on GPU."""
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    elif device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True


def destroy_distributed() -> None:
    """Every rank reaches the end, then the process group goes (no-op in one process)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
