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
import math
import os
import sys

import torch
import torch.distributed as dist

from checkpoint.export import load_model_weights
from checkpoint.manager import complete_steps, resolve_checkpoint_folder
from components.validation import Validator
from configs.parser import ConfigError, load_config_or_exit
from data.tokenizer import build_tokenizer
from models import build_model_args, build_model_on_meta
from models.init import init_weights
from parallelisms.mesh import ParallelDims


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
            f"--checkpoint.folder (relative to job.dump_folder) or --checkpoint.initial_load_path")
    if c.load_step >= 0 and c.load_step not in steps:
        raise FileNotFoundError(f"checkpoint.load_step={c.load_step} is not among the complete checkpoints {steps} "
                                f"in {folder}")
    return os.path.join(folder, f"step-{c.load_step if c.load_step >= 0 else steps[-1]}")


def evaluate(cfg, device: torch.device, world_size: int) -> dict:
    """Build, load, validate; collective under torchrun. Returns Validator.run's dict plus the checkpoint path."""
    pdims = ParallelDims.from_config(cfg.parallelism, world_size)
    if pdims.pp_enabled:
        raise ConfigError("evaluate.py does not run pipeline parallel; use FSDP (--parallelism.pipeline_parallel_degree 1)")
    model_args = build_model_args(cfg.model.flavor, cfg.model_overrides)
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    if tokenizer.vocab_size > model_args.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size="
                          f"{model_args.vocab_size}; set --model.tokenizer_path / --model.vocab_size to match the checkpoint")
    path = resolve_weights(cfg)
    mesh = pdims.build_mesh(device.type)
    torch.manual_seed(cfg.training.seed)
    bf16 = device.type == "cuda" and cfg.training.mixed_precision_param == "bfloat16"
    model = build_model_on_meta(model_args)
    model.set_kernel_backend("reference" if cfg.model.kernels == "reference" else "auto")
    if pdims.cp_enabled:
        from parallelisms.context_parallel import apply_context_parallel

        apply_context_parallel(model, mesh["cp"].get_group(), cfg.parallelism.context_parallel_load_balance)
    if pdims.ep_enabled:
        from parallelisms.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, pdims)
    if pdims.fsdp_enabled:
        from parallelisms.fsdp import apply_fsdp

        apply_fsdp(model, mesh, cfg.parallelism, param_dtype=torch.bfloat16 if bf16 else torch.float32, pdims=pdims)
    model.to_empty(device=device)
    if not pdims.fsdp_enabled:
        model.tie_weights()  # to_empty unties shared meta parameters (FSDP keeps the tie)
    init_weights(model, seed=cfg.training.seed, init_std=model_args.initializer_range)  # buffers; weights overwritten
    pg = dist.new_group(backend="gloo") if dist.is_initialized() else None  # DCP coordinates over CPU objects
    load_model_weights([model], path, process_group=pg)
    out = Validator(cfg, [model], tokenizer, mesh, pdims, device).run(0)
    return {**out, "checkpoint": os.path.abspath(path)}


def main(argv: list[str] | None = None) -> None:
    from train import init_distributed

    cfg = load_config_or_exit(argv, usage=__doc__)
    if cfg is None:
        return
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = init_distributed(world_size)
    try:
        result = evaluate(cfg, device, world_size)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        sys.exit(f"evaluate error: {e}")
    if rank == 0:
        print(f"loss {result['val_loss']:.6f} | perplexity {result['val_ppl']:.4f} | {result['val_tokens']} tokens "
              f"| {result['checkpoint']}")
        print("evaluation: " + json.dumps(result), flush=True)
    assert math.isfinite(result["val_loss"])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
