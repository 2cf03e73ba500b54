"""One run per folder: an OS lock on `<folder>/.lock`, held by rank 0 until its process exits.

Two runs writing into one dump folder corrupt each other (one's checkpoint cleanup deletes the other's save in
flight, their metrics.jsonl lines interleave). fcntl.flock is released by the kernel when the holding process
dies, however it dies (kill -9 included), so a crashed run never leaves a stale lock behind. The lock file
records the holder (host, pid, start time, command line) for the error the second run prints. flock works
across hosts on NFS (Linux emulates it with byte-range locks) and Lustre (mounted with `flock`); where the
filesystem refuses locks, training goes on unlocked, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time

from checkpoint.manager import resolve_checkpoint_folder

LOCK_NAME = ".lock"
logger = logging.getLogger(__name__)
_held: dict[str, int] = {}  # realpath of a locked folder -> the open lock file's descriptor (kept for the process)


class FolderInUseError(RuntimeError):
    """Another live process holds the folder's lock; the message names it and says what to do."""


def _holder_record() -> dict:
    record = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": shlex.join([sys.executable, *sys.argv]),
    }
    if os.environ.get("SLURM_JOB_ID"):
        record["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    return record


def _describe(raw: str) -> str:
    try:
        h = json.loads(raw)
    except ValueError:  # empty: the holder is between taking the lock and writing its record
        return "a process that has not written its details yet"
    slurm = f", SLURM job {h['slurm_job_id']}" if "slurm_job_id" in h else ""
    return f"pid {h['pid']} on host {h['host']}{slurm}, started {h['started']}: {h['command']}"


def hold_folder(folder: str, what: str = "job.dump_folder") -> None:
    """Lock `folder` for this process (creating it), or raise FolderInUseError naming the holder.

    Call once per job on rank 0, before anything is written into the folder. Idempotent within a process
    (train.main called twice in one interpreter keeps the one lock). `what` names the setting in the error.
    """
    os.makedirs(folder, exist_ok=True)
    key = os.path.realpath(folder)
    if key in _held:
        return
    path = os.path.join(folder, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):  # the filesystem has no locks (ENOLCK, EOPNOTSUPP)
            os.close(fd)
            logger.warning(
                f"cannot lock {path} ({e}); nothing stops a second run from writing into {folder} at the same time"
            )
            return
        with open(path) as f:
            holder = _describe(f.read())
        os.close(fd)
        raise FolderInUseError(
            f"{what} {folder} is in use by another run, {holder}. Two runs in one folder corrupt each other's "
            f"checkpoints and metrics. Wait for that run to finish, stop it, or set another --{what}."
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, (json.dumps(_holder_record()) + "\n").encode())
    os.fsync(fd)
    _held[key] = fd  # never closed: the kernel releases the lock when this process exits


def hold_run_folders(dump_folder: str, checkpoint_folder: str | None) -> None:
    """Lock the dump folder, and the checkpoint folder too when it lies outside it (an absolute
    checkpoint.folder shared by two runs with different dump folders would collide just the same)."""
    hold_folder(dump_folder, "job.dump_folder")
    if checkpoint_folder:
        path = resolve_checkpoint_folder(checkpoint_folder, dump_folder)
        dump, ckpt = os.path.realpath(dump_folder), os.path.realpath(path)
        if os.path.commonpath([dump, ckpt]) != dump:
            hold_folder(path, "checkpoint.folder")
