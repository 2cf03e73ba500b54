"""Issue 16 items 4-6: no silent wrong resumes (run record), per-file checksums, pickle-free checkpoint state."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.default_planner as default_planner
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import BytesStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from checkpoint.integrity import CHECKSUMS_FILE, ChecksumError
from checkpoint.run_record import RECORD_FILE, ResumeMismatch, build_run_record
from configs.job_config import JobConfig
from data.tokenizer import ByteTokenizer, HFTokenizer
from models import build_model_args
from tests.dist_utils import run_distributed
from tests.test_checkpoint import ToyLoader, assert_same, build, cfg, make_optim, manager, snapshot, train_step

LOG = "checkpoint"


def record(tokenizer=None, **training) -> dict:
    job = JobConfig()
    for k, v in training.items():
        section, key = k.split("__")
        setattr(getattr(job, section), key, v)
    return build_run_record(job, build_model_args("debug", job.model_overrides), tokenizer or ByteTokenizer())


def save_run(tmp_path, steps=2, run_record=None, **kw):
    model, opt, sched = build(0)
    loader, extra = ToyLoader(), {"tokens_seen": 0}
    mgr = manager(tmp_path, model, opt, sched, loader, extra, **kw)
    mgr.run_record = run_record
    for step in range(1, steps + 1):
        train_step(model, opt, sched, loader)
        extra["tokens_seen"] += 4
        mgr.save(step)
    mgr.close()
    return mgr, snapshot(model, opt)


def resume(tmp_path, run_record=None, lr=1e-2, **kw):
    model, opt, sched = build(1)
    for group in opt.param_groups:
        group["lr"] = group["initial_lr"] = lr
    sched.base_lrs = [lr] * len(opt.param_groups)
    mgr = manager(tmp_path, model, opt, sched, ToyLoader(), {"tokens_seen": 0}, **kw)
    mgr.run_record = run_record
    return mgr, mgr.load(), model, opt, sched


def hf_tokenizer(tmp_path, name: str, words: list[str]) -> HFTokenizer:
    """A word-level tokenizer.json whose vocabulary is `words` + <|endoftext|>."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {w: i for i, w in enumerate(words + ["<|endoftext|>"])}
    path = tmp_path / name
    path.mkdir()
    Tokenizer(WordLevel(vocab, unk_token=words[0])).save(str(path / "tokenizer.json"))
    return HFTokenizer(str(path))


# ------------------------------------------------------------------------------------- item 4: run record
def test_changed_tokenizer_of_the_same_size_is_refused_then_allowed_loudly(tmp_path, caplog):
    a = hf_tokenizer(tmp_path, "a", [f"w{i}" for i in range(257)])
    b = hf_tokenizer(tmp_path, "b", [f"v{i}" for i in range(257)])
    assert a.vocab_size == b.vocab_size == 258
    save_run(tmp_path, run_record=record(a))
    assert os.path.isfile(os.path.join(tmp_path, "checkpoint", "step-2", RECORD_FILE))
    with pytest.raises(
        ResumeMismatch,
        match=r"(?s)tokenizer differs.*--checkpoint.allow_changed_tokenizer "
        r"true.*vocab_sha256: saved '[0-9a-f]+', now '[0-9a-f]+'",
    ):
        resume(tmp_path, record(b))
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert resume(tmp_path, record(b), allow_changed_tokenizer=True)[1] == 2
    assert "RESUMING WITH A CHANGED TOKENIZER" in caplog.text
    assert resume(tmp_path, record(a))[1] == 2  # the same tokenizer from another path resumes


def test_changed_data_and_model_are_refused_with_each_difference(tmp_path):
    save_run(tmp_path, run_record=record())
    now = record(training__seq_len=512, training__dataset="other.jsonl", training__document_masking=False)
    with pytest.raises(ResumeMismatch) as e:
        resume(tmp_path, now)
    msg = str(e.value)
    for line in (
        "training.seq_len: saved 256, now 512",
        "training.dataset: saved 'default', now 'other.jsonl'",
        "training.document_masking: saved True, now False",
        "--checkpoint.allow_changed_data true",
    ):
        assert line in msg, msg
    model, opt, _ = build(1)
    before = snapshot(model)
    with pytest.raises(ResumeMismatch):  # refused before anything is loaded into the model
        mgr = manager(tmp_path, model, opt, make_optim(model)[1], ToyLoader())
        mgr.run_record = now
        mgr.load()
    assert_same(snapshot(model), before)
    assert resume(tmp_path, now, allow_changed_data=True)[1] == 2

    wider = record()
    wider["model_args"]["d_model"] += 64
    wider["job_config"]["parallelism"]["data_parallel_shard_degree"] = 4  # layout: free
    with pytest.raises(ResumeMismatch, match=r"(?s)model differs \(never loadable.*model.d_model: saved 128, now 192"):
        resume(tmp_path, wider, allow_changed_data=True, allow_changed_tokenizer=True)
    layout_only = record()
    layout_only["job_config"]["parallelism"]["data_parallel_shard_degree"] = 4
    layout_only["model_args"]["chunk_size"] = 64
    assert resume(tmp_path, layout_only)[1] == 2


