"""DCP checkpointing: CheckpointManager (save / async save / resume / retention) and weights-only export."""

from checkpoint.export import convert_to_weights_only, export_model_weights, load_model_weights
from checkpoint.manager import CheckpointManager, complete_steps

__all__ = [
    "CheckpointManager",
    "complete_steps",
    "convert_to_weights_only",
    "export_model_weights",
    "load_model_weights",
]
