"""benchmarks/compare_mamba_ssm.py (and compare_sides.py, the two sides it runs) on the CPU: argument parsing, the
train.py command, throughput from metrics.jsonl (total tokens / total time), FLOPs and MFU against an independent
parameter count, the table; mamba_ssm's loop run against a stand-in mamba_ssm built from our model (initial loss ~
ln(vocab) on random tokens); and the whole script on our side with the debug config (train.py really runs)."""

from __future__ import annotations

import json
import math
import os
import sys
import types
from collections import namedtuple

import pytest
import torch

from benchmarks import compare_mamba_ssm as cmp
from benchmarks import compare_sides as sides
from models import build_model_on_meta


def test_parse_args_and_ours_command():
    a = cmp.parse_args(
        [
            "--sizes",
            "1.3b",
            "--warmup",
            "2",
            "--steps",
            "3",
            "--",
            "--compile.enable",
            "true",
            "--activation_checkpoint.mode",
            "full",
        ]
    )
    assert a.size_list == ["1.3b"] and a.overrides == [
        "--compile.enable",
        "true",
        "--activation_checkpoint.mode",
        "full",
    ]
    cmd = sides.ours_command(sides.SIZES["1.3b"], a.warmup, a.steps, "/tmp/d", a.overrides, python="py")
    assert cmd[:4] == ["py", "train.py", "--job.config_file", "configs/mamba2_1.3b.toml"]
    opts = dict(zip(cmd[2::2], cmd[3::2]))
    assert opts["--training.steps"] == "5" and opts["--training.local_batch_size"] == "4"
    assert opts["--training.seq_len"] == "4096" and opts["--metrics.log_freq"] == "1"
    assert opts["--checkpoint.enable"] == "false" and opts["--training.dataset"] == "default"
    assert cmd[-4:] == a.overrides  # last, so they win
    # one GPU at their loop's gradient precision (bf16 linear-weight gradients), before the user's overrides
    assert cmd[-6:-4] == ["--training.grad_dtype", "bfloat16"] and opts["--training.grad_dtype"] == "bfloat16"
    a = cmp.parse_args([])
    assert a.size_list == ["370m", "1.3b"] and (a.warmup, a.steps) == (5, 15) and a.overrides == []
    with pytest.raises(SystemExit):
        cmp.parse_args(["--sizes", "7b"])


def test_ours_command_parses_as_a_config():
    """Every key the benchmark passes to train.py exists, for both sizes, and the job passes the validation pass."""
    from configs.checks import resolve_job
    from configs.parser import load_config

    for size in ("370m", "1.3b"):
        s = sides.SIZES[size]
        cmd = sides.ours_command(s, 5, 15, "/tmp/d", ["--compile.enable", "true"])
        cfg = load_config(cmd[2:])
        assert (cfg.training.local_batch_size, cfg.training.seq_len, cfg.training.steps) == (s.batch, s.seq_len, 20)
        assert cfg.model.flavor == s.flavor and cfg.compile.enable and not cfg.checkpoint.enable
        resolve_job(cfg, world_size=1)  # valid as one process runs it (bf16 gradients: one microbatch)


def test_summaries():
    tokens = 1000
    # warm-up step 1 (fast, ignored); timed steps take 1000/100 s and 1000/200 s
    records = [
        {"step": 1, "tokens_per_sec": 1e6, "memory_gib": 3.0, "loss": 9.0},
        {"step": 2, "tokens_per_sec": 100.0, "memory_gib": 5.0, "loss": 8.0},
        {"step": 3, "tokens_per_sec": 200.0, "memory_gib": 4.0, "loss": 7.0},
    ]
    got = sides.summarize_ours(records, warmup=1)
    assert got["tokens_per_sec"] == pytest.approx(2 * tokens / (tokens / 100 + tokens / 200))
    assert got["memory_gib"] == 5.0 and got["timed_steps"] == 2 and got["final_loss"] == 7.0
    # a repeated step (resumed run): the last record wins
    assert sides.summarize_ours(records + [{**records[2], "tokens_per_sec": 400.0}], 1)[
        "tokens_per_sec"
    ] == pytest.approx(2 / (1 / 100 + 1 / 400))
    with pytest.raises(ValueError, match="no metrics after step 3"):
        sides.summarize_ours(records, warmup=3)
    t = sides.summarize_times([9.0, 0.5, 1.5], warmup=1, tokens_per_step=1000)
    assert t["tokens_per_sec"] == pytest.approx(2000 / 2.0) and t["timed_steps"] == 2


