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
Every value is a tensor (checkpoint/state_adapters.py: non-tensor values travel as one uint8 JSON tensor per
entry), so loading our own state never unpickles; optimizer hyperparameters and the LR schedule are not saved
but taken from the current config. Beside the DCP files: run_record.json (what the run was trained with,
compared on resume: checkpoint/run_record.py) and checksums.json (every file's CRC-32, verified before loading:
checkpoint/integrity.py).
A model-only save (last step with last_save_model_only) holds the FQN-keyed weights alone, like export.py.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from checkpoint.disk_space import disk_full_error, folder_bytes, state_bytes
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
from checkpoint.finite import any_rank_nonfinite, first_nonfinite_state
from checkpoint.integrity import ChecksummingWriter, verify_checksums
from checkpoint.lineage import abandon_newer_steps
from checkpoint.run_record import check_resume, read_record, write_record
from checkpoint.state_adapters import (  # noqa: F401 - the adapters' historical home; re-exported
    JSON_KEY,
    JsonTensorState,
    LegacyRNGTarget,
    OptimizerState,
    RNGState,
    SchedulerState,
    TrainState,
)
from components.log import format_bytes, format_seconds

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step-(\d+)$")
_STALE_RE = re.compile(r"^\.step-\d+\.(partial|replaced)$")


