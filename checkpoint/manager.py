"""DCP checkpointing: save / async save / resume / retention, complete-or-absent on disk.

Layout: `<folder>/step-N/` (DCP files + `.metadata`). A save is written into `<folder>/.step-N.partial/` and
renamed to `step-N` by rank 0 once every rank's data and the metadata are on disk (rename is atomic), so a
process killed at any moment never leaves a `step-N` that is incomplete. A checkpoint is complete iff
`step-N/.metadata` exists. Stale `.step-N.partial` folders are removed by rank 0 at the next save / load.

Saved entries (DCP flattens them to dotted keys):
    model         FQN-keyed weights merged over model parts (layout-independent; sharded DTensors under FSDP2)
    optimizer     FQN-keyed, flattened optimizer state merged over parts (each rank loads only its params' keys)
    lr_scheduler  the first scheduler's state (all parts' schedulers are identical)
    dataloader    dataloader.state_dict() (global, identical on all ranks)
    train_state   {"step": N, **extra_state}
    rng           rank 0's torch / cuda / numpy / python RNG state (restored on every rank)
A model-only save (last step with last_save_model_only) holds the FQN-keyed weights alone, like export.py.
"""

from __future__ import annotations

import logging
import os
import pickle
import random
import re
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from checkpoint.export import (
    TRAIN_STATE_KEY,
    ModelState,
    cast_floating,
    check_model_keys,
    load_model_weights,
    parse_dtype,
    read_metadata,
    single_process_quiet,
)

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d+)$")
_STALE_RE = re.compile(r"^\.step-\d+\.(partial|replaced)$")
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


# ----------------------------------------------------------------------------------------------- adapters
class OptimizerState:
    """Stateful adapter: flattened FQN-keyed optimizer state ("state.<fqn>.exp_avg", "param_groups.<fqn>.lr")
    merged over (model part, optimizer) pairs. Flattened keys are per parameter, so a rank owning a subset of
    the parameters (pipeline stage, other FSDP degree) picks exactly its own on load."""

    def __init__(self, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]):
        if len(optimizers) != len(model_parts):
            raise ValueError(
                f"got {len(optimizers)} optimizers for {len(model_parts)} model parts: pass one optimizer per part"
            )
        self.pairs = list(zip(model_parts, optimizers))

    def state_dict(self) -> dict:
        merged: dict = {}
        for model, optim in self.pairs:
            merged.update(get_optimizer_state_dict(model, optim, options=_FLAT))
        return merged

    def load_state_dict(self, state_dict: dict) -> None:
        for model, optim in self.pairs:
            set_optimizer_state_dict(model, optim, optim_state_dict=state_dict, options=_FLAT)


class SchedulerState:
    """Stateful adapter: every part's LR scheduler steps identically, so one state is saved, all are loaded."""

    def __init__(self, lr_schedulers: list):
        self.lr_schedulers = list(lr_schedulers)

    def state_dict(self) -> dict:
        return self.lr_schedulers[0].state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        for sched in self.lr_schedulers:
            sched.load_state_dict(dict(state_dict))


class TrainState:
    """Stateful adapter: the step and `extra_state` (values may be Stateful objects or plain picklables;
    plain ones are replaced in the dict in place on load)."""

    def __init__(self, extra_state: dict | None):
        self.step = 0
        self.extra_state = extra_state if extra_state is not None else {}
        if "step" in self.extra_state:
            raise ValueError("extra_state may not use the key 'step' (the train step is saved under it)")
        self.load_only: set[str] | None = None  # extra keys present in the checkpoint being loaded

    def state_dict(self) -> dict:
        sd: dict = {"step": self.step}
        for k, v in self.extra_state.items():
            if self.load_only is None or k in self.load_only:
                sd[k] = v.state_dict() if isinstance(v, Stateful) else v
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = int(state_dict["step"])
        for k, v in state_dict.items():
            if k == "step":
                continue
            if isinstance(self.extra_state.get(k), Stateful):
                self.extra_state[k].load_state_dict(v)
            else:
                self.extra_state[k] = v


