"""A checkpoint save that ran out of disk space: recognise it and say where, how much, and what to do.

torch reports a full disk in several disguises: OSError ENOSPC / EDQUOT from a plain write, RuntimeError
"[enforce fail at inline_container.cc:...] unexpected pos ..." from torch.save's zip writer, "No space left on
device" inside other messages, and DCP wraps each rank's failure in a CheckpointException (a BaseException).
`disk_full_error` looks through all of them and builds one error naming the checkpoint folder, the free space
and the size needed; the unpublished `.step-N.partial` folder is removed at once to give the space back. The
published step-N folders are never touched by a failed save (they stay loadable).
"""

from __future__ import annotations

import errno
import os
import shutil

import torch
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_DISK_FULL_TEXT = ("no space left on device", "disk quota exceeded", "unexpected pos")


class CheckpointDiskFullError(OSError):
    """A checkpoint save failed for lack of disk space (errno ENOSPC); the message says what to do."""


def _causes(exc: BaseException):
    """exc, its causes / contexts, and every rank's failure inside DCP's CheckpointException (depth-first)."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        if isinstance(e, CheckpointException):
            todo += [failure[0] if isinstance(failure, tuple) else failure for failure in e.failures.values()]


def _disk_full_leaf(e: BaseException) -> bool:
    return (isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS) or (
        isinstance(e, (OSError, RuntimeError)) and any(t in str(e).lower() for t in _DISK_FULL_TEXT)
    )


def disk_full_cause(exc: BaseException) -> BaseException | None:
    """The failure inside exc that says the disk is full (an errno one first), or None."""
    leaves = [e for e in _causes(exc) if not isinstance(e, CheckpointException) and _disk_full_leaf(e)]
    by_errno = [e for e in leaves if isinstance(e, OSError) and e.errno in _DISK_FULL_ERRNOS]
    return (by_errno or leaves or [None])[0]


def folder_bytes(path: str) -> int:
    """Total size of the files under path (0 if absent)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:  # removed meanwhile
                pass
    return total


def state_bytes(model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> int:
    """Bytes of the parameters, buffers and optimizer tensors this rank sees, at their global size (a DTensor's
    numel is global, so FSDP shards count whole; a pipeline rank sees only its stages). No collectives."""
    tensors = [t for part in model_parts for t in (*part.parameters(), *part.buffers())]
    tensors += [v for opt in optimizers for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def disk_full_error(
    exc: BaseException,
    *,
    step: int,
    folder: str,
    partial: str,
    previous_steps: list[int],
    keep_latest_k: int,
    estimate_state_bytes,
    remove_partial: bool,
) -> CheckpointDiskFullError | None:
    """The clear error for a save of `step` into `partial` that failed with `exc`, or None if exc is not a full
    disk. `remove_partial` (rank 0) deletes the unpublished folder first, so the free space reported is what
    the next attempt has. The size needed is that of the newest complete checkpoint (same model and setup), or
    else `estimate_state_bytes()` (a callable, evaluated only here)."""
    cause = disk_full_cause(exc)
    if cause is None:
        return None
    if remove_partial:
        shutil.rmtree(partial, ignore_errors=True)
    if previous_steps:
        newest = f"step-{previous_steps[-1]}"
        needed, how = folder_bytes(os.path.join(folder, newest)), f"the size of {newest}"
    else:
        needed, how = estimate_state_bytes(), "the model and optimizer state seen by this rank"
    try:
        free = _human(shutil.disk_usage(folder).free)
    except OSError:
        free = "unknown"
    kept = ", ".join(f"step-{s}" for s in previous_steps) or "none"
    # torch.save's zip writer turns any failed write into "unexpected pos"; a full disk is by far the usual one
    what = (
        f"failed writing to {folder}, most likely out of disk space"
        if "unexpected pos" in str(cause)
        else f"ran out of disk space in {folder}"
    )
    return CheckpointDiskFullError(
        errno.ENOSPC,
        f"checkpoint save of step {step} {what}: {free} free, about {_human(needed)} "
        f"needed ({how}). The unfinished save was removed; the earlier checkpoints ({kept}) are intact. Free space "
        f"on that filesystem, lower --checkpoint.keep_latest_k (now {keep_latest_k or 'keep all'}), or point "
        f"--checkpoint.folder at a disk with room, then resume. Cause: {type(cause).__name__}: {cause}",
    )
