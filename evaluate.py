"""Evaluate a checkpoint: validation loss and perplexity, the numbers in-training validation reports.

    python evaluate.py --job.config_file configs/debug.toml --checkpoint.folder outputs/debug/checkpoint \
        [--checkpoint.load_step N] [--validation.dataset X] [--validation.steps N]
    python evaluate.py --job.config_file weights/130m/model.toml --checkpoint.initial_load_path weights/130m
    torchrun --nproc_per_node 4 evaluate.py ...            # FSDP (and CP) like train.py; not pipeline parallel

The model is built as train.py builds it (config, mesh, FSDP / CP), its weights are loaded from the checkpoint
(a full training checkpoint step-N, or a weights-only DCP folder) and components.validation.Validator runs
over validation.steps batches (-1 = the whole validation set). Which weights:
  --checkpoint.initial_load_path W   that weights-only folder (or step-N folder);
  else checkpoint.folder (relative to job.dump_folder unless absolute; a path that exists as given also works):
       a step-N / weights-only folder itself, or a folder of step-N's (checkpoint.load_step, -1 = the latest).
Rank 0 prints the result and, as its last line, `evaluation: {json}`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys

import torch
import torch.distributed as dist

from checkpoint.export import load_model_weights
from checkpoint.manager import complete_steps, resolve_checkpoint_folder
from components.distributed import destroy_distributed, init_distributed, set_determinism
from components.log import setup_logging
from components.validation import Validator
from configs.checks import resolve_job
from configs.parser import ConfigError, load_config_or_exit
from parallelisms.parallelize import build_model_parts

logger = logging.getLogger(__name__)


def resolve_weights(cfg) -> str:
    """The DCP folder to load model weights from (see the module docstring), or a clear error."""
    c = cfg.checkpoint
    if c.initial_load_path:
        return c.initial_load_path
    raw = os.path.expanduser(c.folder)
    folder = resolve_checkpoint_folder(c.folder, cfg.job.dump_folder)
    if not os.path.isdir(folder) and os.path.isdir(raw):
        folder = raw
    if os.path.isfile(os.path.join(folder, ".metadata")):
        return folder  # a step-N or weights-only folder itself
    steps = complete_steps(folder)
    if not steps:
        raise FileNotFoundError(
            f"no checkpoint to evaluate: {folder} holds no complete step-N folder (and is not a DCP folder); set "
            f"--checkpoint.folder (relative to job.dump_folder) or --checkpoint.initial_load_path"
        )
    if c.load_step >= 0 and c.load_step not in steps:
        raise FileNotFoundError(
            f"checkpoint.load_step={c.load_step} is not among the complete checkpoints {steps} in {folder}"
        )
    return os.path.join(folder, f"step-{c.load_step if c.load_step >= 0 else steps[-1]}")


def evaluate(cfg, device: torch.device, world_size: int) -> dict:
    """Build (train.py's build path), load, validate; collective under torchrun. Returns Validator.run's dict plus
    the checkpoint path."""
    job = resolve_job(cfg, world_size, training=False)
    if job.pdims.pp_enabled:
        raise ConfigError(
            "evaluate.py does not run pipeline parallel; use FSDP (--parallelism.pipeline_parallel_degree 1)"
        )
    path = resolve_weights(cfg)
    mesh = job.pdims.build_mesh(device.type)
    set_determinism(cfg.training.seed, cfg.training.deterministic, device)
    bf16 = device.type == "cuda" and cfg.training.mixed_precision_param == "bfloat16"
    model = build_model_parts(cfg, job.pdims, mesh, job.model_args, device, torch.bfloat16 if bf16 else torch.float32)
    pg = dist.new_group(backend="gloo") if dist.is_initialized() else None  # DCP coordinates over CPU objects
    load_model_weights(model.parts, path, process_group=pg)  # the initialised weights are all overwritten
    out = Validator(cfg, model.parts, job.tokenizer, mesh, job.pdims, job.batch, device).run(0)
    return {**out, "checkpoint": os.path.abspath(path)}


def main(argv: list[str] | None = None) -> None:
    setup_logging()  # the same `[rankN] time message` lines as train.py (components/log.py)
    cfg = load_config_or_exit(argv, usage=__doc__, prog="evaluate.py")
    if cfg is None:
        return
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = init_distributed(world_size)
    try:
        result = evaluate(cfg, device, world_size)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        sys.exit(f"evaluate error: {e}")
    if rank == 0:
        logger.info(
            f"loss {result['val_loss']:.6f} | perplexity {result['val_ppl']:.4f} | {result['val_tokens']} "
            f"tokens | {result['checkpoint']}"
        )
        print("evaluation: " + json.dumps(result), flush=True)  # the machine-readable last line, unprefixed
    assert math.isfinite(result["val_loss"])
    destroy_distributed()


if __name__ == "__main__":
    main()
