"""Model-weights-only DCP folders: write them, read them (strictly), and convert a training checkpoint to one.

A weights-only folder is a DCP checkpoint whose keys are the model's fully-qualified parameter / buffer
names ("layers.3.mixer.in_proj.weight", no "model." prefix). It is what `checkpoint.initial_load_path`
reads, what a `last_save_model_only` save writes, and what importers of foreign weights should produce
(build the model, fill it, call `export_model_weights`).

    python -m checkpoint.export --checkpoint outputs/checkpoint/step-1000 --out weights/ --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A training checkpoint (checkpoint/manager.py) always holds this key; a weights-only folder never does.
TRAIN_STATE_KEY = "train_state.step"
_SHOW = 5  # how many offending keys an error message lists


@contextlib.contextmanager
def single_process_quiet():
    """DCP warns on every call without a process group; one process is a supported, intended use here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


class ModelState:
    """Stateful adapter: the FQN-keyed state of every model part, merged.

    Layers sit in an nn.ModuleDict keyed by their global index, and pipeline stages only delete entries,
    so the FQNs (and the saved checkpoint) do not depend on the layout. FSDP2 parameters stay sharded
    DTensors; DCP writes / reads each rank's shards.
    """

    def __init__(self, model_parts: list[nn.Module]):
        if isinstance(model_parts, nn.Module):
            model_parts = [model_parts]
        if not model_parts or not all(isinstance(m, nn.Module) for m in model_parts):
            raise TypeError("model_parts must be a non-empty list of nn.Module (one per pipeline stage held)")
        self.model_parts = list(model_parts)

    def aliases(self) -> set[str]:
        """FQNs naming a parameter that an earlier FQN already names (tied weights: `lm_head.weight` is
        `tok_embeddings.weight`, also on a last pipeline stage that holds the tied copy). Saved once, under the
        owner's name; loading the owner fills the alias."""
        names: set[str] = set()
        for part in self.model_parts:
            every = {n for n, _ in part.named_parameters(remove_duplicate=False)}
            names |= every - {n for n, _ in part.named_parameters()}
        return names

    def state_dict(self) -> dict:
        merged: dict = {}
        for part in self.model_parts:
            merged.update(get_model_state_dict(part, options=StateDictOptions()))
        for alias in self.aliases():  # one tensor per logical weight in the checkpoint
            merged.pop(alias, None)
        return merged

    def load_state_dict(self, state_dict: dict) -> None:
        # strict=False: the merged dict holds the keys of every part, each part takes its own.
        for part in self.model_parts:
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


def cast_floating(state_dict: dict, dtype: torch.dtype) -> dict:
    """Floating tensors (DTensors included, sharding kept) cast to dtype; everything else as is."""
    return {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in state_dict.items()
    }


def read_metadata(path: str) -> Metadata:
    """The DCP metadata of a checkpoint folder, or a clear error saying why it cannot be read."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint folder {path} does not exist")
    if not os.path.isdir(path):
        raise NotADirectoryError(f"checkpoint path {path} is a file; it must be a DCP checkpoint folder")
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise FileNotFoundError(
            f"{path} is not a complete DCP checkpoint (no .metadata file): it is unfinished or not a checkpoint"
        )
    try:
        return FileSystemReader(path).read_metadata()
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised with the path and the likely cause
        raise RuntimeError(
            f"cannot read the DCP metadata of {path} (corrupt, or written by an incompatible torch?): {e}"
        ) from e


def model_prefix(metadata: Metadata) -> str:
    """'model.' for a full training checkpoint (its weights sit under "model"), '' for a weights-only one."""
    return "model." if TRAIN_STATE_KEY in metadata.state_dict_metadata else ""


def _gather_keys(keys: set[str], process_group) -> set[str]:
    """Union of every rank's key set (object all-gather: a list of world_size sets, merged)."""
    if not (dist.is_available() and dist.is_initialized()):
        return set(keys)
    gathered: list = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, sorted(keys), group=process_group)
    return set().union(*map(set, gathered))


