"""torchtitan's parallelize_fn for Mamba-2: activation checkpointing, torch.compile and FSDP2 / HSDP, each from
mambatitan's own parallelisms/ (the same per-block units as train.py), driven by torchtitan's config and mesh.

Order (torchtitan's): AC, compile, FSDP. Refused, before anything is built: tensor parallel, context parallel and
expert parallel through torchtitan (mambatitan's all-to-all CP and EP need its own trainer: train.py), AC modes
other than full / selective every-n-th block, and plain DDP (dp_replicate alone).
"""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.models.llama3.infra.parallelize import disable_fsdp_gradient_division

from parallelisms.activation_checkpoint import apply_activation_checkpoint
from parallelisms.compile import apply_compile
from parallelisms.fsdp import apply_fsdp


class _DataParallelMesh:
    """parallelisms/fsdp.py reads the FSDP mesh as world_mesh["dp_replicate", "dp_shard_cp"]; torchtitan names the
    same ranks ["dp_replicate", "fsdp"] (HSDP) or "fsdp" alone. This view answers that one lookup."""

    def __init__(self, dp_mesh: DeviceMesh):
        self.dp_mesh = dp_mesh

    def __getitem__(self, names):
        if tuple(names) != ("dp_replicate", "dp_shard_cp"):
            raise KeyError(f"the torchtitan adapter only maps the FSDP mesh, not {names}")
        return self.dp_mesh


def unsupported_settings(parallel_dims, job_config) -> list[str]:
    """Settings of torchtitan's config this integration cannot run, each with the fix (empty when fine)."""
    errs = []
    for name, degree in (
        ("tensor_parallel_degree", parallel_dims.tp),
        ("context_parallel_degree", parallel_dims.cp),
        ("expert_parallel_degree", parallel_dims.ep),
    ):
        if degree > 1:
            errs.append(
                f"parallelism.{name}={degree} is not supported for mamba2 under torchtitan (Mamba-2 has no "
                "TP plan here; its all-to-all CP and EP run in mambatitan's own train.py); set it to 1"
            )
    ac = job_config.activation_checkpoint
    if ac.mode not in ("none", "full", "selective"):
        errs.append(f"activation_checkpoint.mode={ac.mode!r} is not supported for mamba2; use none, full or selective")
    elif ac.mode == "selective" and not (str(ac.selective_ac_option).isdigit() and int(ac.selective_ac_option) >= 1):
        errs.append(
            f"activation_checkpoint.selective_ac_option={ac.selective_ac_option!r}: mamba2 checkpoints every "
            "n-th block only; give an integer n >= 1 (op-level SAC is not supported)"
        )
    if parallel_dims.dp_replicate_enabled and not parallel_dims.fsdp_enabled:
        errs.append(
            "plain DDP (data_parallel_replicate_degree > 1 with shard degree 1) is not wired for mamba2; "
            "use FSDP (data_parallel_shard_degree) or HSDP (both)"
        )
    if job_config.model.converters:
        errs.append(
            f"model.converters={job_config.model.converters} (float8 / mx) is not supported for mamba2; leave it empty"
        )
    return errs


def parallelize_mamba2(model: nn.Module, parallel_dims, job_config) -> nn.Module:
    """Apply AC, torch.compile (per block) and FSDP2 / HSDP (per block + root) in place; returns the model."""
    errs = unsupported_settings(parallel_dims, job_config)
    if errs:
        raise ValueError("mamba2 under torchtitan:\n  - " + "\n  - ".join(errs))
    apply_activation_checkpoint(model, job_config.activation_checkpoint)
    if job_config.compile.enable and "model" in job_config.compile.components:
        apply_compile(model)
    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        fsdp_options = SimpleNamespace(  # parallelisms/fsdp.py's Parallelism fields, from torchtitan's config
            fsdp_blocks_per_unit=1,
            fsdp_reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
            fsdp_cpu_offload=job_config.training.enable_cpu_offload,
            fsdp_replicate_params_below=0,  # every parameter sharded: torchtitan's trainer reduces nothing itself
        )
        apply_fsdp(
            model,
            _DataParallelMesh(parallel_dims.get_mesh(names)),
            fsdp_options,
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pdims=SimpleNamespace(ep=1, pp=parallel_dims.pp),
        )
        # torchtitan's trainer already divides the loss sum by the GLOBAL token count: FSDP must sum the
        # gradients, not average them once more over the data-parallel ranks (as torchtitan's llama3 does).
        disable_fsdp_gradient_division(model)
        # A divide factor of 1 is a plain sum; saying so lets gloo (CPU) run it too, which has no PREMUL_SUM.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model
