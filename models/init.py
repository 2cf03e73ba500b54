"""Layout-independent weight initialisation.

Every parameter is drawn as its FULL tensor from a generator seeded by (training.seed, its fully-qualified
name), then the rank keeps its own shard (FSDP / EP DTensors) or nothing is cut at all. Because the
names never change (layers live in a ModuleDict), a parameter gets the same values whether the model is
on one process, FSDP-sharded, split into pipeline stages or split over experts.

Rules: the nearest enclosing module that defines `init_param(name, full, generator)` fills the tensor
(`name` relative to that module); otherwise Embedding -> normal(0, initializer_range), Linear / Conv ->
PyTorch's default uniform, biases -> 0, norm weights -> 1. Buffers are zeroed, or filled by a module's
`init_buffers()`.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Wrappers that insert a level into parameter names without changing the model (activation checkpointing,
# torch.compile, FSDP1-style flat wrappers); the canonical name, which seeds the generator, leaves them out.
_WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def canonical_name(fqn: str) -> str:
    return ".".join(part for part in fqn.split(".") if part not in _WRAPPER_NAMES)


def _param_generator(seed: int, fqn: str, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(canonical_name(fqn).encode())) % (2**63))
    return g


@torch.no_grad()
def _default_init(module: nn.Module, name: str, full: torch.Tensor, gen: torch.Generator, init_std: float) -> None:
    if isinstance(module, nn.Embedding):
        full.normal_(0.0, init_std, generator=gen)
    elif name == "bias":
        if isinstance(module, nn.Conv1d):
            bound = 1.0 / math.sqrt(module.weight[0].numel())
            full.uniform_(-bound, bound, generator=gen)
        else:
            full.zero_()
    elif isinstance(module, (nn.Linear, nn.Conv1d)):
        bound = 1.0 / math.sqrt(full[0].numel())
        full.uniform_(-bound, bound, generator=gen)
    elif name == "weight" and full.dim() == 1:  # norms
        full.fill_(1.0)
    else:
        raise KeyError(f"no initialisation rule for {type(module).__name__}.{name}; give the module init_param()")


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, init_std: float = 0.02) -> None:
    """Fill every parameter and buffer of `model` (already materialised, e.g. after to_empty)."""
    modules = dict(model.named_modules())
    seen: set[int] = set()
    for fqn, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        is_dtensor = isinstance(param, DTensor)
        local = param.to_local() if is_dtensor else param
        full = torch.empty(param.shape, dtype=torch.float32, device=local.device)
        gen = _param_generator(seed, fqn, local.device)
        parts = fqn.split(".")
        for cut in range(len(parts) - 1, -1, -1):
            owner = modules.get(".".join(parts[:cut]))
            if owner is not None and hasattr(owner, "init_param"):
                owner.init_param(".".join(parts[cut:]), full, gen)
                break
        else:
            _default_init(modules[".".join(parts[:-1])], parts[-1], full, gen, init_std)
        if is_dtensor:
            full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        local.copy_(full)
    for module in model.modules():
        if hasattr(module, "init_buffers"):
            module.init_buffers()
        else:
            for buf in module.buffers(recurse=False):
                buf.zero_()