def _matmul_params(model) -> int:
    """Weights of in_proj / out_proj of every layer and the lm_head: what a token multiplies by."""
    return sum(
        p.numel()
        for n, p in model.named_parameters()
        if n.endswith(("in_proj.weight", "out_proj.weight")) or n == "lm_head.weight"
    )


@pytest.mark.parametrize("size", ["370m", "1.3b"])
def test_flops_and_mfu(size):
    s = sides.SIZES[size]
    ours_args, their_args = sides.model_args_for(s, "ours"), sides.model_args_for(s, "theirs")
    assert (ours_args.padded_vocab_size, their_args.padded_vocab_size) == (50288, 50280)
    from models.args import build_model_args

    for side, args in (("ours", ours_args), ("theirs", their_args)):
        # untied, so that the lm_head has a parameter of its own to count
        overrides = {
            "tie_embeddings": False,
            "vocab_size": args.vocab_size,
            "pad_vocab_size_multiple": args.pad_vocab_size_multiple,
        }
        model = build_model_on_meta(build_model_args(s.flavor, overrides))
        f = cmp.flops_per_token(s, side)
        assert f["6n"] == 6 * _matmul_params(model)
        assert f["6n"] < f["ssd"] < 1.2 * f["6n"]  # the SSD / conv terms are a few percent at these sizes
    # MFU: tokens/s x FLOPs per token / peak
    f = cmp.flops_per_token(s, "ours")
    assert cmp.mfu(40_000.0, f["6n"], 989.4) == pytest.approx(40_000.0 * f["6n"] / 989.4e12)
    rec = cmp.add_mfu({"ours": {"tokens_per_sec": 40_000.0}, "theirs": {"error": "x"}}, s, 989.4)
    assert rec["ours"]["mfu_6n"] == pytest.approx(cmp.mfu(40_000.0, f["6n"], 989.4)) and "mfu_6n" not in rec["theirs"]
    # the released 370M / 1.3B sizes: about 6 x 0.37e9 / 6 x 1.3e9 FLOPs per token
    assert f["6n"] / 6 == pytest.approx({"370m": 0.37e9, "1.3b": 1.34e9}[size], rel=0.06)


def test_format_table():
    recs = [
        {
            "size": "370m",
            "batch": 8,
            "seq_len": 2048,
            "overrides": ["--compile.enable", "true"],
            "ours": {"tokens_per_sec": 50_000.0, "memory_gib": 30.25, "mfu_6n": 0.1234, "mfu_ssd": 0.13},
            "theirs": {"tokens_per_sec": 40_000.0, "memory_gib": 29.7, "mfu_6n": 0.0987, "mfu_ssd": 0.104},
        },
        {
            "size": "1.3b",
            "batch": 4,
            "seq_len": 4096,
            "overrides": [],
            "ours": {"error": "exit 1: OOM"},
            "theirs": None,
        },
    ]
    text = cmp.format_table(recs)
    lines = text.splitlines()
    assert lines[0].startswith("| model") and set(lines[1]) <= {"|", "-"}
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells == [
        "370m",
        "8x2048 --compile.enable true",
        "50,000",
        "40,000",
        "1.250",
        "30.2",
        "29.7",
        "12.3%",
        "9.9%",
        "13.0%",
        "10.4%",
    ]
    assert [c.strip() for c in lines[3].strip("|").split("|")][2:5] == ["n/a", "n/a", "n/a"]
    assert lines[-1] == "1.3b ours failed: exit 1: OOM"
    assert cmp.last_result_line('noise\nRESULT {"a": 1}\nRESULT {"a": 2}\n') == {"a": 2}