# --------------------------------------------------------------------------------------------- folders
def resolve_checkpoint_folder(folder: str, dump_folder: str) -> str:
    """The path checkpoint.folder names: `~` expanded; relative to job.dump_folder unless absolute.

    The one place this is decided: CheckpointManager saves and resumes there and evaluate.py reads from there.
    """
    folder = os.path.expanduser(folder)
    return folder if os.path.isabs(folder) else os.path.join(dump_folder, folder)


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
    t_start: float  # perf_counter() when the save began, for the "saved" line


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
        run_record: dict | None = None,
    ):
        """run_record: this run's checkpoint/run_record.build_run_record(...), saved into every step-N and
        compared with the checkpoint's on resume; None (tests, tools) saves none and compares nothing."""
        self.cfg = ckpt_cfg
        self.run_record = run_record
        self.enabled = bool(ckpt_cfg.enable)
        self.folder = resolve_checkpoint_folder(ckpt_cfg.folder, dump_folder)
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
        # the non-tensor state travels as JSON in a tensor (never pickled): the wrappers DCP sees
        self._json_states = {
            name: JsonTensorState(inner, name)
            for name, inner in (
                ("train_state", self.train_state),
                ("rng", self.rng),
                ("lr_scheduler", self.lr_scheduler),
                ("dataloader", self.dataloader),
            )
            if inner is not None
        }
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
        state: dict = {"model": self.model}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer
        for name, wrapped in self._json_states.items():
            wrapped.prepare_load(None)
            state[name] = wrapped
        return state

    # ------------------------------------------------------------------------------------------- save
    def due(self, step: int, last_step: bool = False) -> bool:
        """Whether save(step, last_step) will write a checkpoint (not counting a forced one)."""
        return self.enabled and (step % self.cfg.interval == 0 or last_step)

    def save(self, step: int, last_step: bool = False, force: bool = False) -> bool:
        """Save when enabled and (step % interval == 0 or last_step or force). Returns whether a save was started.

        `force` (a stop requested by SIGTERM) saves a full checkpoint off the interval. Every save first checks
        that the training state is finite on every rank (checkpoint/finite.py) and refuses otherwise.

        Async mode: starts a background write (at most one in flight) and returns; the folder is renamed to
        step-N when it completes (noticed here at a later call, or in wait() / close()). Last-step saves are
        synchronous; with last_save_model_only they hold the model alone, cast to export_dtype.
        """
        if not self.enabled:
            return False
        self._poll()
        if not (self.due(step, last_step) or force):
            return False
        self.wait()
        t_start = time.perf_counter()
        self._refuse_nonfinite(step)
        model_only = last_step and self.cfg.last_save_model_only
        partial = self._partial_dir(step)
        if self.rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            self._remove_stale()
            os.makedirs(partial)
            if self.run_record is not None:  # before the data: the checksums of the folder cover it
                write_record(partial, {**self.run_record, "step": step})
        self._barrier()
        state = cast_floating(self.model.state_dict(), self.export_dtype) if model_only else self._full_state(step)
        writer = ChecksummingWriter(partial) if self.cfg.checksums else FileSystemWriter(partial)
        if self.use_async and not last_step:
            try:
                with single_process_quiet():
                    future = dcp.async_save(state, storage_writer=writer, process_group=self.pg)
            except (NotImplementedError, AssertionError) as e:
                logger.warning(f"dcp.async_save unavailable here ({e}); saving synchronously from now on")
                self.use_async = False
            else:
                self._pending = _Pending(future, step, t_start)
                return True
        try:
            with single_process_quiet():
                dcp.save(state, storage_writer=writer, process_group=self.pg)
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - a full disk is re-raised with its fix
            self._raise_if_disk_full(e, step)
            raise
        self._barrier()
        self._finalize(step, t_start)
        self._barrier()
        return True

    def _refuse_nonfinite(self, step: int) -> None:
        """Nothing non-finite is ever saved: check every rank's state before writing a byte."""
        optimizers = [opt for _, opt in self.optimizer.pairs] if self.optimizer is not None else []
        culprit = any_rank_nonfinite(first_nonfinite_state(self.model_parts, optimizers), self.pg)
        if culprit is not None:
            saved = complete_steps(self.folder)
            raise FloatingPointError(
                f"step {step} was not saved: {culprit} holds NaN or inf values. The newest complete checkpoint is "
                f"{f'step-{saved[-1]}' if saved else 'none'} in {self.folder}; resume from it with a lower "
                "optimizer.lr (or more lr_scheduler.warmup_steps), or check the data."
            )

    def _finalize(self, step: int, t_start: float, background: bool = False) -> None:
        """Rank 0, once every rank's data and the metadata are written: publish step-N, apply retention, and log
        one line: the path, its size on disk and the seconds since the save began (async: in the background)."""
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
        logger.info(
            f"saved checkpoint {final} ({format_bytes(folder_bytes(final))}, "
            f"{format_seconds(time.perf_counter() - t_start)}{' in the background' if background else ''})"
        )
        k = self.cfg.keep_latest_k
        if k > 0:
            for old in complete_steps(self.folder)[:-k]:
                logger.info(f"keep_latest_k={k}: deleting {self.step_dir(old)}")
                shutil.rmtree(self.step_dir(old), ignore_errors=True)

    def _raise_if_disk_full(self, exc: BaseException, step: int) -> None:
        """A save that failed for lack of disk space: raise CheckpointDiskFullError (folder, free, needed, fix)."""
        optimizers = [opt for _, opt in self.optimizer.pairs] if self.optimizer is not None else []
        error = disk_full_error(
            exc,
            step=step,
            folder=self.folder,
            partial=self._partial_dir(step),
            previous_steps=complete_steps(self.folder),
            keep_latest_k=self.cfg.keep_latest_k,
            estimate_state_bytes=lambda: state_bytes(self.model_parts, optimizers),
            remove_partial=self.rank == 0,
        )
        if error is not None:
            raise error from exc

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
            self._raise_if_disk_full(e, pending.step)
            # the .step-N.partial folder stays unpublished and is removed at the next save / load
            raise RuntimeError(f"async checkpoint save of step {pending.step} failed: {e}") from e
        # rank 0's future completes after DCP gathered every rank's write results and wrote .metadata
        self._finalize(pending.step, pending.t_start, background=True)

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
                if self.rank == 0:  # a resume from an older step starts a new branch (checkpoint/lineage.py)
                    abandon_newer_steps(self.folder, step)
                return step
        if self.cfg.initial_load_path:
            t_start = time.perf_counter()
            if self.cfg.checksums:  # ours carry checksums.json; foreign conversions may not (then unchecked)
                verify_checksums(self.cfg.initial_load_path, self.pg)
            load_model_weights(self.model_parts, self.cfg.initial_load_path, process_group=self.pg)
            if self.rank == 0:
                logger.info(
                    f"loaded initial model weights from {self.cfg.initial_load_path} "
                    f"({format_bytes(folder_bytes(self.cfg.initial_load_path))}, "
                    f"{format_seconds(time.perf_counter() - t_start)}); training starts at step 1"
                )
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
        t_start = time.perf_counter()
        self._verify(path)
        check_resume(path, read_record(path), self.run_record, self.cfg)
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
        self._prepare_json_load(state, metadata.state_dict_metadata, path)
        if self.optimizer is not None and not has("optimizer."):
            raise ValueError(f"{path} has no optimizer state; it cannot resume training with an optimizer")
        for name in ("lr_scheduler", "dataloader", "rng"):
            if name in state and not has(f"{name}."):
                logger.warning(f"{path} has no {name} state; {name} starts fresh")
                del state[name]
        check_model_keys(self.model.state_dict(), metadata, "model.", path, self.pg, aliases=self.model.aliases())
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
            for wrapped in self._json_states.values():
                wrapped.prepare_load(None)
        if self.rank == 0:
            logger.info(
                f"loaded checkpoint {path} ({format_bytes(folder_bytes(path))}, "
                f"{format_seconds(time.perf_counter() - t_start)})"
            )

    def _verify(self, path: str) -> None:
        """Check the folder's checksums.json before anything reads the folder (collective)."""
        if not self.cfg.checksums:
            logger.warning(f"checkpoint.checksums is off: {path} is loaded without verifying its files")
        elif not verify_checksums(path, self.pg) and self.rank == 0:
            logger.warning(
                f"{path} has no checksums.json (saved before checksums, or by another tool): its files "
                "cannot be verified; loading it unverified"
            )

    def _prepare_json_load(self, state: dict, md: dict, path: str) -> None:
        """Load targets: the JSON tensors sized from the metadata; for a legacy checkpoint (saved before the
        pickle-free format: no "train_state.json") the unwrapped adapters, whose items DCP unpickles."""
        if f"train_state.{JSON_KEY}" in md:
            for name, wrapped in self._json_states.items():
                if f"{name}.{JSON_KEY}" in md:
                    wrapped.prepare_load(md[f"{name}.{JSON_KEY}"].size.numel())
            return
        logger.warning(
            f"{path} was saved before the pickle-free format: its non-tensor state is unpickled by DCP "
            "(trust it as much as its source)"
        )
        self.train_state.load_only = {
            k for k in self.extra_state if any(key.startswith(f"train_state.{k}") for key in md)
        }
        state["train_state"] = self.train_state
        for name in ("lr_scheduler", "dataloader"):
            if name in state:
                state[name] = getattr(self, name)
        if "rng.host" in md and isinstance(md["rng.host"], BytesStorageMetadata):
            cuda = md.get("rng.cuda")
            state["rng"] = LegacyRNGTarget(self.rng, None if cuda is None else cuda.size.numel())
