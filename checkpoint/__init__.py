"""DCP checkpointing: CheckpointManager (save / async save / resume / retention) and weights-only export.

Names are imported lazily so that `python -m checkpoint.export` does not import its own module twice.
"""

import importlib

_WHERE = {
    "CheckpointManager": "checkpoint.manager",
    "complete_steps": "checkpoint.manager",
    "convert_to_weights_only": "checkpoint.export",
    "export_model_weights": "checkpoint.export",
    "load_model_weights": "checkpoint.export",
    "resolve_checkpoint_folder": "checkpoint.manager",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