def _stand_in_mamba_ssm(monkeypatch, seen: dict):
    """mamba_ssm's two classes, backed by our model (same layer structure and parameter names)."""
    from models import Mamba2LM
    from models.args import ModelArgs
    from models.init import init_weights

    class MambaConfig(types.SimpleNamespace):
        pass

    Out = namedtuple("Out", "logits")

    class MambaLMHeadModel(torch.nn.Module):
        def __init__(self, config, device=None, dtype=None):
            super().__init__()
            seen.update(vars(config))
            ssm = {k: v for k, v in config.ssm_cfg.items() if k != "layer"}
            args = ModelArgs(
                d_model=config.d_model,
                n_layers=config.n_layer,
                vocab_size=config.vocab_size,
                pad_vocab_size_multiple=config.pad_vocab_size_multiple,
                **ssm,
            )
            self.inner = Mamba2LM(args).to(device=device, dtype=dtype)
            init_weights(self.inner, seed=0, init_std=0.02)
            self.lm_head = self.inner.lm_head

        def forward(self, input_ids, seq_idx=None):  # seq_idx: mamba_ssm's mixer_kwargs, handed to every mixer
            seen.setdefault("seq_idx", []).append(seq_idx)
            return Out(self.inner(input_ids, seq_idx=seq_idx))

    pkg = types.ModuleType("mamba_ssm")
    pkg.__version__ = "stand-in"
    cfg_mod = types.ModuleType("mamba_ssm.models.config_mamba")
    lm_mod = types.ModuleType("mamba_ssm.models.mixer_seq_simple")
    cfg_mod.MambaConfig, lm_mod.MambaLMHeadModel = MambaConfig, MambaLMHeadModel
    for name, mod in (
        ("mamba_ssm", pkg),
        ("mamba_ssm.models", types.ModuleType("mamba_ssm.models")),
        ("mamba_ssm.models.config_mamba", cfg_mod),
        ("mamba_ssm.models.mixer_seq_simple", lm_mod),
    ):
        monkeypatch.setitem(sys.modules, name, mod)


def test_their_baseline_is_the_fastest_of_their_runs(monkeypatch, tmp_path):
    """--their_runs R: their loop runs R times, ours is compared with the fastest run (a failed run is skipped and
    listed as None); only the first run is traced."""
    assert cmp.fastest_of([{"tokens_per_sec": 3.0}]) == {"tokens_per_sec": 3.0}  # one run: as it was
    best = cmp.fastest_of([{"tokens_per_sec": 3.0, "k": 1}, {"error": "x"}, {"tokens_per_sec": 5.0, "k": 3}])
    assert best == {"tokens_per_sec": 5.0, "k": 3, "runs_tokens_per_sec": [3.0, None, 5.0]}
    assert cmp.fastest_of([{"error": "a"}, {"error": "b"}])["error"] == "a"
    with pytest.raises(SystemExit):
        cmp.parse_args(["--their_runs", "0"])
    calls = []

    def fake_run_theirs(size, a, profile=True):
        calls.append(profile)
        return {"tokens_per_sec": [10.0, 30.0, 20.0][len(calls) - 1]}

    monkeypatch.setattr(cmp, "run_theirs", fake_run_theirs)
    recs = cmp.main(["--sizes", "debug", "--skip_ours", "--their_runs", "3", "--out", str(tmp_path / "r.json")])
    assert calls == [True, False, False]
    assert recs[0]["theirs"]["tokens_per_sec"] == 30.0
    assert recs[0]["theirs"]["runs_tokens_per_sec"] == [10.0, 30.0, 20.0]
    assert "30 (best of 3)" in cmp.format_table(recs)


def test_their_loop_autotunes_in_its_own_process(monkeypatch):
    """Their subprocess never reads Triton's on-disk autotuning picks (TRITON_CACHE_AUTOTUNING dropped from its
    environment: a pick cached at another shape slowed their loop by 10%), while everything else passes through."""
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")
    monkeypatch.setenv("SOME_SETTING", "kept")
    seen = {}

    def fake_run(cmd, a, parse, env=None):
        seen["cmd"], seen["env"] = cmd, env
        return {"tokens_per_sec": 1.0}

    monkeypatch.setattr(cmp, "_run", fake_run)
    cmp.run_theirs(sides.SIZES["debug"], cmp.parse_args(["--sizes", "debug"]))
    assert "--_worker" in seen["cmd"]
    assert "TRITON_CACHE_AUTOTUNING" not in seen["env"] and seen["env"]["SOME_SETTING"] == "kept"


