"""FSDP2 (fully_shard) per block and on the root; HSDP when dp_replicate > 1.

Parameters are sharded over "dp_shard_cp" (dp_shard x cp: CP ranks hold the same parameters, so they
shard them too) and replicated over "dp_replicate". Each run of `fsdp_blocks_per_unit` consecutive
blocks is one FSDP unit (one all-gather and one reduce-scatter for all of them; by default as many blocks as hold
about 100M parameters, see auto_blocks_per_unit; -1, and the default for a small part (SMALL_PART_BYTES): no unit of
their own, the root's unit holds them); the root unit holds the embedding, norm_f and lm_head (tied embeddings must
stay in one unit). Under expert parallel, the routed experts
of a MoE block are their own unit, sharded over the EP mesh's ("dp_replicate", "efsdp") instead; where that mesh is
one rank (ep = dp_shard x cp, no HSDP) each expert has one replica and FSDP leaves the experts alone (ignored_params):
their weights stay float32 DTensors on the "ep" mesh, cast to bf16 by the experts' products, their gradients
reduced by nothing (the 1/ep scale and the loss's dp_cp factor cancel: parallelisms/expert_parallel.py).

Small parameters (`fsdp_replicate_params_below` elements: the norms' weights, the conv's weight and bias, dt_bias,
A_log, D) are left out of FSDP too (DeepSpeed ZeRO-3's "persistence threshold"): every rank holds them whole, in
float32 (as one GPU's autocast has them), and `ReplicatedGradients` averages their gradients over the dp_cp ranks
by one all-reduce after the step's last microbatch. They are 337 of the 370M's 434 parameters and 0.2% of its
elements, and FSDP2's host time per step grows with the number of parameters (each is cast, copied in and out,
given a DTensor gradient and swapped sharded / unsharded in Python), which is what limits steps of this size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

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
    # Blocks take their inputs as they come (block_kw): FSDP's default casts every floating-point input of a unit to
    # param_dtype, which would round the float32 residual stream (model.residual_in_fp32) to bf16 at each unit's
    # first block, after which add_and_norm keeps it in bf16 (a residual comes back in the dtype it came in): the
    # float32 residual that one GPU's autocast keeps would end at the second unit (at every block since torch 2.13,
    # whose grouped units run the pre-forward hook per module). The hidden stream is already in param_dtype (the
    # bf16 embedding, the mixers' outputs); the root unit still casts its inputs (a pipeline stage's packed
    # hidden / residual), and so do routed experts' units. Also one pytree walk of the inputs less per unit.
    block_kw = dict(
        kw,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False),
    )
    expert_kw, ignored = None, None
    if pdims is not None and pdims.ep > 1:
        expert_mesh = pdims.ep_mesh["dp_replicate", "efsdp"]
        if expert_mesh.size() > 1:
            expert_kw = dict(kw, mesh=expert_mesh)
        else:  # one replica of each expert (ep = dp_shard x cp): nothing to gather or reduce, and FSDP's hooks on
            # the experts' units would cost host time for nothing; the blocks' units and the root leave them out
            ignored = {param for experts in expert_modules(model) for param in experts.parameters()}
    small = small_replicated_params(model, p.fsdp_replicate_params_below, p.fsdp_cpu_offload)
    if small:
        ignored = (ignored or set()) | small
    layers = list(model.layers.values())
    small_part = gathered_bytes(model, param_dtype) <= SMALL_PART_BYTES
    # >= -1 (configs/checks.py); -1: the blocks in the root's unit (no unit of their own); 0 = auto: the same for a
    # small part, else units of ~AUTO_UNIT_PARAMS
    in_root = p.fsdp_blocks_per_unit == -1 or (p.fsdp_blocks_per_unit == 0 and small_part)
    k = len(layers) if in_root else p.fsdp_blocks_per_unit or auto_blocks_per_unit(layers)
    units = [layers[i : i + k] for i in range(0, len(layers), k)]
    pipelined = pdims is not None and pdims.pp > 1
    for i, unit in enumerate(units):
        reshard = unit_reshards(p.fsdp_reshard_after_forward, i, len(units), pipelined, small_part)
        if expert_kw is not None:
            for layer in unit:
                _shard_experts(layer, reshard, expert_kw)
        if not in_root:
            fully_shard(
                unit if len(unit) > 1 else unit[0], reshard_after_forward=reshard, ignored_params=ignored, **block_kw
            )
    fully_shard(model, reshard_after_forward=p.fsdp_reshard_after_forward == "always", ignored_params=ignored, **kw)
    return model


def small_replicated_params(model: nn.Module, below: int, cpu_offload: bool = False) -> set[nn.Parameter]:
    """The parameters FSDP leaves whole on every rank: fewer than `below` elements, not a routed expert's, and not
    the weight or bias of an nn.Linear / nn.Embedding, whose products (F.linear, F.embedding; no autocast runs under
    FSDP2) need them in param_dtype beside FSDP's gathered weights. Nothing under CPU offload (its optimizer runs
    on the host's copies) or for below <= 0."""
    if below <= 0 or cpu_offload:
        return set()
    experts = {id(param) for e in expert_modules(model) for param in e.parameters()}
    products = {
        id(param) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding)) for param in m.parameters()
    }
    return {
        param
        for param in model.parameters()
        if param.numel() < below and id(param) not in experts and id(param) not in products
    }


