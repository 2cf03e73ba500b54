"""torchtitan's view of the model hyper-parameters: models/args.py's ModelArgs as a torchtitan BaseModelArgs.

torchtitan (0.2.2) picks `TrainSpec.model_args[--model.flavor]`, calls `update_from_config(job_config)` on it,
logs `dataclasses.asdict` of it, builds `model_cls(args)` on the meta device and asks
`get_nparams_and_flops(model, seq_len)` for the MFU. The flavors are exactly models/args.py's FLAVORS (no second
list to drift): `TitanMamba2Args` IS a ModelArgs, so Mamba2LM takes it unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from torchtitan.protocols.model import BaseModelArgs

from components.metrics import model_flops_per_token
from models.args import FLAVORS, ModelArgs


@dataclass
class TitanMamba2Args(ModelArgs, BaseModelArgs):
    # Not a model size: the seed that models/init.py draws every parameter from (by its name), copied from
    # torchtitan's --debug.seed by update_from_config so that init_weights(buffer_device=...) needs no config.
    init_seed: int = field(default=0, metadata={"doc": "Weight-initialisation seed (torchtitan's debug.seed)."})

    def update_from_config(self, job_config, **kwargs) -> None:
        """Take the seed from torchtitan's config and refuse sizes the model cannot build (before compute)."""
        del kwargs
        self.init_seed = job_config.debug.seed if job_config.debug.seed is not None else 0
        errors = self.validate()
        if errors:
            raise ValueError("mamba2 under torchtitan: " + "; ".join(errors))

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """(unique parameters, training FLOPs per token) with components/metrics.py's count (SSD, conv and
        attention terms included), so torchtitan's MFU matches mambatitan's."""
        n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        flops_per_token, _ = model_flops_per_token(self, seq_len)
        return n_params, int(flops_per_token)


def titan_flavors() -> dict[str, TitanMamba2Args]:
    """Every flavor of models/args.py as torchtitan model args (fresh instances: torchtitan mutates them), plus
    "<flavor>_untied" for each flavor with tied embeddings: torchtitan's --model.* cannot override a model size, and
    pipeline parallel under torchtitan needs an untied head (integrations/torchtitan/pipeline.py says why)."""
    flavors = {}
    for name, sizes in FLAVORS.items():
        flavors[name] = TitanMamba2Args(**sizes)
        if flavors[name].tie_embeddings:
            flavors[f"{name}_untied"] = TitanMamba2Args(**{**sizes, "tie_embeddings": False})
    return flavors