def test_theirs_worker_loop_on_cpu(monkeypatch):
    seen: dict = {}
    _stand_in_mamba_ssm(monkeypatch, seen)
    size = sides.SIZES["debug"]
    out = sides.theirs_worker(size, warmup=1, steps=2, device_type="cpu")
    assert seen["ssm_cfg"]["layer"] == "Mamba2" and seen["vocab_size"] == 50277 and seen["d_intermediate"] == 0
    assert seen["d_model"] == 128 and seen["n_layer"] == 4 and seen["ssm_cfg"]["d_state"] == 16
    assert out["vocab_rows"] == 50280 and out["timed_steps"] == 2 and len(out["step_seconds"]) == 3
    assert out["tokens_per_sec"] == pytest.approx(2 * 2 * 64 / sum(out["step_seconds"][1:]))
    # random tokens over 50277 ids: the loss starts at about ln(50277) and the optimizer moves it
    assert abs(out["losses"][0] - math.log(50277)) < 0.3 and out["losses"][0] != out["losses"][1]
    json.dumps(out)  # the RESULT line must serialise


def test_their_documents_are_our_runs_document_ids(monkeypatch):
    """--their_documents: step k of their loop passes seq_idx of our run's k-th batch (our config, loader and
    packing) to their model; without it, none. The 1.3B's first rows hold document starts (so the ids carry them)."""
    seen: dict = {}
    _stand_in_mamba_ssm(monkeypatch, seen)
    size = sides.SIZES["debug"]
    ours = sides.our_document_ids(size, 3)
    sides.theirs_worker(size, warmup=1, steps=2, device_type="cpu", documents=True)
    assert len(seen["seq_idx"]) == 3
    for passed, expected in zip(seen["seq_idx"], ours):
        assert passed.dtype == torch.int32 and passed.shape == (size.batch, size.seq_len)
        assert torch.equal(passed, expected)
    seen.clear()
    sides.theirs_worker(size, warmup=1, steps=1, device_type="cpu")
    assert seen["seq_idx"] == [None, None]
    big = sides.our_document_ids(sides.SIZES["1.3b"], 1)[0]
    assert big.shape == (4, 4096) and int(big.max()) > 0
    assert cmp.parse_args(["--their_documents"]).their_documents


def test_profile_step_traces_that_step_on_both_sides(monkeypatch, tmp_path, capsys):
    """--profile_step K: their loop writes a trace whose ProfilerStep annotation is step K's, ours asks train.py
    for the same step; K must be a warm-up step after the first."""
    _stand_in_mamba_ssm(monkeypatch, {})
    trace = tmp_path / "not_yet" / "theirs.json"  # the worker makes its folder
    out = sides.theirs_worker(
        sides.SIZES["debug"], warmup=3, steps=1, device_type="cpu", profile_step=3, trace=str(trace)
    )
    assert len(out["step_seconds"]) == 4
    names = [e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]]
    assert [n for n in names if n.startswith("ProfilerStep#")] == ["ProfilerStep#1"]  # one traced step only
    assert any(n == "aten::mm" or n == "aten::addmm" for n in names)
    for bad in ("1", "4"):
        with pytest.raises(SystemExit):
            cmp.parse_args(["--warmup", "3", "--profile_step", bad])
    recs = cmp.main(
        [
            *("--sizes", "debug", "--skip_theirs", "--warmup", "2", "--steps", "1", "--profile_step", "2"),
            *("--out", str(tmp_path / "r.json"), "--work_dir", str(tmp_path / "w")),
        ]
    )
    path = recs[0]["ours"]["trace"]
    assert path == str(tmp_path / "w" / "debug-ours" / "profile_trace" / "iteration_2" / "rank0_trace.json")
    assert os.path.exists(path) and "(no kernel families" in capsys.readouterr().out  # CPU: no GPU kernels


def test_script_ours_side_on_cpu(tmp_path, capsys):
    recs = cmp.main(
        [
            "--sizes",
            "debug",
            "--skip_theirs",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--out",
            str(tmp_path / "r.json"),
            "--work_dir",
            str(tmp_path / "w"),
            "--",
            "--training.seed",
            "3",
        ]
    )
    ours = recs[0]["ours"]
    assert "error" not in ours, ours
    metrics = sides.read_jsonl(str(tmp_path / "w" / "debug-ours" / "metrics.jsonl"))
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert ours["tokens_per_sec"] == pytest.approx(2 / sum(1 / r["tokens_per_sec"] for r in metrics[1:]))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["results"][0]["ours"]["tokens_per_sec"] == ours["tokens_per_sec"]
    assert saved["settings"]["overrides"] == ["--training.seed", "3"]
    host = saved["settings"]["host"]  # which host the figures belong to (host-bound steps move with it)
    assert host["cpus"] >= 1 and 0 < host["python_loop_ns"] < 1e4, host
    out = capsys.readouterr().out
    assert "| debug" in out and "ns per CPython loop iteration" in out