class ReplicatedGradients:
    """The gradients of the parameters FSDP left whole on every rank (`small_replicated_params`; after
    `to_empty` they are this part's parameters that are not DTensors), averaged over the data-parallel and
    context-parallel ranks (the ranks FSDP averages the others over) by one all-reduce per step.

        grads = ReplicatedGradients(model_parts, mesh["dp_cp"].get_group())
        ... forward / backward of every microbatch (each rank's gradients accumulate in .grad as usual) ...
        grads.all_reduce()     # before the gradient norm, clipping and the optimizer
    """

    def __init__(self, model_parts: list[nn.Module], group: dist.ProcessGroup):
        self.params = [
            p for part in model_parts for p in part.parameters() if p.requires_grad and not isinstance(p, DTensor)
        ]
        self.group = group
        self.world = dist.get_world_size(group)
        self.numels = [p.numel() for p in self.params]

    def __bool__(self) -> bool:
        return bool(self.params) and self.world > 1

    @torch.no_grad()
    def all_reduce(self) -> None:
        """Every replicated .grad [*shape] (this rank's sum over its microbatches) -> the mean over the group's ranks,
        in place; through one flat float32 buffer [sum of numels] (a parameter without a gradient on this rank
        counts as zeros and gets the mean). One cat, one all-reduce, one division, one foreach copy back."""
        if not self:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.world)
        torch._foreach_copy_(grads, [part.view_as(g) for part, g in zip(flat.split(self.numels), grads)])


def reshard_gathered(model_parts: list[nn.Module]) -> None:
    """Every FSDP unit of `model_parts` back to its shards (a no-op for a unit that is already, or for no FSDP).

    A forward without backward (validation) leaves the units that are not resharded after forward (the root's, and
    by default the last block unit) gathered, and FSDP's next forward then gathers nothing for them. An eager training
    step after it uses those weights (still current) and its backward reshards them; a step replayed from a CUDA graph
    (training.cuda_graph) runs none of FSDP's Python, so the next validation would score the weights gathered for the
    one before. Validation calls this when it is done."""
    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


AUTO_UNIT_PARAMS = 100_000_000

# A part whose parameters, gathered in param_dtype, take at most this much is by default one FSDP unit, the root's (its
# blocks have no unit of their own: fsdp_blocks_per_unit 0 acts as -1), kept gathered from its forward to its backward
# (fsdp_reshard_after_forward "default"): one all-gather and one reduce-scatter per step and the fewest hooks. Such
# models wait for the host, and FSDP2's hooks cost host time per unit and parameter: on 2 H200s the 370M (0.74 GB in
# bf16) ran 63.1k tok/s per GPU in units of 15 blocks resharded after forward and 78.3k as one unit of its blocks
# beside the root's (separate calls, 2026-11-28); in one process, its small parameters replicated, the blocks in the
# root's unit took 180.3 ms per step against 194.4 ms as a unit of their own (one GPU: 167.0 ms; session 32,
# docs/performance.md). The 1.3B (2.7 GB) keeps units of ~100M parameters, resharded (0.95 of one GPU per GPU).
SMALL_PART_BYTES = 2 << 30


def unit_reshards(policy: str, index: int, n_units: int, pipelined: bool, small: bool) -> bool:
    """fsdp_reshard_after_forward for block unit `index` of `n_units`. "default": reshard, except the last unit (its
    parameters are needed again first in backward), except under pipeline parallel (every microbatch would
    all-gather the stage's blocks again) and except for a small part (SMALL_PART_BYTES)."""
    default = not pipelined and not small and index < n_units - 1
    return {"always": True, "never": False}.get(policy, default)


def gathered_bytes(model: nn.Module, param_dtype: torch.dtype) -> int:
    """The bytes of `model`'s parameters when all-gathered in param_dtype (the experts' too)."""
    return sum(p.numel() for p in model.parameters()) * param_dtype.itemsize


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