class RNGState:
    """Stateful adapter: rank 0's RNG states, broadcast so every rank saves (and later restores) the same."""

    def __init__(self, process_group=None):
        self.process_group = process_group

    def state_dict(self) -> dict:
        blob = pickle.dumps((np.random.get_state(), random.getstate()))
        # numpy / python states as one pickled bytes object: DCP stores it whole (its length may vary, so it
        # cannot be a tensor loaded in place)
        sd = {"torch": torch.get_rng_state(), "host": blob}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = torch.cuda.get_rng_state()
        if dist.is_initialized():
            box = [sd]
            dist.broadcast_object_list(box, src=0, group=self.process_group)  # (dict of CPU tensors) rank 0 -> all
            sd = box[0]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        torch.set_rng_state(state_dict["torch"])
        np_state, py_state = pickle.loads(state_dict["host"])
        np.random.set_state(np_state)
        random.setstate(py_state)
        if "cuda" in state_dict and torch.cuda.is_available():
            torch.cuda.set_rng_state(state_dict["cuda"])


# --------------------------------------------------------------------------------------------- folders
def complete_steps(folder: str) -> list[int]:
    """Sorted steps N with a complete `folder/step-N` (its DCP `.metadata` exists)."""
    if not os.path.isdir(folder):
        return []
    steps = []
    for name in os.listdir(folder):
        m = _STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(folder, name, ".metadata")):
            steps.append(int(m.group(1)))
    return sorted(steps)


