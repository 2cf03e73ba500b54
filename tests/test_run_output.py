"""A run that explains itself (issue 17.3) and one rank-aware logger (issue 19.5): the save / load / summary lines,
timestamps in metrics.jsonl, the resolved config in the dump folder, a rerun of a finished job, the usage without
a config, one rank prefix under torchrun --tee, other ranks quiet unless LOG_RANK names them, and no view tensor
returned by an FSDP-wrapped block (the cause of FSDP2's "returned a view tensor ... wrong gradients" warning)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from datetime import datetime, timezone

import pytest
import torch

import train
from components.log import setup_logging
from configs.parser import load_config, load_config_or_exit, to_dict
from models.args import build_model_args
from models.mamba2.block import Block
from tests.parity import PARITY_ARGS, REPO, read_metrics

STAMP = r"\[rank0\] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d "  # the logger's prefix on one process


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # train.main reads configs/debug.toml relative to the working directory
    monkeypatch.delenv("LOG_RANK", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # in-process training of a tiny model: more threads only contend on a busy CPU
    yield
    torch.set_num_threads(threads)
    setup_logging(rank=0)  # the levels a later in-process run expects


def test_a_run_explains_itself_and_a_rerun_of_a_finished_job_says_so(tmp_path, capfd):
    args = PARITY_ARGS + [
        "--job.dump_folder",
        str(tmp_path),
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        "--validation.enable",
        "true",
        "--validation.freq",
        "1",
        "--validation.steps",
        "1",
    ]
    train.main(args + ["--training.steps", "2"])
    out = capfd.readouterr().out

    assert re.search(STAMP + r"saved checkpoint \S+/checkpoint/step-2 \(\d+\.\d [KMG]iB, \d+\.\d s\)", out), out
    tokens = 2 * 8 * 64  # steps x global_batch_size x seq_len
    summary = re.search(
        STAMP + rf"end of run: steps 1-2 of 2 \| {tokens:,} tokens \| wall [^|]+ \| val_loss final "
        r"(\S+), best (\S+) \(step (\d)\) \| outputs: (.*)",
        out,
    )
    assert summary, out
    records = read_metrics(tmp_path)
    vals = [r["val_loss"] for r in records]  # validation.freq 1: every record has one
    assert float(summary[1]) == pytest.approx(vals[-1], abs=1e-4)
    assert float(summary[2]) == pytest.approx(min(vals), abs=1e-4)
    assert int(summary[3]) == records[vals.index(min(vals))]["step"]
    assert str(tmp_path) in summary[4] and "metrics.jsonl" in summary[4] and "step-2" in summary[4]
    assert "[rank0] [rank0]" not in out and "[rank0]:[rank0]" not in out

    # metrics.jsonl: every former field, plus the UTC time and the seconds since the loop began
    assert {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "mfu", "memory_gib", "val_loss"} <= set(records[0])
    times = [datetime.fromisoformat(r["time"]) for r in records]
    assert all(t.tzinfo is not None and t.utcoffset().total_seconds() == 0 for t in times)
    assert abs((datetime.now(timezone.utc) - times[-1]).total_seconds()) < 600 and times == sorted(times)
    elapsed = [r["elapsed_s"] for r in records]
    assert all(isinstance(e, float) and e >= 0 for e in elapsed) and elapsed == sorted(elapsed)

    # the resolved config (TOML + overrides + defaults), written by rank 0 at the start
    cfg = load_config(args + ["--training.steps", "2", "--job.dump_folder", str(tmp_path)])
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(json.dumps(to_dict(cfg)))

    # the same command again: nothing is built, nothing is appended, exit 0
    train.main(args + ["--training.steps", "2"])
    out = capfd.readouterr().out
    finished = STAMP + r"already finished at step 2 .*outputs in .*; raise --training.steps to continue"
    assert re.search(finished, out), out
    assert "model " not in out and "step      " not in out and len(read_metrics(tmp_path)) == len(records)

    # raised: resumed, with the load line
    train.main(args + ["--training.steps", "3"])
    out = capfd.readouterr().out
    assert re.search(STAMP + r"loaded checkpoint \S+/step-2 \(\d+\.\d [KMG]iB, \d+\.\d s\)", out), out
    assert "resumed from step 2" in out and "end of run: steps 3-3 of 3 | 512 tokens" in out


def test_no_config_file_prints_the_usage_and_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        load_config_or_exit(["--training.steps", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python train.py --job.config_file FILE" in err
    assert "configs/debug.toml" in err and "mamba2_130m.toml" in err and "--help" in err


def _log_lines(tmp_path, stdout_path, env_extra: dict) -> str:
    """The lines one INFO record becomes in a fresh process whose stdout is `stdout_path`."""
    code = (
        "import logging; from components.log import setup_logging; setup_logging(); "
        "logging.getLogger('train').info('hello')"
    )
    stdout_path.parent.mkdir(parents=True, exist_ok=True)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **env_extra}
    with open(stdout_path, "w") as f:
        subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, stdout=f, check=True, timeout=60)
    return stdout_path.read_text()


def test_one_rank_prefix_under_torchrun_tee(tmp_path):
    """torchrun --tee copies <log_dir>/<run>/attempt_K/<local_rank>/stdout.log to the console behind its own
    `[rank0]:` header: the logger then leaves its tag out. Anywhere else, the tag is there."""
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0"}
    teed = _log_lines(tmp_path, tmp_path / "logs" / "run_x" / "attempt_0" / "0" / "stdout.log", torchrun)
    assert re.fullmatch(r" \d{4}-\d\d-\d\d \d\d:\d\d:\d\d hello\n", teed), teed
    redirected = _log_lines(tmp_path, tmp_path / "out.log", torchrun)  # torchrun without --tee, output to a file
    assert re.fullmatch(STAMP + "hello\n", redirected), redirected
    alone = _log_lines(tmp_path, tmp_path / "alone.log", {})
    assert re.fullmatch(STAMP + "hello\n", alone), alone


def test_other_ranks_log_warnings_only_unless_log_rank_names_them(capsys, monkeypatch):
    log = logging.getLogger("checkpoint.manager")
    setup_logging(rank=1)
    log.info("an info line")
    log.warning("a warning line")
    out = capsys.readouterr().out
    assert "an info line" not in out and re.search(r"\[rank1\] \S+ \S+ WARNING a warning line", out), out
    monkeypatch.setenv("LOG_RANK", "0,1")
    setup_logging(rank=1)
    log.info("an info line")
    assert "[rank1]" in capsys.readouterr().out
    logging.getLogger("torch.some_library").info("not ours")  # other libraries: warnings and errors only
    assert "not ours" not in capsys.readouterr().out


def test_first_block_returns_no_view_of_its_input():
    """FSDP2 hands a wrapped block its input as a view (its pre-forward autograd function) and warns at every
    forward whose output is a view. The first block (no residual yet) used to return that input as the residual."""
    block = Block(build_model_args("debug", {"d_model": 64, "headdim": 16, "d_state": 16, "chunk_size": 16}), 0)
    x_BSD = torch.randn(2, 16, 64, requires_grad=True)
    view_BSD = x_BSD.view_as(x_BSD)  # what FSDP's pre-forward passes on
    hidden_BSD, residual_BSD = block(view_BSD, None)
    assert residual_BSD._base is None and hidden_BSD._base is None
    assert torch.equal(residual_BSD, x_BSD)
