"""Launch torchtitan's trainer with the "mamba2" TrainSpec registered (run from the repository root):

    python -m integrations.torchtitan.train --job.config_file integrations/torchtitan/mamba2_debug.toml
    torchrun --nproc_per_node 8 -m integrations.torchtitan.train --job.config_file ... \\
        --parallelism.pipeline_parallel_degree 2

Every torchtitan flag works as with `python -m torchtitan.train`; torchtitan needs CUDA (or another accelerator).
"""

from __future__ import annotations

import os
import sys

from torch._utils import _get_available_device_type

import integrations.torchtitan  # noqa: F401  (registers "mamba2")


def main() -> None:
    # lazy: torchtitan is an optional extra, and heavy
    from torchtitan.train import Trainer
    from torchtitan.train import main as torchtitan_main

    # torchtitan picks its device the same way and, finding none, fails deep inside with a CUDA AttributeError.
    if _get_available_device_type() is None:
        sys.exit(
            "torchtitan's trainer needs an accelerator (CUDA) and none is visible; on a CPU use mambatitan's "
            "own trainer: python train.py --job.config_file configs/debug.toml"
        )

    # torchtitan reads LOCAL_RANK / WORLD_SIZE that torchrun sets; a plain `python -m` run is one process.
    for key, value in (
        ("LOCAL_RANK", "0"),
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "localhost"),
        ("MASTER_PORT", "29511"),
    ):
        os.environ.setdefault(key, value)
    torchtitan_main(Trainer)


if __name__ == "__main__":
    main()