def test_checkpoint_without_record_resumes_with_a_warning(tmp_path, caplog):
    mgr, _ = save_run(tmp_path, run_record=None)
    assert not os.path.exists(os.path.join(mgr.step_dir(2), RECORD_FILE))
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert resume(tmp_path, record())[1] == 2
    assert f"has no {RECORD_FILE}" in caplog.text


def test_changed_lr_weight_decay_and_schedule_apply_from_the_first_resumed_step(tmp_path, caplog):
    saved_rec = record()
    mgr, snap = save_run(tmp_path, steps=4, run_record=saved_rec)
    now = record(optimizer__lr=1e-3)
    model, opt, sched = build(1)
    opt.param_groups[0]["weight_decay"] = 0.5
    for group in opt.param_groups:
        group["lr"] = group["initial_lr"] = 1e-3
    new_schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)  # another schedule function
    mgr2 = manager(tmp_path, model, opt, new_schedule, ToyLoader(), {"tokens_seen": 0})
    mgr2.run_record = now
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert mgr2.load() == 4
    assert (
        "changed hyperparameter, applied from the first resumed step: optimizer.lr: saved 0.0008, now 0.001"
        in caplog.text
    )
    # the moments and the step counts are the checkpoint's; lr, weight decay and schedule the current ones
    full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    got = {f"optim.{k}": v for k, v in get_optimizer_state_dict(model, opt, options=full).items()}
    assert_same(got, snap, [k for k in snap if k.startswith("optim.state.")])
    assert new_schedule.last_epoch == 4 and opt.param_groups[0]["lr"] == 1e-3 * 0.5**4
    assert new_schedule.get_last_lr() == [1e-3 * 0.5**4]
    assert opt.param_groups[0]["weight_decay"] == 0.5
    new_schedule.step()
    assert opt.param_groups[0]["lr"] == 1e-3 * 0.5**5


def test_load_step_with_checkpointing_off_is_a_config_error():
    from configs.checks import resolve_job
    from configs.parser import ConfigError, load_config

    job = load_config(["--job.config_file", "configs/debug.toml", "--checkpoint.load_step", "3"])
    with pytest.raises(
        ConfigError,
        match=r"checkpoint.load_step=3 resumes only with checkpointing on; set "
        r"--checkpoint.enable true",
    ):
        resolve_job(job, 1)