def _fsync_dir(path: str) -> None:
    """Make a rename durable (the directory entry itself)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@dataclass
class _Pending:
    future: Any
    step: int


# --------------------------------------------------------------------------------------------- manager
class CheckpointManager:
    """Saves and resumes training state with DCP; see the module docstring for layout and contents.

    Collective when a process group is initialised: every rank constructs it and calls save / load / wait
    at the same steps.
    """

    def __init__(
        self,
        ckpt_cfg,
        dump_folder: str,
        model_parts: list[nn.Module],
        optimizers: list[torch.optim.Optimizer],
        lr_schedulers: list,
        dataloader: Stateful | None,
        extra_state: dict | None = None,
    ):
        self.cfg = ckpt_cfg
        self.enabled = bool(ckpt_cfg.enable)
        folder = os.path.expanduser(ckpt_cfg.folder)
        self.folder = folder if os.path.isabs(folder) else os.path.join(dump_folder, folder)
        if os.path.exists(self.folder) and not os.path.isdir(self.folder):
            raise NotADirectoryError(
                f"checkpoint.folder {self.folder} exists and is a file; point --checkpoint.folder at a directory"
            )
        if self.enabled and ckpt_cfg.interval < 1:
            raise ValueError(f"checkpoint.interval must be >= 1, got {ckpt_cfg.interval}")
        if ckpt_cfg.keep_latest_k < 0:
            raise ValueError(f"checkpoint.keep_latest_k must be >= 0 (0 keeps all), got {ckpt_cfg.keep_latest_k}")
        if ckpt_cfg.async_mode not in ("disabled", "async"):
            raise ValueError(f"checkpoint.async_mode must be 'disabled' or 'async', got {ckpt_cfg.async_mode!r}")
        self.export_dtype = parse_dtype(ckpt_cfg.export_dtype)
        if isinstance(model_parts, nn.Module):
            model_parts = [model_parts]
        self.model_parts = list(model_parts)
        self.model = ModelState(self.model_parts)
        self.optimizer = OptimizerState(self.model_parts, optimizers) if optimizers else None
        self.lr_scheduler = SchedulerState(lr_schedulers) if lr_schedulers else None
        if dataloader is not None and not isinstance(dataloader, Stateful):
            raise TypeError(f"dataloader {type(dataloader).__name__} has no state_dict / load_state_dict")
        self.dataloader = dataloader
        self.train_state = TrainState(extra_state)
        self.extra_state = self.train_state.extra_state

        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        # A dedicated gloo group: DCP's coordination (and an async save's background thread) must not
        # interleave with the training collectives on the default group, and must work with CPU objects.
        self.pg = None
        if self.distributed and (self.enabled or ckpt_cfg.initial_load_path):
            self.pg = dist.new_group(backend="gloo")
        self.rng = RNGState(self.pg)
        self.use_async = self.enabled and ckpt_cfg.async_mode == "async"
        if self.use_async and not hasattr(dcp, "async_save"):
            logger.warning("this torch has no dcp.async_save: checkpoints are saved synchronously")
            self.use_async = False
        self._pending: _Pending | None = None

    # ---------------------------------------------------------------------------------------- helpers
    def step_dir(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def _partial_dir(self, step: int) -> str:
        return os.path.join(self.folder, f".step-{step}.partial")

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.pg)

    def _broadcast(self, obj):
        """A picklable object from rank 0 to every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def _remove_stale(self) -> None:
        """Rank 0: delete `.step-N.partial` / `.step-N.replaced` leftovers of killed or failed saves."""
        if self.rank != 0 or not os.path.isdir(self.folder):
            return
        for name in os.listdir(self.folder):
            if _STALE_RE.match(name):
                logger.info(f"removing unfinished checkpoint {name}")
                shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)

    def _full_state(self, step: int) -> dict:
        self.train_state.step = step
        self.train_state.load_only = None
        state: dict = {"model": self.model, "train_state": self.train_state, "rng": self.rng}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler
        if self.dataloader is not None:
            state["dataloader"] = self.dataloader
        return state

    # ------------------------------------------------------------------------------------------- save
    def save(self, step: int, last_step: bool = False) -> bool:
        """Save when enabled and (step % interval == 0 or last_step). Returns whether a save was started.

        Async mode: starts a background write (at most one in flight) and returns; the folder is renamed to
        step-N when it completes (noticed here at a later call, or in wait() / close()). Last-step saves are
        synchronous; with last_save_model_only they hold the model alone, cast to export_dtype.
        """
        if not self.enabled:
            return False
        self._poll()
        if not (step % self.cfg.interval == 0 or last_step):
            return False
        self.wait()
        model_only = last_step and self.cfg.last_save_model_only
        partial = self._partial_dir(step)
        if self.rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            self._remove_stale()
            os.makedirs(partial)
        self._barrier()
        state = cast_floating(self.model.state_dict(), self.export_dtype) if model_only else self._full_state(step)
        writer = FileSystemWriter(partial)
        if self.use_async and not last_step:
            try:
                with single_process_quiet():
                    future = dcp.async_save(state, storage_writer=writer, process_group=self.pg)
            except (NotImplementedError, AssertionError) as e:
                logger.warning(f"dcp.async_save unavailable here ({e}); saving synchronously from now on")
                self.use_async = False
            else:
                self._pending = _Pending(future, step)
                return True
        with single_process_quiet():
            dcp.save(state, storage_writer=writer, process_group=self.pg)
        self._barrier()
        self._finalize(step)
        self._barrier()
        return True

    def _finalize(self, step: int) -> None:
        """Rank 0, once every rank's data and the metadata are written: publish step-N, apply retention."""
        if self.rank != 0:
            return
        partial, final = self._partial_dir(step), self.step_dir(step)
        if not os.path.isfile(os.path.join(partial, ".metadata")):
            raise RuntimeError(f"checkpoint save of step {step} finished but {partial} has no .metadata")
        replaced = None
        if os.path.exists(final):  # re-saving a step (e.g. resumed from an older one): swap, then delete
            replaced = os.path.join(self.folder, f".step-{step}.replaced")
            shutil.rmtree(replaced, ignore_errors=True)
            os.rename(final, replaced)
        os.rename(partial, final)
        _fsync_dir(self.folder)
        if replaced:
            shutil.rmtree(replaced, ignore_errors=True)
        logger.info(f"saved checkpoint {final}")
        k = self.cfg.keep_latest_k
        if k > 0:
            for old in complete_steps(self.folder)[:-k]:
                logger.info(f"keep_latest_k={k}: deleting {self.step_dir(old)}")
                shutil.rmtree(self.step_dir(old), ignore_errors=True)

    def _poll(self) -> None:
        """Finish an async save that has completed, without blocking."""
        if self._pending is not None and self._done(self._pending.future):
            self.wait()

    @staticmethod
    def _done(future) -> bool:
        fut = getattr(future, "upload_completion", future)  # AsyncSaveResponse on newer torch
        return fut.done()

    def wait(self) -> None:
        """Block until the in-flight async save (if any) is written, then publish it as step-N."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        fut = getattr(pending.future, "upload_completion", pending.future)
        try:
            fut.result()
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised with the step
            # the .step-N.partial folder stays unpublished and is removed at the next save / load
            raise RuntimeError(f"async checkpoint save of step {pending.step} failed: {e}") from e
        # rank 0's future completes after DCP gathered every rank's write results and wrote .metadata
        self._finalize(pending.step)

    def close(self) -> None:
        """Flush the in-flight async save; call at the end of training."""
        self.wait()

    # ------------------------------------------------------------------------------------------- load
    def load(self) -> int:
        """Resume; returns the step resumed from (0 if none).

        Enabled: load_step -1 takes the newest complete step-N, load_step N takes that one (error if absent
        or incomplete). If there is none and initial_load_path is set, the model weights alone are loaded
        from it (strict), at step 0 with a fresh optimizer; initial_load_path is honoured when disabled too.
        """
        if self.enabled:
            choice = None
            if self.rank == 0:
                self._remove_stale()
                choice = self._choose_step()
            choice = self._broadcast(choice)  # (step or None, error message or None) from rank 0
            step, error = choice
            if error:
                raise FileNotFoundError(error)
            if step is not None:
                self._load_full(step)
                return step
        if self.cfg.initial_load_path:
            logger.info(f"loading initial model weights from {self.cfg.initial_load_path}")
            load_model_weights(self.model_parts, self.cfg.initial_load_path, process_group=self.pg)
        return 0

    def _choose_step(self) -> tuple[int | None, str | None]:
        steps = complete_steps(self.folder)
        want = self.cfg.load_step
        if want < 0:
            return (steps[-1] if steps else None), None
        if want in steps:
            return want, None
        state = "incomplete (no .metadata)" if os.path.isdir(self.step_dir(want)) else "absent"
        return None, (
            f"checkpoint.load_step={want}: {self.step_dir(want)} is {state}. Complete checkpoints in "
            f"{self.folder}: {steps or 'none'}. Pick one of them, or -1 for the latest."
        )

    def _load_full(self, step: int) -> None:
        path = self.step_dir(step)
        metadata = read_metadata(path)
        keys = metadata.state_dict_metadata.keys()
        if TRAIN_STATE_KEY not in keys:
            raise ValueError(
                f"{path} is a model-only checkpoint (no optimizer / train state; e.g. a last_save_model_only "
                f"save) and cannot resume training. To start from its weights, set --checkpoint.initial_load_path "
                f"{path} with an empty checkpoint.folder; to resume, set --checkpoint.load_step to a full one."
            )

        def has(prefix: str) -> bool:
            return any(k.startswith(prefix) for k in keys)

        state = self._full_state(step)
        self.train_state.load_only = {k for k in self.extra_state if has(f"train_state.{k}")}
        for k in set(self.extra_state) - self.train_state.load_only:
            logger.warning(f"{path} has no train_state.{k}; keeping its current value")
        if self.optimizer is not None and not has("optimizer."):
            raise ValueError(f"{path} has no optimizer state; it cannot resume training with an optimizer")
        for name in ("lr_scheduler", "dataloader", "rng"):
            if name in state and not has(f"{name}."):
                logger.warning(f"{path} has no {name} state; {name} starts fresh")
                del state[name]
        check_model_keys(self.model.state_dict(), metadata, "model.", path, self.pg)
        logger.info(f"resuming from {path}")
        try:
            with single_process_quiet():
                dcp.load(state, storage_reader=FileSystemReader(path), process_group=self.pg)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - re-raised with the path and a way out
            raise RuntimeError(
                f"failed to load checkpoint {path}: {e}. It may be corrupt or from another model / optimizer "
                f"setup; delete it or pick another with --checkpoint.load_step."
            ) from e
        finally:
            self.train_state.load_only = None
