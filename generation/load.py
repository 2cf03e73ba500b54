"""Load a trained model for sampling: `load_checkpoint(path) -> (model, tokenizer)`.

`path` is what training or conversion wrote: a training checkpoint `step-N/` (its run_record.json names the
model and the tokenizer), a weights-only folder from `python -m checkpoint.export` or an import from
`checkpoint.convert` (its model.toml), or any of those with `config=` a job TOML / model.toml that holds the
[model] section. The model is built through the one build path (parallelisms/parallelize.py) as one process,
its weights loaded strictly (layout-independent FQNs), and returned in eval mode on `device` in `dtype`.
"""

from __future__ import annotations

import os

import torch

from checkpoint.convert import MODEL_TOML, load_model_section, model_section_from_record
from checkpoint.export import load_model_weights
from checkpoint.run_record import read_record
from configs.job_config import JobConfig
from data.tokenizer import build_tokenizer
from models.args import ModelArgs
from parallelisms.mesh import ParallelDims
from parallelisms.parallelize import build_model_parts


def model_section(path: str, config: str | None = None) -> tuple[ModelArgs, str]:
    """(ModelArgs, tokenizer path) of the checkpoint at `path`: from `config` when given, else from the folder's
    own run_record.json (training checkpoints) or model.toml (imports), else a clear error."""
    if config:
        return load_model_section(config)
    record = read_record(path) if os.path.isdir(path) else None
    if record is not None:
        return model_section_from_record(record, [], path)
    if os.path.isfile(os.path.join(path, MODEL_TOML)):
        return load_model_section(os.path.join(path, MODEL_TOML))
    raise FileNotFoundError(
        f"{path} holds neither run_record.json (a training checkpoint step-N) nor {MODEL_TOML} (an import); pass "
        "the job TOML of the run that wrote it (--config / config=)"
    )


def load_checkpoint(
    path: str,
    config: str | None = None,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    tokenizer_path: str | None = None,
    kernels: str = "auto",
):
    """-> (model in eval mode, tokenizer). device: default CUDA when available; dtype: default bfloat16 on CUDA,
    float32 on the CPU. tokenizer_path overrides the recorded one ('' = the byte tokenizer)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    model_args, recorded_tokenizer = model_section(path, config)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    tokenizer = build_tokenizer(recorded_tokenizer if tokenizer_path is None else tokenizer_path)
    if tokenizer.vocab_size > model_args.vocab_size:
        raise ValueError(
            f"the tokenizer's ids go up to {tokenizer.vocab_size - 1} but the model has "
            f"{model_args.vocab_size}: pass the tokenizer the model was trained with"
        )
    cfg = JobConfig()  # one process: no parallelism, no activation checkpointing or compile
    cfg.model.kernels = kernels
    pdims = ParallelDims.from_config(cfg.parallelism, 1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model_parts(cfg, pdims, None, model_args, device, torch.float32).parts[0]
    load_model_weights([model], path)  # strict; every initialised value is overwritten
    return model.to(dtype).eval(), tokenizer
