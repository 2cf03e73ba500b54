"""Mamba-2 as a torchtitan (0.2.2) model: importing this package registers the TrainSpec "mamba2".

    torchrun --nproc_per_node 8 -m integrations.torchtitan.train \\
        --job.config_file integrations/torchtitan/mamba2_debug.toml --parallelism.data_parallel_shard_degree 8

or torchtitan's own entry point with `--experimental.custom_import integrations.torchtitan` (run from the repo root).
The spec reuses mambatitan's model (models/), initialisation (models/init.py), loss (models/loss.py), FSDP / AC /
compile (parallelisms/), pipeline split (parallelisms/pipeline.py), MoE balancing (components/moe_balance.py) and data
(data/); torchtitan supplies the trainer, optimizer, lr schedule, checkpointing and metrics. README.md, "Training
with torchtitan's trainer", lists what works and what does not.
"""

from __future__ import annotations

from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.protocols import train_spec as train_spec_module

from integrations.torchtitan.args import TitanMamba2Args, titan_flavors
from integrations.torchtitan.data import build_mamba2_dataloader, build_mamba2_tokenizer
from integrations.torchtitan.loss import build_mamba2_loss
from integrations.torchtitan.model import TitanMamba2LM
from integrations.torchtitan.optimizer import build_mamba2_optimizers
from integrations.torchtitan.parallelize import parallelize_mamba2
from integrations.torchtitan.pipeline import pipeline_mamba2

MODEL_NAME = "mamba2"


def get_train_spec() -> train_spec_module.TrainSpec:
    return train_spec_module.TrainSpec(
        model_cls=TitanMamba2LM,
        model_args=titan_flavors(),
        parallelize_fn=parallelize_mamba2,
        pipelining_fn=pipeline_mamba2,
        build_optimizers_fn=build_mamba2_optimizers,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_mamba2_dataloader,
        build_tokenizer_fn=build_mamba2_tokenizer,
        build_loss_fn=build_mamba2_loss,
    )


def register() -> None:
    """Register "mamba2" with torchtitan once (importing twice, e.g. by custom_import and the launcher, is fine)."""
    if MODEL_NAME not in train_spec_module._extra_train_specs:
        train_spec_module.register_train_spec(MODEL_NAME, get_train_spec())


register()

__all__ = ["MODEL_NAME", "TitanMamba2Args", "TitanMamba2LM", "get_train_spec", "register"]
