"""Mamba2LM with torchtitan's ModelProtocol method: `init_weights(buffer_device=...)`.

torchtitan builds the model on the meta device, parallelises it (or its pipeline stages), calls `to_empty` and then
`init_weights(buffer_device=...)` on every part under no_grad. The values come from models/init.py: each parameter is
drawn from (seed, its name), so they are the same as mambatitan's own trainer gives, under any layout.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from models.init import init_weights
from models.mamba2.model import Mamba2LM


class TitanMamba2LM(Mamba2LM):
    """forward(tokens [b, s]) -> logits [b, s, V] as torchtitan calls it (no labels: its loss_fn takes the logits).

    The document-masking argument `seq_idx` stays available but torchtitan's dataloader does not produce it.
    """

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        # buffer_device (torchtitan: where buffers live under CPU offload) is unused: the model's only buffers are
        # per-step counters that models/init.py zeroes in place, on whatever device they were materialised.
        del buffer_device
        if not isinstance(self, FSDPModule):  # to_empty split the tied head from the embedding; FSDP keeps the tie
            self.tie_weights()
        init_weights(self, seed=self.args.init_seed, init_std=self.args.initializer_range)
