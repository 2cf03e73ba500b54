"""Model building: ModelArgs -> a Mamba2LM on the meta device (materialise + init_weights after parallelising)."""

from __future__ import annotations

import torch

from models.args import ModelArgs, build_model_args
from models.mamba2.model import Mamba2LM


def build_model_on_meta(args: ModelArgs) -> Mamba2LM:
    with torch.device("meta"):
        return Mamba2LM(args)


__all__ = ["ModelArgs", "Mamba2LM", "build_model_args", "build_model_on_meta"]
