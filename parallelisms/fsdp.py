"""FSDP2 (fully_shard) per block and on the root; HSDP when dp_replicate > 1.

Parameters are sharded over "dp_shard_cp" (dp_shard x cp: CP ranks hold the same parameters, so they
shard them too) and replicated over "dp_replicate". Each block is one FSDP unit (or each run of
`fsdp_blocks_per_unit` consecutive blocks: one all-gather and one reduce-scatter for all of them); the root unit holds the
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


def apply_fsdp(model: nn.Module, world_mesh: DeviceMesh, p: Parallelism, param_dtype: torch.dtype,
               reduce_dtype: torch.dtype = torch.float32, pdims=None) -> nn.Module:
    dp_mesh = world_mesh["dp_replicate", "dp_shard_cp"]
    kw = dict(mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    if p.fsdp_cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    expert_kw = None
    if pdims is not None and pdims.ep > 1:
        expert_kw = dict(kw, mesh=pdims.ep_mesh["dp_replicate", "efsdp"])
    layers = list(model.layers.values())
    k = p.fsdp_blocks_per_unit  # >= 1 (configs/checks.py)
    units = [layers[i:i + k] for i in range(0, len(layers), k)]
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


def _shard_experts(layer: nn.Module, reshard: bool, expert_kw: dict) -> None:
    """Expert-parallel experts (DTensors Shard(0) over "ep") get their own FSDP unit over the EP mesh's
    ("dp_replicate", "efsdp") before the block is sharded, so that the block's unit skips them. FSDP averages
    their gradients over those dp_cp / ep replicas; the remaining 1/ep is applied by the experts' forward
    (parallelisms/expert_parallel.py explains the scale)."""
    for experts in expert_modules(layer):
        fully_shard(experts, reshard_after_forward=reshard, **expert_kw)