def check_model_keys(
    local: dict, metadata: Metadata, prefix: str, path: str, process_group=None, aliases: set[str] = frozenset()
) -> None:
    """Raise if the checkpoint and the model disagree: keys missing from the checkpoint, checkpoint keys that
    no rank's model has (pipeline stages together own every layer), or shapes that differ. `aliases` (tied
    weights' second names) may be in the checkpoint (older saves wrote them) and are not loaded.

    Collective when a process group is initialised (every rank must call it).
    """
    ckpt = {
        k[len(prefix) :]: md
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    all_model_keys = _gather_keys(set(local), process_group)
    missing = sorted(k for k in local if k not in ckpt)
    unexpected = sorted(k for k in ckpt if k not in all_model_keys and k not in aliases)
    mismatched = [
        f"{k}: checkpoint {tuple(ckpt[k].size)} vs model {tuple(v.shape)}"
        for k, v in local.items()
        if k in ckpt and isinstance(v, torch.Tensor) and tuple(ckpt[k].size) != tuple(v.shape)
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} model keys missing from the checkpoint, e.g. {missing[:_SHOW]}")
    if unexpected:
        problems.append(f"{len(unexpected)} checkpoint keys the model does not have, e.g. {unexpected[:_SHOW]}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatches, e.g. {mismatched[:_SHOW]}")
    if problems:
        raise ValueError(
            f"model weights in {path} do not match this model: "
            + "; ".join(problems)
            + ". Check that [model] (flavor, d_model, n_layers, vocab, layer_pattern) matches the checkpoint's."
        )


def export_model_weights(
    model_parts: list[nn.Module], out_dir: str, dtype: str | torch.dtype = "float32", process_group=None
) -> None:
    """Write the model's weights (cast to dtype) as a weights-only DCP folder at out_dir.

    Collective when a process group is initialised: every rank writes its own shards / stages, rank 0 the
    metadata. Written into `<out_dir>.partial` and renamed, so out_dir is complete or absent.
    """
    state = cast_floating(ModelState(model_parts).state_dict(), parse_dtype(dtype))
    out_dir = os.path.abspath(out_dir)
    tmp = out_dir.rstrip("/") + ".partial"
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        if os.path.exists(out_dir):
            raise FileExistsError(f"{out_dir} already exists; remove it or choose another --out")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    if dist.is_initialized():
        dist.barrier(group=process_group)
    with single_process_quiet():
        dcp.save(state, storage_writer=FileSystemWriter(tmp), process_group=process_group)
    if rank0:
        os.rename(tmp, out_dir)
    if dist.is_initialized():
        dist.barrier(group=process_group)


def load_model_weights(model_parts: list[nn.Module], path: str, process_group=None) -> None:
    """Load model weights from a weights-only DCP folder (or the "model" entries of a training checkpoint).

    Strict: every model key must be in the checkpoint with the same shape, and every checkpoint key must
    belong to some rank's model part. Stored dtypes are cast to the model's. Collective under a process group.
    """
    metadata = read_metadata(path)
    prefix = model_prefix(metadata)
    model = ModelState(model_parts)
    local = model.state_dict()
    check_model_keys(local, metadata, prefix, path, process_group, aliases=model.aliases())
    target = {"model": local} if prefix else local
    try:
        with single_process_quiet():
            dcp.load(target, storage_reader=FileSystemReader(path), process_group=process_group)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised with the path
        raise RuntimeError(f"failed to read model weights from {path} (corrupt checkpoint?): {e}") from e
    model.load_state_dict(local)


def read_model_tensors(path: str, metadata: Metadata | None = None) -> dict[str, torch.Tensor]:
    """The model tensors of a training checkpoint (step-N) or weights-only DCP folder, FQN-keyed, on the CPU.

    One process, no process group, no model instance: tensors are allocated from the checkpoint's metadata (shapes,
    dtypes) and filled by dcp.load. Holds the whole model in CPU memory once."""
    metadata = read_metadata(path) if metadata is None else metadata
    prefix = model_prefix(metadata)
    weights = {
        k[len(prefix) :]: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    if not weights:
        raise ValueError(f"{path} holds no model tensors (keys start with {prefix!r})")
    with single_process_quiet():
        dcp.load({"model": weights} if prefix else weights, storage_reader=FileSystemReader(path))
    return weights


def write_weights_folder(
    weights: dict[str, torch.Tensor],
    out_dir: str,
    extra_files: dict[str, str] | None = None,
    copy_files: tuple[str, ...] = (),
) -> None:
    """A weights-only DCP folder, complete or absent: written to <out>.partial and renamed at the end, with text
    files (extra_files: name -> content) and copies of existing files (copy_files: paths) beside the tensors."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir):
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another output folder")
    tmp = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    with single_process_quiet():
        dcp.save(weights, storage_writer=FileSystemWriter(tmp))
    for name, text in (extra_files or {}).items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    for src in copy_files:
        shutil.copy2(src, tmp)
    os.rename(tmp, out_dir)


def convert_to_weights_only(checkpoint_dir: str, out_dir: str, dtype: str | torch.dtype = "float32") -> list[str]:
    """Single process: read the model tensors of a checkpoint, cast them and write a weights-only folder (with the
    checkpoint's run_record.json, which keeps the export self-describing: model, tokenizer). Returns the keys."""
    if dist.is_initialized():
        raise RuntimeError("convert_to_weights_only runs in one process; use export_model_weights under torchrun")
    weights = cast_floating(read_model_tensors(checkpoint_dir), parse_dtype(dtype))
    record = os.path.join(checkpoint_dir, "run_record.json")
    write_weights_folder(weights, out_dir, copy_files=(record,) if os.path.isfile(record) else ())
    return sorted(weights)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m checkpoint.export",
        description="Convert a training checkpoint (step-N/) into a weights-only DCP folder for initial_load_path.",
    )
    p.add_argument("--checkpoint", required=True, help="A step-N folder written by CheckpointManager.")
    p.add_argument("--out", required=True, help="Output folder (must not exist).")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="Dtype of floating tensors.")
    args = p.parse_args(argv)
    keys = convert_to_weights_only(args.checkpoint, args.out, args.dtype)
    print(f"wrote {len(keys)} tensors ({args.dtype}) to {os.path.abspath(args.out)}")


if __name__ == "__main__":
    main()