def test_variants_run_ours_once_more_each_with_their_overrides(tmp_path):
    a = cmp.parse_args(["--variant=--training.seed 4 --training.cuda_graph false", "--", "--training.seed", "3"])
    assert a.variant_overrides == [
        ["--training.seed", "3"],
        ["--training.seed", "3", "--training.seed", "4", "--training.cuda_graph", "false"],
    ]
    recs = cmp.main(
        [
            "--sizes",
            "debug",
            "--skip_theirs",
            "--warmup",
            "1",
            "--steps",
            "1",
            "--out",
            str(tmp_path / "r.json"),
            "--work_dir",
            str(tmp_path / "w"),
            "--variant=--training.seed 4",
            "--",
            "--training.seed",
            "3",
        ]
    )
    assert [r["overrides"] for r in recs] == [
        ["--training.seed", "3"],
        ["--training.seed", "3", "--training.seed", "4"],
    ]
    # the later --training.seed wins: different initial weights, so a different first loss
    first = [
        sides.read_jsonl(str(tmp_path / "w" / d / "metrics.jsonl"))[0]["loss"] for d in ("debug-ours", "debug-ours-1")
    ]
    assert first[0] != first[1]


def test_rounds_take_turns_and_compare_each_sides_median_run(monkeypatch, tmp_path, capsys):
    """--rounds R: theirs then every variant of ours, R times in turn; each record compares the median runs (the
    lower middle one of an even count; a failed run left out), lists every round's figures and ratio, and our median
    against their fastest run."""
    order = []
    theirs_tps = iter([30.0, 40.0, 20.0])
    ours_tps = {0: iter([33.0, 60.0, 45.0]), 1: iter([10.0, None, 50.0])}

    def fake_run_theirs(size, a, profile=True):
        order.append(("theirs", profile))
        return {"tokens_per_sec": next(theirs_tps)}

    def fake_run_ours(size, a, overrides=None, index=0):
        order.append(("ours", index))
        tps = next(ours_tps[index])
        return {"tokens_per_sec": tps, "memory_gib": 1.0} if tps else {"error": "boom"}

    monkeypatch.setattr(cmp, "run_theirs", fake_run_theirs)
    monkeypatch.setattr(cmp, "run_ours", fake_run_ours)
    argv = ["--sizes", "debug", "--rounds", "3", "--variant=--training.seed 4", "--out", str(tmp_path / "r.json")]
    recs = cmp.main(argv)
    assert order == [("theirs", True), ("ours", 0), ("ours", 1)] + [("theirs", False), ("ours", 0), ("ours", 1)] * 2
    base, variant = recs
    assert base["theirs"]["tokens_per_sec"] == 30.0 and base["theirs"]["rounds_tokens_per_sec"] == [30.0, 40.0, 20.0]
    assert base["ours"]["tokens_per_sec"] == 45.0
    assert variant["ours"]["tokens_per_sec"] == 10.0  # of 10 and 50 (the failed round left out): the lower
    assert variant["ours"]["rounds_tokens_per_sec"] == [10.0, None, 50.0]
    assert [r["ratio"] for r in base["rounds"]] == [pytest.approx(1.1), pytest.approx(1.5), pytest.approx(2.25)]
    assert variant["rounds"][1] == {"ours": None, "theirs": 40.0, "ratio": None}
    assert base["ratio_vs_their_fastest"] == pytest.approx(45.0 / 40.0)  # our median against their fastest run
    assert variant["ratio_vs_their_fastest"] == pytest.approx(10.0 / 40.0)
    saved = json.loads((tmp_path / "r.json").read_text())["results"]
    assert [r["ours"]["tokens_per_sec"] for r in saved] == [45.0, 10.0]
    out = capsys.readouterr().out
    assert "45 (median of 3)" in out and "30 (median of 3)" in out and "| 1.500 " in out
    assert "round by round 1.100, 1.500, 2.250; our median / their fastest run 1.125" in out
    assert "round by round 0.333, n/a, 2.500; our median / their fastest run 0.250" in out
    with pytest.raises(SystemExit):
        cmp.parse_args(["--rounds", "0"])
    with pytest.raises(SystemExit):
        cmp.parse_args(["--rounds", "2", "--profile_step", "2", "--warmup", "3"])
