"""Checkpoints a run can trust: resuming an older step starts a new branch (the newer steps are moved aside,
retention counts only the current branch); one run per dump folder (an OS lock naming its holder); a full disk
during a save is reported with the folder, the free space and the size needed, and leaves older steps intact."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys

import pytest
import torch

import train
from checkpoint import complete_steps
from checkpoint.disk_space import CheckpointDiskFullError, folder_bytes
from checkpoint.lineage import abandon_newer_steps
from tests.parity import PARITY_ARGS, REPO, read_metrics
from tests.test_checkpoint import ToyLoader, assert_same, build, manager, snapshot, train_step


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # train.main reads configs/debug.toml relative to the working directory
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # in-process training of a tiny model: more threads only contend on a busy CPU
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------- branches
def test_resume_from_an_older_step_starts_a_new_branch(tmp_path, capfd):
    """Issue 16.1: steps 2..10 saved; resumed from 4 with keep_latest_k 2 and stopped at 7; then restarted."""
    folder = tmp_path / "checkpoint"
    args = PARITY_ARGS + [
        "--job.dump_folder",
        str(tmp_path),
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
    ]
    train.main(args + ["--training.steps", "10"])
    assert complete_steps(str(folder)) == [2, 4, 6, 8, 10]
    capfd.readouterr()

    train.main(args + ["--training.steps", "7", "--checkpoint.load_step", "4", "--checkpoint.keep_latest_k", "2"])
    out = capfd.readouterr().out
    assert "abandoned-step-6, abandoned-step-8, abandoned-step-10" in out and "new branch" in out, out
    # retention counted the new branch only: it kept 6 and 7, not the abandoned 8 and 10
    assert complete_steps(str(folder)) == [6, 7]
    assert sorted(p.name for p in folder.iterdir()) == [
        "abandoned-step-10",
        "abandoned-step-6",
        "abandoned-step-8",
        "step-6",
        "step-7",
    ]

    records = len(read_metrics(tmp_path))
    train.main(args + ["--training.steps", "8", "--checkpoint.keep_latest_k", "2"])
    assert "resumed from step 7" in capfd.readouterr().out
    assert [r["step"] for r in read_metrics(tmp_path)[records:]] == [8]
    assert complete_steps(str(folder)) == [7, 8] and (folder / "abandoned-step-10" / ".metadata").exists()


def _fake_step(folder, name, complete=True):
    os.makedirs(folder / name)
    if complete:
        (folder / name / ".metadata").write_bytes(b"x")


def test_abandoned_names_never_collide_and_incomplete_folders_stay(tmp_path):
    for step in (2, 4, 6, 8):
        _fake_step(tmp_path, f"step-{step}")
    _fake_step(tmp_path, "step-10", complete=False)
    _fake_step(tmp_path, "abandoned-step-8")  # from an earlier branch
    assert abandon_newer_steps(str(tmp_path), 4) == ["abandoned-step-6", "abandoned-step-8.1"]
    assert sorted(os.listdir(tmp_path)) == [
        "abandoned-step-6",
        "abandoned-step-8",
        "abandoned-step-8.1",
        "step-10",
        "step-2",
        "step-4",
    ]
    assert abandon_newer_steps(str(tmp_path), 4) == []


# ------------------------------------------------------------------------------------------- one run per folder
_HOLDER = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from components.run_lock import hold_run_folders
hold_run_folders(sys.argv[2], sys.argv[3] or None)
print("HELD", flush=True)
time.sleep(300)
"""


