"""Per-file checksums of a checkpoint folder: written at save, verified before DCP reads anything at load.

`checksums.json` in a step-N folder lists every other file with its size and CRC-32 (zlib.crc32: ~3 GB/s on
one core, stdlib; a corruption detector, not a signature: anyone who can write the folder can rewrite it).

Save (ChecksummingWriter, a DCP FileSystemWriter): each rank hashes the .distcp files it has just written
(in DCP's write step, so for an async save in its background thread, never in the training loop) and leaves
`__<rank>_checksums.json`; rank 0, in DCP's finish step after writing .metadata, merges those, hashes the
files nobody listed (.metadata, run_record.json) and writes checksums.json. The manager publishes the folder
(rename) only after that, so a step-N with checksums.json has all of them.

Load (verify_checksums): each rank checks a share of the files (largest first, round robin); the problems
are gathered, and every rank raises the same error naming the files.
"""

from __future__ import annotations

import json
import logging
import os
import zlib

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.futures import Future

logger = logging.getLogger(__name__)

CHECKSUMS_FILE = "checksums.json"
ALGORITHM = "crc32"
_SIDECAR_SUFFIX = "checksums.json"  # "__<rank>_checksums.json": one rank's share, merged away by rank 0
_CHUNK = 16 << 20


class ChecksumError(ValueError):
    """A checkpoint file does not match the checksum recorded when it was saved."""


def file_crc32(path: str) -> str:
    """CRC-32 of the file's bytes as 8 hex digits (read in 16 MiB chunks into one buffer)."""
    crc, buf = 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _entry(path: str) -> dict:
    return {"size": os.path.getsize(path), ALGORITHM: file_crc32(path)}


def _write_json(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


class ChecksummingWriter(FileSystemWriter):
    """FileSystemWriter that leaves checksums.json (every file's size + CRC-32) in the folder it writes."""

    def write_data(self, plan, planner) -> Future:  # a torch.futures.Future, already completed
        future = super().write_data(plan, planner)  # FileSystemWriter writes before returning
        written = sorted({r.storage_data.relative_path for r in future.wait()})
        share = {name: _entry(os.path.join(self.path, name)) for name in written}
        _write_json(os.path.join(self.path, f"{plan.storage_data.prefix}{_SIDECAR_SUFFIX}"), share)
        return future

    def finish(self, metadata: Metadata, results) -> None:
        super().finish(metadata, results)  # writes .metadata
        files: dict = {}
        for name in sorted(os.listdir(self.path)):
            if name.startswith("__") and name.endswith(_SIDECAR_SUFFIX):
                with open(os.path.join(self.path, name)) as f:
                    files.update(json.load(f))
                os.remove(os.path.join(self.path, name))
        expected = {r.storage_data.relative_path for rank_results in results for r in rank_results}
        if expected - set(files):
            raise RuntimeError(
                f"checkpoint {self.path}: no checksum from the rank that wrote {sorted(expected - set(files))}"
            )
        for name in sorted(os.listdir(self.path)):  # .metadata, run_record.json, files of empty buckets
            if name not in files and name != CHECKSUMS_FILE and os.path.isfile(os.path.join(self.path, name)):
                files[name] = _entry(os.path.join(self.path, name))
        _write_json(os.path.join(self.path, CHECKSUMS_FILE), {"algorithm": ALGORITHM, "files": files})


def _check(folder: str, name: str, want: dict) -> str | None:
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return f"{name} is missing"
    size = os.path.getsize(path)
    if size != want["size"]:
        return f"{name} has {size} bytes, {want['size']} when saved"
    got = file_crc32(path)
    if got != want[ALGORITHM]:
        return f"{name} has {ALGORITHM} {got}, {want[ALGORITHM]} when saved"
    return None


def verify_checksums(folder: str, process_group=None) -> bool:
    """Check every file listed in folder/checksums.json; False when there is none (an older checkpoint, or
    one written by another tool). Collective when a process group is initialised: each rank hashes a share,
    and every rank raises ChecksumError if any file differs."""
    manifest_path = os.path.join(folder, CHECKSUMS_FILE)
    if not os.path.isfile(manifest_path):
        return False
    problems: list[str] = []
    try:
        with open(manifest_path) as f:
            files = json.load(f)["files"]
        by_size = sorted(files, key=lambda n: (-files[n]["size"], n))
    except (OSError, ValueError, KeyError, TypeError) as e:
        files, by_size = {}, []
        problems.append(f"{CHECKSUMS_FILE} is unreadable ({e})")
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(process_group) if distributed else 0
    world = dist.get_world_size(process_group) if distributed else 1
    for name in by_size[rank::world]:
        problem = _check(folder, name, files[name])
        if problem:
            problems.append(problem)
    if distributed:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, problems, group=process_group)
        problems = sorted({p for share in gathered for p in share})
    if problems:
        raise ChecksumError(
            f"checkpoint {folder} is corrupt: " + "; ".join(problems) + ". Its files changed after the save "
            "(disk / copy error or an edit); do not resume from it: load another step with "
            "--checkpoint.load_step N, or delete this folder to resume from the newest other one."
        )
    return True
