"""The run record: what a checkpoint was trained with, saved beside its state and compared on resume.

`run_record.json` in every step-N folder (written before the folder is published) holds the resolved job
config, the model args (every ModelArgs field: what a model.toml would hold), a tokenizer fingerprint and the
data identity. On resume `compare_records` sorts the differences with the current run into:

  never loadable   the model (any ModelArgs field but kernel / init-only ones): restore [model] or start a
                   new run from the weights (checkpoint.initial_load_path).
  refused unless   the tokenizer (--checkpoint.allow_changed_tokenizer true) and the data: dataset, its
  overridden       path / config / split / text field, seq_len, document_masking, seed
                   (--checkpoint.allow_changed_data true). An override is logged as a warning.
  applied, logged  optimizer.*, lr_scheduler.*, training.steps / global_batch_size / max_norm and the MoE loss
                   coefficients: the current values are used from the first resumed step (the checkpoint
                   keeps only the optimizer's state tensors and the schedule's step count).
  free             everything else: parallelism degrees, batch split, kernels, compile, activation
                   checkpointing, logging, validation, checkpoint.* ...
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import torch

from data.loader import data_identity
from data.tokenizer import tokenizer_fingerprint

logger = logging.getLogger(__name__)

RECORD_FILE = "run_record.json"
FORMAT = 1

# ModelArgs fields that do not change the trained function: kernel choices and init-only settings.
FREE_MODEL_FIELDS = frozenset(
    {
        "chunk_size",
        "use_fused_path",
        "dt_min",
        "dt_max",
        "dt_init_floor",
        "initializer_range",
        "rescale_prenorm_residual",
    }
)
# ModelArgs fields that are training hyperparameters (loss terms), applied like the optimizer's.
APPLIED_MODEL_FIELDS = frozenset({"moe_load_balance_coeff", "moe_aux_loss_coeff", "moe_z_loss_coeff"})
DATA_FIELDS = (
    "dataset",
    "dataset_path",
    "dataset_config",
    "dataset_split",
    "dataset_text_field",
    "seq_len",
    "document_masking",
    "seed",
)
# data/loader.py's data_identity: the mixture (normalised), the shuffle settings, each shard folder's content hash.
# Records written before these existed lack them: they compare as the defaults (no mixture, no shards, no shuffle).
DATA_IDENTITY_DEFAULTS = {"datasets": [], "shuffle": None, "shuffle_buffer": 0, "shards": {}}
APPLIED_SECTIONS = ("optimizer", "lr_scheduler")
APPLIED_TRAINING_FIELDS = ("steps", "global_batch_size", "max_norm")


class ResumeMismatch(ValueError):
    """The checkpoint was trained with another model / tokenizer / data than this run."""


def build_run_record(job_config, model_args, tokenizer) -> dict:
    """The record of this run (JSON-able). job_config: a JobConfig; model_args: the resolved ModelArgs."""
    t = job_config.training
    return {
        "format": FORMAT,
        "job_config": dataclasses.asdict(job_config),
        "model_args": dataclasses.asdict(model_args),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "data": {**{k: getattr(t, k) for k in DATA_FIELDS}, **data_identity(job_config)},
        "torch_version": torch.__version__,
    }


def write_record(folder: str, record: dict) -> None:
    path = os.path.join(folder, RECORD_FILE)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_record(folder: str) -> dict | None:
    """The folder's record, None when it has none (a checkpoint written before run records)."""
    path = os.path.join(folder, RECORD_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ResumeMismatch(
            f"{path} is unreadable ({e}); it is part of the checkpoint: load another step with --checkpoint.load_step N"
        ) from e


def _diff(saved: dict, now: dict, keys, prefix: str) -> list[str]:
    missing = object()
    out = []
    for k in keys:
        a, b = saved.get(k, missing), now.get(k, missing)
        if a != b:
            out.append(
                f"{prefix}{k}: saved {'(absent)' if a is missing else repr(a)}, now "
                f"{'(absent)' if b is missing else repr(b)}"
            )
    return out


def compare_records(saved: dict, now: dict) -> dict[str, list[str]]:
    """Differences between a checkpoint's record and this run's, by category: "model", "tokenizer", "data"
    (refused unless overridden / never) and "applied" (logged). Each entry reads "key: saved X, now Y"."""
    sm, nm = saved.get("model_args", {}), now["model_args"]
    model_keys = sorted((set(sm) | set(nm)) - FREE_MODEL_FIELDS - APPLIED_MODEL_FIELDS)
    st, nt = saved.get("tokenizer", {}), now["tokenizer"]
    sj, nj = saved.get("job_config", {}), now["job_config"]
    applied = _diff(sm, nm, sorted(APPLIED_MODEL_FIELDS), "model.")
    for section in APPLIED_SECTIONS:
        s, n = sj.get(section, {}), nj[section]
        applied += _diff(s, n, sorted(set(s) | set(n)), f"{section}.")
    applied += _diff(sj.get("training", {}), nj["training"], APPLIED_TRAINING_FIELDS, "training.")
    return {
        "model": _diff(sm, nm, model_keys, "model."),
        "tokenizer": _diff(st, nt, sorted((set(st) | set(nt)) - {"path"}), "tokenizer "),
        "data": _diff(
            {**DATA_IDENTITY_DEFAULTS, "shuffle": now["data"].get("shuffle"), **saved.get("data", {})},
            now["data"],
            (*DATA_FIELDS, *DATA_IDENTITY_DEFAULTS),
            "training.",
        ),
        "applied": applied,
    }


def check_resume(path: str, saved: dict | None, now: dict | None, ckpt_cfg) -> None:
    """Raise ResumeMismatch (listing each difference, saved vs now, and the way out) if this run may not
    resume the checkpoint at `path`; log the overridden and the applied differences. Same result on every
    rank (each reads the same file)."""
    if now is None:
        return
    if saved is None:
        logger.warning(
            f"{path} has no {RECORD_FILE} (written before run records): its model, tokenizer and data "
            "cannot be compared with this run's; resuming on trust"
        )
        return
    diffs = compare_records(saved, now)
    errors = []
    if diffs["model"]:
        errors.append(
            "the model differs (never loadable: restore these [model] values, or start a new run from "
            "its weights with --checkpoint.initial_load_path and an empty checkpoint folder):\n    "
            + "\n    ".join(diffs["model"])
        )
    for kind, override in (("tokenizer", "allow_changed_tokenizer"), ("data", "allow_changed_data")):
        if not diffs[kind]:
            continue
        if getattr(ckpt_cfg, override, False):
            logger.warning(
                f"RESUMING WITH A CHANGED {kind.upper()} (checkpoint.{override}=true) from {path}: "
                + "; ".join(diffs[kind])
            )
        else:
            errors.append(
                f"the {kind} differs (restore it, or set --checkpoint.{override} true if the change "
                "is intended):\n    " + "\n    ".join(diffs[kind])
            )
    if errors:
        raise ResumeMismatch(
            f"cannot resume from {path}: this run is not the one that saved it.\n  - " + "\n  - ".join(errors)
        )
    for line in diffs["applied"]:
        # Raising training.steps is how a finished run is continued: said, not warned about.
        log = logger.info if line.startswith("training.steps:") else logger.warning
        log(f"resuming with a changed hyperparameter, applied from the first resumed step: {line}")
