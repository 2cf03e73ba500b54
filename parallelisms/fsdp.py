"""FSDP2 (fully_shard) per block and on the root; HSDP when dp_replicate > 1.

Parameters are sharded over "dp_shard_cp" (dp_shard x cp: CP ranks hold the same parameters, so they
shard them too) and replicated over "dp_replicate". Each run of `fsdp_blocks_per_unit` consecutive
blocks is one FSDP unit (one all-gather and one reduce-scatter for all of them; by default as many blocks as hold
about 100M parameters, see auto_blocks_per_unit); the root unit holds the
embedding, norm_f and lm_head (tied embeddings must stay in one unit). Under expert parallel, the routed experts
of a MoE block are their own unit, sharded over the EP mesh's ("dp_replicate", "efsdp") instead.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from configs.job_config import Parallelism
from parallelisms.expert_parallel import expert_modules


def apply_fsdp(
    model: nn.Module,
    world_mesh: DeviceMesh,
    p: Parallelism,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype = torch.float32,
    pdims=None,
) -> nn.Module:
    dp_mesh = world_mesh["dp_replicate", "dp_shard_cp"]
    kw = dict(mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    if p.fsdp_cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    expert_kw = None
    if pdims is not None and pdims.ep > 1:
        expert_kw = dict(kw, mesh=pdims.ep_mesh["dp_replicate", "efsdp"])
    layers = list(model.layers.values())
    k = p.fsdp_blocks_per_unit or auto_blocks_per_unit(layers)  # >= 0 (configs/checks.py); 0 = auto
    units = [layers[i : i + k] for i in range(0, len(layers), k)]
    pipelined = pdims is not None and pdims.pp > 1
    for i, unit in enumerate(units):
        # default: reshard, except the last unit (its parameters are needed again first in backward) and
        # except under pipeline parallel, where every microbatch would all-gather the stage's blocks again.
        default = not pipelined and i < len(units) - 1
        reshard = {"always": True, "never": False}.get(p.fsdp_reshard_after_forward, default)
        if expert_kw is not None:
            for layer in unit:
                _shard_experts(layer, reshard, expert_kw)
        fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=p.fsdp_reshard_after_forward == "always", **kw)
    return model


AUTO_UNIT_PARAMS = 100_000_000


def auto_blocks_per_unit(layers: list[nn.Module], unit_params: int = AUTO_UNIT_PARAMS) -> int:
    """fsdp_blocks_per_unit 0: as many consecutive blocks as hold about `unit_params` parameters (at least 1).

    Each FSDP unit costs host time per step (its hooks, the copy-in / copy-out around its collectives) whatever its
    size, and steps of models up to ~1B wait for the host: on 2 H200s the 1.3B (26M parameters per block) ran at 92%
    of one GPU's tokens/s per GPU with one unit per block and 95.5% with 4 (docs/performance.md). Units of ~100M
    parameters keep the gathered copy small (~200 MB in bf16, twice that with the next unit prefetched); blocks of
    100M parameters and more stay one unit each, torchtitan's choice for large models.
    """
    if not layers:
        return 1
    per_block = sum(p.numel() for layer in layers for p in layer.parameters()) / len(layers)
    return max(1, min(len(layers), round(unit_params / max(per_block, 1))))


def _shard_experts(layer: nn.Module, reshard: bool, expert_kw: dict) -> None:
    """Expert-parallel experts (DTensors Shard(0) over "ep") get their own FSDP unit over the EP mesh's
    ("dp_replicate", "efsdp") before the block is sharded, so that the block's unit skips them. FSDP averages
    their gradients over those dp_cp / ep replicas; the remaining 1/ep is applied by the experts' forward
    (parallelisms/expert_parallel.py explains the scale)."""
    for experts in expert_modules(layer):
        fully_shard(experts, reshard_after_forward=reshard, **expert_kw)