@contextlib.contextmanager
def holder(dump_folder, checkpoint_folder=""):
    """Another process holding the folders' locks until killed with SIGKILL (at the end, or by the caller)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(REPO), str(dump_folder), str(checkpoint_folder)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "HELD"
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


def test_a_second_run_in_the_same_dump_folder_fails_at_once_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    args = PARITY_ARGS + ["--job.dump_folder", str(run), "--training.steps", "1", "--checkpoint.enable", "true"]
    with holder(run) as first:
        with pytest.raises(SystemExit) as failed:
            train.main(args)
        msg = str(failed.value.code)
        assert f"job.dump_folder {run} is in use by another run, pid {first.pid} on host {socket.gethostname()}" in msg
        assert "Wait for that run to finish, stop it, or set another --job.dump_folder" in msg and "-c" in msg
        assert os.listdir(run) == [".lock"], "the refused run wrote into the folder"
        os.kill(first.pid, signal.SIGKILL)  # the kernel releases a dead process' lock
        first.wait()
    train.main(args)
    assert [r["step"] for r in read_metrics(run)] == [1] and complete_steps(str(run / "checkpoint")) == [1]
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()


def test_a_shared_checkpoint_folder_outside_the_dump_folders_is_locked_too(tmp_path):
    shared = tmp_path / "shared_ckpt"
    with holder(tmp_path / "a", shared) as first:
        with pytest.raises(SystemExit, match=rf"checkpoint.folder {shared} is in use by another run, pid {first.pid}"):
            train.main(
                PARITY_ARGS
                + [
                    "--job.dump_folder",
                    str(tmp_path / "b"),
                    "--checkpoint.enable",
                    "true",
                    "--checkpoint.folder",
                    str(shared),
                ]
            )
        assert not (tmp_path / "b" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------- full disk
def full_disk(budget: int, error: BaseException):
    """A FileSystem.create_stream whose write streams raise `error` once `budget` bytes were written in all."""
    import torch.distributed.checkpoint.filesystem as fs

    orig, left = fs.FileSystem.create_stream, {"bytes": budget}

    @contextlib.contextmanager
    def create_stream(fs_self, path, mode):
        with orig(fs_self, path, mode) as f:
            yield _Limited(f, left, error) if "w" in mode else f

    return create_stream


class _Limited(io.RawIOBase):
    def __init__(self, f, left: dict, error: BaseException):
        self.f, self.left, self.error = f, left, error

    def writable(self):
        return True

    def write(self, b):
        n = memoryview(b).nbytes
        if n > self.left["bytes"]:
            self.f.write(memoryview(b).cast("B")[: self.left["bytes"]])  # a full disk leaves a truncated file too
            self.left["bytes"] = 0
            raise self.error
        self.left["bytes"] -= n
        return self.f.write(b)

    def tell(self):
        return self.f.tell()

    def seek(self, *args):
        return self.f.seek(*args)

    def flush(self):
        return self.f.flush()

    def fileno(self):
        return self.f.fileno()


_ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
_ZIP_POS = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1792 vs 1680")


@pytest.mark.parametrize(
    "error, async_mode",
    [(_ENOSPC, "disabled"), (_ZIP_POS, "disabled"), (_ENOSPC, "async")],
    ids=["enospc", "torch_unexpected_pos", "enospc_async"],
)
def test_disk_full_names_folder_free_and_needed_space_and_keeps_older_steps(tmp_path, monkeypatch, error, async_mode):
    import torch.distributed.checkpoint.filesystem as fs

    model, opt, sched = build(0)
    loader = ToyLoader()
    mgr = manager(tmp_path, model, opt, sched, loader, async_mode=async_mode, keep_latest_k=3)
    for step in (1, 2):
        train_step(model, opt, sched, loader)
        mgr.save(step)
    mgr.wait()
    saved = snapshot(model, opt)
    step2_bytes = folder_bytes(mgr.step_dir(2))
    monkeypatch.setattr(fs.FileSystem, "create_stream", full_disk(step2_bytes // 2, error))
    for _ in (3, 4):
        train_step(model, opt, sched, loader)
    with pytest.raises(CheckpointDiskFullError) as failed:
        mgr.save(4)
        mgr.wait()
    msg = str(failed.value)
    human = f"{step2_bytes / 2**10:.1f} KiB"
    folder = re.escape(mgr.folder)
    assert re.search(
        rf"checkpoint save of step 4 (ran out of disk space in {folder}|failed writing to {folder}, "
        rf"most likely out of disk space): [\d.]+ [KMG]iB free",
        msg,
    ), msg
    assert f" free, about {human} needed (the size of step-2)" in msg and "(step-2) are intact" in msg
    assert "lower --checkpoint.keep_latest_k (now 3)" in msg and "point --checkpoint.folder at a disk" in msg
    # torch.save's zip writer may turn the write error into its own "unexpected pos" RuntimeError
    assert re.search(r"Cause: (OSError: \[Errno 28\] No space left on device|RuntimeError: .*unexpected pos)", msg)
    assert sorted(os.listdir(mgr.folder)) == ["step-2"], "the partial folder is removed, step-2 untouched"

    monkeypatch.undo()  # space freed: the same run saves again, and step-2 still loads bit for bit
    assert mgr.save(4)
    mgr.wait()
    assert complete_steps(mgr.folder) == [2, 4]
    model2, opt2, sched2 = build(1)
    assert manager(tmp_path, model2, opt2, sched2, ToyLoader(), load_step=2).load() == 2
    assert_same(snapshot(model2, opt2), saved)


def test_disk_full_before_any_checkpoint_estimates_the_state_and_other_errors_pass_through(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as fs
    from torch.distributed.checkpoint.api import CheckpointException

    model, opt, sched = build(0)
    loader = ToyLoader()
    mgr = manager(tmp_path, model, opt, sched, loader)
    train_step(model, opt, sched, loader)
    monkeypatch.setattr(fs.FileSystem, "create_stream", full_disk(100, _ENOSPC))
    # parameters + AdamW's exp_avg / exp_avg_sq (fp32) + its step counters
    want = sum(p.numel() * 4 * 3 + 4 for p in model.parameters())
    with pytest.raises(
        CheckpointDiskFullError,
        match=rf"about {want / 2**10:.1f} KiB needed \(the model and "
        r"optimizer state seen by this rank\).*checkpoints \(none\)",
    ):
        mgr.save(2)
    monkeypatch.undo()

    def unwritable(fs_self, path, mode):
        raise PermissionError(errno.EACCES, "denied", str(path))

    monkeypatch.setattr(fs.FileSystem, "create_stream", unwritable)
    with pytest.raises(CheckpointException, match="denied"):  # not a full disk: DCP's own error, unchanged
        mgr.save(4)