# ------------------------------------------------------------------------------------- item 5: checksums
def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_flipped_byte_in_a_distcp_file_is_a_clear_error(tmp_path, caplog):
    mgr, snap = save_run(tmp_path)
    step_dir = mgr.step_dir(2)
    with open(os.path.join(step_dir, CHECKSUMS_FILE)) as f:
        listed = set(json.load(f)["files"])
    assert listed == set(os.listdir(step_dir)) - {CHECKSUMS_FILE}
    _, _, model, opt, _ = resume(tmp_path)
    assert_same(snapshot(model, opt), snap)  # untouched: loads
    data = os.path.join(step_dir, "__0_0.distcp")
    flip_byte(data, os.path.getsize(data) // 2)
    with pytest.raises(
        ChecksumError,
        match=r"checkpoint .*step-2 is corrupt: __0_0.distcp has crc32 [0-9a-f]{8}, "
        r"[0-9a-f]{8} when saved.*--checkpoint.load_step N",
    ):
        resume(tmp_path)
    os.remove(os.path.join(step_dir, CHECKSUMS_FILE))  # as written before checksums: loads, with a warning
    flip_byte(data, os.path.getsize(data) // 2)
    with caplog.at_level(logging.WARNING, logger=LOG):
        assert resume(tmp_path)[1] == 2
    assert "has no checksums.json" in caplog.text


def _save_fsdp2_then_corrupt_and_load(rank, world, folder):
    from tests.test_checkpoint import _fsdp

    torch.manual_seed(0)
    model = _fsdp(build(0)[0], world)
    opt, sched = make_optim(model)
    loader = ToyLoader()
    from checkpoint import CheckpointManager

    mgr = CheckpointManager(cfg(async_mode="async"), folder, [model], [opt], [sched], loader, None)
    for step in (1, 2):
        train_step(model, opt, sched, loader, rank, world)
        mgr.save(step)  # step 2: async, hashed in DCP's background thread
    mgr.close()
    torch.distributed.barrier()
    if rank == 0:
        assert not [n for n in os.listdir(mgr.step_dir(2)) if n.endswith(f"_{CHECKSUMS_FILE}")]
        flip_byte(os.path.join(mgr.step_dir(2), "__1_0.distcp"), 200)
    torch.distributed.barrier()
    mgr2 = CheckpointManager(cfg(), folder, [model], [opt], [sched], ToyLoader(), None)
    try:
        mgr2.load()
    except ChecksumError as e:
        return str(e)
    return "loaded"


@pytest.mark.slow  # two processes (~30 s on 2 cores); the 4 -> 2 rank layout test covers the clean distributed path
def test_every_rank_reports_a_corrupt_file_of_another_rank(tmp_path):
    messages = run_distributed(_save_fsdp2_then_corrupt_and_load, 2, str(tmp_path))
    assert all("step-2 is corrupt: __1_0.distcp has crc32" in m for m in messages), messages


# ------------------------------------------------------------------------------------- item 6: no pickle
def test_saved_state_holds_no_pickled_items_and_loads_without_unpickling(tmp_path, monkeypatch):
    mgr, snap = save_run(tmp_path, steps=4)
    md = FileSystemReader(mgr.step_dir(4)).read_metadata().state_dict_metadata
    pickled = sorted(k for k, v in md.items() if isinstance(v, BytesStorageMetadata))
    assert not pickled, f"non-tensor (pickled) items: {pickled[:10]}"
    rng = (torch.get_rng_state(), np.random.get_state(), random.getstate())

    real_load = torch.load

    def weights_only_load(*args, **kwargs):
        if kwargs.get("weights_only") is False:
            raise AssertionError("DCP unpickled an item of our checkpoint")
        return real_load(*args, **kwargs)

    monkeypatch.setattr(default_planner.torch, "load", weights_only_load)
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads called"))
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    mgr2, step, model, opt, sched = resume(tmp_path)
    assert step == 4 and mgr2.extra_state == {"tokens_seen": 16}
    assert_same(snapshot(model, opt), snap)
    assert torch.equal(torch.get_rng_state(), rng[0]) and random.getstate() == rng[2]
    np_state = np.random.get_state()
    assert np.array_equal(np_state[1], rng[1][1]) and np_state[2:] == rng[1][2:]


def test_checkpoint_in_the_old_pickled_format_still_resumes(tmp_path, caplog):
    """The layout CheckpointManager wrote before the pickle-free format (non-tensor items, pickled RNG)."""
    model, opt, sched = build(0)
    loader = ToyLoader()
    for _ in range(3):
        train_step(model, opt, sched, loader)
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    from checkpoint.export import ModelState

    old = {
        "model": ModelState([model]).state_dict(),
        "optimizer": get_optimizer_state_dict(model, opt, options=flat),
        "lr_scheduler": sched.state_dict(),
        "dataloader": loader.state_dict(),
        "train_state": {"step": 3, "tokens_seen": 12},
        "rng": {"torch": torch.get_rng_state(), "host": pickle.dumps((np.random.get_state(), random.getstate()))},
    }
    want_snap, want_rng = snapshot(model, opt), random.getstate()
    dcp.save(old, storage_writer=FileSystemWriter(str(tmp_path / "checkpoint" / "step-3")))
    random.seed(5)
    with caplog.at_level(logging.WARNING, logger=LOG):
        mgr, step, model2, opt2, sched2 = resume(tmp_path)
    assert step == 3 and mgr.extra_state == {"tokens_seen": 12} and mgr.dataloader.state_dict() == {"seed": 0, "pos": 3}
    assert_same(snapshot(model2, opt2), want_snap) and random.getstate() == want_rng
    assert sched2.last_epoch == 3
    assert "saved before the pickle-free format" in caplog.text and "has no checksums.json" in caplog.text


def test_changed_shuffle_buffer_is_refused_and_older_records_compare_as_the_defaults(tmp_path):
    saved = record()
    save_run(tmp_path, run_record=saved)
    with pytest.raises(ResumeMismatch, match=r"training.shuffle_buffer: saved 0, now 64"):
        resume(tmp_path, record(training__shuffle_buffer=64))
    older = {
        **saved,
        "data": {
            k: v for k, v in saved["data"].items() if k not in ("datasets", "shuffle", "shuffle_buffer", "shards")
        },
    }
    (tmp_path / "older").mkdir()
    save_run(tmp_path / "older", run_record=older)  # written before the data identity existed
    assert resume(tmp_path / "older", record())[1] == 2
