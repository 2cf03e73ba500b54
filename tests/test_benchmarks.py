"""benchmarks/compare_mamba_ssm.py on the CPU: argument parsing, the train.py command, throughput from metrics.jsonl
(total tokens / total time), FLOPs and MFU against an independent parameter count, the table; mamba_ssm's loop run
against a stand-in mamba_ssm built from our model (initial loss ~ ln(vocab) on random tokens); and the whole script
on our side with the debug config (train.py really runs)."""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import types
from collections import namedtuple

import pytest
import torch

from benchmarks import compare_mamba_ssm as cmp
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
    cmd = cmp.ours_command(cmp.SIZES["1.3b"], a.warmup, a.steps, "/tmp/d", a.overrides, python="py")
    assert cmd[:4] == ["py", "train.py", "--job.config_file", "configs/mamba2_1.3b.toml"]
    opts = dict(zip(cmd[2::2], cmd[3::2]))
    assert opts["--training.steps"] == "5" and opts["--training.local_batch_size"] == "4"
    assert opts["--training.seq_len"] == "4096" and opts["--metrics.log_freq"] == "1"
    assert opts["--checkpoint.enable"] == "false" and opts["--training.dataset"] == "default"
    assert cmd[-4:] == a.overrides  # last, so they win
    a = cmp.parse_args([])
    assert a.size_list == ["370m", "1.3b"] and (a.warmup, a.steps) == (5, 15) and a.overrides == []
    with pytest.raises(SystemExit):
        cmp.parse_args(["--sizes", "7b"])


def test_ours_command_parses_as_a_config():
    """Every key the benchmark passes to train.py exists, for both sizes."""
    from configs.parser import load_config

    for size in ("370m", "1.3b"):
        s = cmp.SIZES[size]
        cmd = cmp.ours_command(s, 5, 15, "/tmp/d", ["--compile.enable", "true"])
        cfg = load_config(cmd[2:])
        assert (cfg.training.local_batch_size, cfg.training.seq_len, cfg.training.steps) == (s.batch, s.seq_len, 20)
        assert cfg.model.flavor == s.flavor and cfg.compile.enable and not cfg.checkpoint.enable


def test_summaries():
    tokens = 1000
    # warm-up step 1 (fast, ignored); timed steps take 1000/100 s and 1000/200 s
    records = [
        {"step": 1, "tokens_per_sec": 1e6, "memory_gib": 3.0, "loss": 9.0},
        {"step": 2, "tokens_per_sec": 100.0, "memory_gib": 5.0, "loss": 8.0},
        {"step": 3, "tokens_per_sec": 200.0, "memory_gib": 4.0, "loss": 7.0},
    ]
    got = cmp.summarize_ours(records, warmup=1)
    assert got["tokens_per_sec"] == pytest.approx(2 * tokens / (tokens / 100 + tokens / 200))
    assert got["memory_gib"] == 5.0 and got["timed_steps"] == 2 and got["final_loss"] == 7.0
    # a repeated step (resumed run): the last record wins
    assert cmp.summarize_ours(records + [{**records[2], "tokens_per_sec": 400.0}], 1)[
        "tokens_per_sec"
    ] == pytest.approx(2 / (1 / 100 + 1 / 400))
    with pytest.raises(ValueError, match="no metrics after step 3"):
        cmp.summarize_ours(records, warmup=3)
    t = cmp.summarize_times([9.0, 0.5, 1.5], warmup=1, tokens_per_step=1000)
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
    s = cmp.SIZES[size]
    ours_args, their_args = cmp.model_args_for(s, "ours"), cmp.model_args_for(s, "theirs")
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

        def forward(self, input_ids):
            return Out(self.inner(input_ids))

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
    cmp.run_theirs(cmp.SIZES["debug"], cmp.parse_args(["--sizes", "debug"]))
    assert "--_worker" in seen["cmd"]
    assert "TRITON_CACHE_AUTOTUNING" not in seen["env"] and seen["env"]["SOME_SETTING"] == "kept"


def test_theirs_worker_loop_on_cpu(monkeypatch):
    seen: dict = {}
    _stand_in_mamba_ssm(monkeypatch, seen)
    size = cmp.SIZES["debug"]
    out = cmp.theirs_worker(size, warmup=1, steps=2, device_type="cpu")
    assert seen["ssm_cfg"]["layer"] == "Mamba2" and seen["vocab_size"] == 50277 and seen["d_intermediate"] == 0
    assert seen["d_model"] == 128 and seen["n_layer"] == 4 and seen["ssm_cfg"]["d_state"] == 16
    assert out["vocab_rows"] == 50280 and out["timed_steps"] == 2 and len(out["step_seconds"]) == 3
    assert out["tokens_per_sec"] == pytest.approx(2 * 2 * 64 / sum(out["step_seconds"][1:]))
    # random tokens over 50277 ids: the loss starts at about ln(50277) and the optimizer moves it
    assert abs(out["losses"][0] - math.log(50277)) < 0.3 and out["losses"][0] != out["losses"][1]
    json.dumps(out)  # the RESULT line must serialise


def test_profile_step_traces_that_step_on_both_sides(monkeypatch, tmp_path, capsys):
    """--profile_step K: their loop writes a trace whose ProfilerStep annotation is step K's, ours asks train.py
    for the same step; K must be a warm-up step after the first."""
    _stand_in_mamba_ssm(monkeypatch, {})
    trace = tmp_path / "not_yet" / "theirs.json"  # the worker makes its folder
    out = cmp.theirs_worker(cmp.SIZES["debug"], warmup=3, steps=1, device_type="cpu", profile_step=3, trace=str(trace))
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
    metrics = cmp.read_jsonl(str(tmp_path / "w" / "debug-ours" / "metrics.jsonl"))
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert ours["tokens_per_sec"] == pytest.approx(2 / sum(1 / r["tokens_per_sec"] for r in metrics[1:]))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["results"][0]["ours"]["tokens_per_sec"] == ours["tokens_per_sec"]
    assert saved["settings"]["overrides"] == ["--training.seed", "3"]
    assert "| debug" in capsys.readouterr().out


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
        cmp.read_jsonl(str(tmp_path / "w" / d / "metrics.jsonl"))[0]["loss"] for d in ("debug-ours", "debug-ours-1")
    ]
    assert first[0] != first[1]


def _summarize_step(tmp_path, kernels: list[tuple[str, int, int]]) -> dict:
    """trace_summary.summarize of a synthetic trace: one profiler step over 0-100 us and the (name, ts, dur) kernels."""
    from benchmarks.trace_summary import summarize

    events = [{"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#8", "ts": 0, "dur": 100}]
    events += [{"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur} for name, ts, dur in kernels]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return summarize(str(path))


def test_trace_summary_splits_compute_nccl_and_idle(tmp_path):
    """A synthetic step of 100 us: compute 0-40 and 50-70, NCCL 30-60 (10 us hidden by neither), idle 70-100."""
    from benchmarks.trace_summary import union_length

    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    kernels = [("gemm", 0, 40), ("ssd_fwd", 50, 20), ("ncclDevKernel_AllGather", 30, 30), ("gemm", 120, 10)]
    s = _summarize_step(tmp_path, kernels)  # the last gemm lies outside the step: ignored
    assert (s["wall_ms"], s["compute_ms"], s["nccl_ms"]) == (0.1, 0.06, 0.03)
    assert abs(s["nccl_exposed_ms"] - 0.01) < 1e-12 and abs(s["idle_ms"] - 0.03) < 1e-12
    assert s["kernels"] == 3 and s["top"][0][:2] == ("gemm", 1)
    assert s["launched_by"]["gemm"] == [("?", 1)]  # no op with its External id in this trace
    assert [(k, n) for k, n, _, _ in s["nccl_by_kind"]] == [("AllGather", 1)]
    assert abs(s["nccl_by_kind"][0][3] - 0.01) < 1e-12


def test_trace_summary_exposed_nccl_by_collective(tmp_path):
    """Each collective kind's exposed time: the all-to-all (SendRecv) 20-40 under no compute, the all-gather 0-10
    under compute 0-10 and 50-60 free, a reduce-scatter fully hidden; the list most exposed first."""
    kernels = [
        ("gemm", 0, 15),
        ("ssd", 70, 30),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 20, 20),
        ("ncclDevKernel_AllGather_RING_LL", 0, 10),
        ("ncclDevKernel_AllGather_RING_LL", 50, 10),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 75, 20),
    ]
    got = [(k, n, round(t * 1e3), round(x * 1e3)) for k, n, t, x in _summarize_step(tmp_path, kernels)["nccl_by_kind"]]
    assert got == [("SendRecv", 1, 20, 20), ("AllGather", 2, 20, 10), ("ReduceScatter", 1, 20, 0)]


def test_trace_summary_names_the_op_that_launched_each_kernel(tmp_path):
    """Kernels are matched to the aten op that dispatched them through their shared External id."""
    from benchmarks.trace_summary import summarize

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5, "args": {"External id": 7}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 6, "dur": 5, "args": {"External id": 8}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 12, "dur": 5, "args": {"External id": 9}},
    ] + [
        {"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": 5, "args": {"External id": i}}
        for n, ts, i in (("gemm", 10, 7), ("copy", 20, 8), ("copy", 30, 9), ("copy", 40, 99))
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = summarize(str(path))
    assert s["launched_by"] == {"gemm": [("aten::mm", 1)], "copy": [("aten::copy_", 2), ("?", 1)]}


def test_trace_summary_kernel_groups(tmp_path):
    """Kernel names fall into their families (ours before mamba_ssm's, NCCL first), and the side-by-side table
    puts each family's GPU time in its trace's column."""
    from benchmarks.trace_summary import groups_table, kernel_group, summarize

    cases = {
        "chunk_scan_bwd_dx_kernel": "ssd (ours)",
        "chained_states_fwd_kernel": "ssd (ours)",
        "chained_dstates_bwd_kernel": "ssd (ours)",
        "_chunk_scan_bwd_dx_kernel": "ssd (mamba_ssm)",
        "_state_passing_fwd_kernel": "ssd (mamba_ssm)",
        "causal_conv1d_fwd_kernel<128, 4>": "conv1d",
        "conv_bwd_kernel": "conv1d",
        "_add_rmsnorm_fwd_kernel": "norms",
        "nvjet_tst_256x128_64x4_2x1_v_bz_coopB_TNT": "matmul",
        "sm90_xmma_gemm_bf16bf16_bf16f32": "matmul",
        "ncclDevKernel_ReduceScatter_Sum_f32": "nccl",
        "void at::native::vectorized_elementwise_kernel<4>": "elementwise / reductions",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward": "loss",
        "multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "Memcpy HtoD (Pinned -> Device)": "memcpy / memset",
        "some_new_kernel": "other",
    }
    assert {n: kernel_group(n) for n in cases} == cases
    kernel = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    paths = []
    for i, ssd in enumerate(("chunk_scan_fwd_kernel", "_chunk_scan_fwd_kernel")):
        events = [
            {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 1000},
            kernel("nvjet_gemm", 0, 400),
            kernel(ssd, 400, 300 + 100 * i),
        ]
        (tmp_path / f"run{i}").mkdir()
        paths.append(tmp_path / f"run{i}" / "trace.json")
        paths[-1].write_text(json.dumps({"traceEvents": events}))
    table = groups_table([summarize(str(p)) for p in paths]).splitlines()
    assert table[0] == "| kernels | run0 | run1 |"
    assert "| ssd (ours) | 0.3 ms (30%) | - |" in table and "| ssd (mamba_ssm) | - | 0.4 ms (40%) |" in table
    assert "| matmul | 0.4 ms (40%) | 0.4 ms (40%) |" in table
    assert table[-2:] == ["| GPU idle | 0.3 ms (30%) | 0.2 ms (20%) |", "| step | 1.0 ms | 1.0 ms |"]


def test_bench_conv_documents_and_cpu_refusal():
    """bench_conv.py's packed documents cover every position with ids that start at 0 and rise by one at each cut,
    about `mean` tokens long; on a machine without CUDA the script stops before any work, naming what it needs."""
    from benchmarks import bench_conv

    seq = bench_conv.documents(3, 5000, torch.Generator().manual_seed(0), mean=100)
    assert seq.shape == (3, 5000) and seq.dtype == torch.int32
    steps = seq[:, 1:] - seq[:, :-1]
    assert (seq[:, 0] == 0).all() and ((steps == 0) | (steps == 1)).all()
    n_docs = (seq[:, -1] + 1).sum().item()
    assert 3 * 5000 / n_docs == pytest.approx(100, rel=0.3)  # mean length
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            bench_conv.main([])


def test_bench_conv_tune_sets_name_the_kernels_settings():
    """Every --tune set changes only settings bench_conv restores (TUNED), and each of those is a module constant
    conv_triton's launchers read: a renamed or removed constant fails here, not on the GPU machine."""
    from benchmarks import bench_conv
    from models.kernels import conv_triton

    for name in bench_conv.TUNED:
        assert hasattr(conv_triton, name), name
    for setting in bench_conv.TUNE:
        assert set(setting) <= set(bench_conv.TUNED), setting


def test_bench_optimizer_refuses_without_cuda():
    """bench_optimizer.py stops before building anything on a machine without CUDA, naming what it needs."""
    from benchmarks import bench_optimizer

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run")
    with pytest.raises(SystemExit, match="CUDA"):
        bench_optimizer.main([])


def test_bench_mixer_refuses_without_cuda_and_unknown_shapes():
    """bench_mixer.py names the shapes it knows for an unknown one, and stops without CUDA, naming what it needs."""
    from benchmarks import bench_mixer

    with pytest.raises(SystemExit):
        bench_mixer.main(["--shapes", "7b"])
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run")
    with pytest.raises(SystemExit, match="CUDA"):
        bench_mixer.main(["--shapes", "370m"])


def test_bench_loss_refuses_without_cuda():
    """bench_loss.py stops before allocating anything on a machine without CUDA, naming what it needs."""
    from benchmarks import bench_loss

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run")
    with pytest.raises(SystemExit, match="CUDA"):
        bench_loss.main([])


def test_memory_peak_replays_a_snapshot_history():
    """benchmarks/memory_peak.py on a hand-made snapshot: 100 bytes live before the history (one freed in it), then
    allocations from two of our frames and a foreign one; the peak is found at the right event, its live blocks are
    grouped by the innermost repository frame (the foreign block by its own innermost frame), and a block freed before
    the peak is not counted."""
    from benchmarks.memory_peak import BEFORE, peak_composition

    repo = "/repo"
    ours_a = [
        {"filename": "/usr/lib/torch/x.py", "line": 1, "name": "inner"},
        {"filename": "/repo/m.py", "line": 7, "name": "f"},
    ]
    ours_b = [{"filename": "/repo/n.py", "line": 3, "name": "g"}]
    foreign = [{"filename": "??", "line": 0, "name": "unwind"}]
    trace = [
        {"action": "free_completed", "addr": 900, "size": 40},  # from before the history
        {"action": "alloc", "addr": 1, "size": 10, "frames": ours_a},
        {"action": "alloc", "addr": 2, "size": 500, "frames": ours_b},
        {"action": "free_completed", "addr": 2, "size": 500},  # gone before the peak
        {"action": "alloc", "addr": 3, "size": 300, "frames": ours_a},
        {"action": "alloc", "addr": 4, "size": 250, "frames": foreign},
        {"action": "free_requested", "addr": 4, "size": 250},  # not yet freed: still counts
        {"action": "free_completed", "addr": 4, "size": 250},
        {"action": "alloc", "addr": 5, "size": 5, "frames": ours_b},
    ]
    # At the dump: the 60 bytes left of the 100 from before, blocks 1, 3 and 5.
    blocks = [{"size": 60, "state": "active_allocated"}, {"size": 10, "state": "active_allocated"},
              {"size": 300, "state": "active_allocated"}, {"size": 5, "state": "active_allocated"},
              {"size": 999, "state": "inactive"}]  # fmt: skip
    snap = {"device_traces": [trace], "segments": [{"device": 0, "blocks": blocks}]}
    r = peak_composition(snap, 0, repo)
    assert (r["start"], r["end"]) == (100, 375)
    assert r["peak"] == 60 + 10 + 300 + 250  # after block 4, before its free
    assert dict(r["groups"]) == {BEFORE: [60, 0], "m.py:7 f": [310, 2], "??:0 unwind": [250, 1]}
    assert dict(r["sizes"]) == {10: [10, 1], 300: [300, 1], 250: [250, 1]}


def test_ncu_ssd_refuses_bad_shape_and_no_cuda():
    """ncu_ssd.py names a wrong shape and the missing GPU before any work."""
    from benchmarks import ncu_ssd

    with pytest.raises(SystemExit, match="expected one of 1.3b, 370m"):
        ncu_ssd.main(["--shape", "2.7b"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            ncu_ssd.main(["--shape", "370m"])


def test_trace_summary_host_self_times():
    """Nested host ops: each name's self time excludes the ops inside it; the busiest thread is chosen."""
    from benchmarks.trace_summary import host_self_times

    op = lambda name, ts, dur, tid=1: {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}  # noqa: E731
    events = [
        op("step", 0, 10),
        op("a", 1, 2),
        op("b", 4, 4),
        op("launch", 5, 1),
        op("other", 0, 3, tid=2),
        op("late", 50, 5),
    ]  # outside the window
    h = host_self_times(events, (0, 20))
    assert h["thread"] == 1 and h["traced_ms"] == 0.01
    assert dict(h["self_ms"]) == {"step": 0.004, "b": 0.003, "a": 0.002, "launch": 0.001}


def test_trace_summary_idle_gaps():
    """GPU idle gaps, longest first, with the kernels around each and the host ops around the launch of the kernel
    that ended it (matched by correlation id); overlapping kernels leave no gap; the step's tail counts as a gap."""
    from benchmarks.trace_summary import idle_gaps

    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def host(cat, name, ts, dur, corr=None):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1}
        return dict(e, args={"correlation": corr}) if corr is not None else e

    kernels = [kernel("a", 0, 10, 1), kernel("b", 5, 10, 2), kernel("c", 40, 10, 3), kernel("d", 55, 40, 4)]
    events = kernels + [
        host("user_annotation", "optimizer step", 20, 30),
        host("cpu_op", "aten::_fused_adamw_", 30, 15),
        host("cuda_runtime", "cudaLaunchKernel", 35, 2, corr=3),
        host("cuda_runtime", "cudaLaunchKernel", 50, 2, corr=4),
    ]
    gaps = idle_gaps(events, kernels, (0, 100), top=5)
    assert [round(g["ms"] * 1e3) for g in gaps] == [25, 5, 5]  # 15-40, 50-55, 95-100 (a and b overlap)
    assert gaps[0] == {
        "ms": 0.025,
        "before": "b",
        "after": "c",
        "launched_by": "aten::_fused_adamw_",
        "inside": "optimizer step",
    }
    assert gaps[1]["after"] == "d" and gaps[1]["launched_by"] == "optimizer step"
    assert gaps[2]["after"] is None and gaps[2]["before"] == "d"
    assert len(idle_gaps(events, kernels, (0, 100), top=1)) == 1


def test_trace_summary_fsdp_hook_times():
    """FSDP2's host annotations summed per hook, the unit's name left out; GPU-side copies of them not counted."""
    from benchmarks.trace_summary import hook_times

    ann = lambda name, ts, dur, cat="user_annotation": {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [
        ann("FSDP::pre_forward (layers.0)", 0, 3000),
        ann("FSDP::pre_forward (layers.1)", 5000, 1000),
        ann("FSDP::pre_forward (layers.1)", 5000, 1000, cat="gpu_user_annotation"),
        ann("FSDP::backward_prefetch for layers.0", 7000, 500),
        ann("aten::mm", 0, 9000, cat="cpu_op"),
        ann("FSDP::pre_backward (layers.0)", 90_000, 1000),
    ]  # outside the window
    assert hook_times(events, (0, 10_000)) == [("FSDP::pre_forward", 2, 4.0), ("FSDP::backward_prefetch", 1, 0.5)]


def test_efficiency_table_ratios_targets_and_missing_runs(tmp_path, capsys):
    from benchmarks.efficiency_table import main

    def write(name, tps, mem, steps=6):
        (tmp_path / name).mkdir()
        lines = [
            json.dumps({"step": s, "loss": 5.0, "tokens_per_sec": tps if s > 1 else 1.0, "memory_gib": mem})
            for s in range(1, steps + 1)
        ]
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    write("ref", 1000.0, 40.0)
    write("good", 950.0, 20.0)
    write("slow", 700.0, 20.0)
    assert main([str(tmp_path), "--row", "A=good:ref:0.90:0.55", "--json", str(tmp_path / "t.json")]) == 0
    rows = json.loads((tmp_path / "t.json").read_text())
    assert rows[0]["ratio"] == 0.95 and rows[0]["memory_ratio"] == 0.5 and rows[0]["ok"]
    assert main([str(tmp_path), "--row", "B=slow:ref:0.90"]) == 1
    assert main([str(tmp_path), "--row", "C=good:ref:0.90:0.40"]) == 1  # memory over its target
    assert main([str(tmp_path), "--row", "D=absent:ref:0.90"]) == 1
    assert "missing" in capsys.readouterr().out
    # pipeline rows: the measured bubble (1 - ratio) must also lie within 5 points of the textbook one
    write("pp", 860.0, 30.0)  # bubble 14%
    assert main([str(tmp_path), "--row", "P=pp:ref:0.80", "--bubble", "pp=0.111"]) == 0
    interleaved = ["--row", "P=pp:ref:0.80", "--bubble", "pp=0.059", "--json", str(tmp_path / "b.json")]
    assert main([str(tmp_path), *interleaved]) == 1
    bubble = json.loads((tmp_path / "b.json").read_text())[0]["bubble"]
    assert math.isclose(bubble["measured"], 0.14) and not bubble["ok"]
    assert "NOT within" in capsys.readouterr().out


def test_efficiency_table_repeats_take_the_median_ratio(tmp_path, capsys):
    """Several folders (multi_gpu.sh's EFF_REPEAT): each pair's ratio within its folder, the row's the median of them
    (not the ratio of medians), a missing pair left out, the range printed."""
    from benchmarks.efficiency_table import main

    def write(folder, name, tps):
        (tmp_path / folder / name).mkdir(parents=True)
        lines = [json.dumps({"step": s, "loss": 5.0, "tokens_per_sec": tps, "memory_gib": 1.0}) for s in range(1, 7)]
        (tmp_path / folder / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")

    # ratios 0.95, 0.80, 0.92 (the second rep's reference ran fast); the fourth rep lost its run
    for folder, run, ref in (("r1", 950.0, 1000.0), ("r2", 960.0, 1200.0), ("r3", 920.0, 1000.0), ("r4", None, 1000.0)):
        write(folder, "ref", ref)
        if run is not None:
            write(folder, "run", run)
    folders = [str(tmp_path / f) for f in ("r1", "r2", "r3", "r4")]
    assert main([*folders, "--row", "A=run:ref:0.90", "--json", str(tmp_path / "t.json")]) == 0
    row = json.loads((tmp_path / "t.json").read_text())[0]
    assert row["ratios"] == [0.95, 0.8, 0.92] and row["ratio"] == 0.92 and row["ok"]
    assert "0.92 (0.80-0.95, 3 pairs)" in capsys.readouterr().out
    assert main([*folders, "--row", "A=run:ref:0.93"]) == 1  # the median, not the best pair, meets the target


def test_host_cost_phases_add_up_and_profile_prints(capsys):
    """benchmarks/host_cost.py on the CPU (debug model, references): the per-phase host times are positive and add up
    to the step's, the real-batch step is timed, and --profile prints cProfile's table."""
    from benchmarks import host_cost

    r = host_cost.main(["--flavor", "debug", "--kernels", "reference", "--steps", "2", "--rows", "2", "--seq", "32",
                        "--profile", "3"])  # fmt: skip
    phases = (r["host_forward_ms"], r["host_backward_ms"], r["host_optimizer_ms"])
    assert all(t > 0 for t in phases) and math.isclose(sum(phases), r["host_step_ms"])
    assert r["layers"] == 4 and r["real_step_ms"] > 0
    out = capsys.readouterr().out
    assert "host" in out and "ms per layer" in out and "Ordered by: internal time" in out
    assert gc.isenabled(), "host_cost.main left Python's garbage collector off"


def test_kernel_resources_register_cap_reaches_ptxas():
    """benchmarks/kernel_resources.py compiles for sm_90 without a GPU (Triton's ptxas): dB uncapped takes more than
    168 registers, and with BlockConfig's db_maxnreg (the default cap, 168) ptxas holds it there, so the config field
    reaches the compile (session 13: dB 0.112 -> 0.097 ms on an H100 with it)."""
    from benchmarks import kernel_resources as kr
    from models.kernels.ssd_triton.config import block_config

    cfg = block_config(256, 64, 128)
    assert cfg.db_maxnreg == 168
    for name, kernel, ptrs, consts, warps, stages in kr.kernels(cfg, 64, 128, True):
        if name == "chunk_state_bwd_db":
            capped = kr.compile_sm90(kernel, ptrs, consts, warps, stages, getattr(cfg, kr.MAXNREG[name]))
            free = kr.compile_sm90(kernel, ptrs, consts, warps, stages, None)
            break
    assert capped["registers"] <= 168 < free["registers"], (capped, free)


def test_kernel_resources_register_caps_keep_four_programs_per_sm():
    """With documents and ngroups 1 (Triton compiles G as the constant 1, as kernel_resources.py now does) dx, the
    chained states' forward and (in N tiles of 64) the chained dstates take more than 128 registers uncapped, at most
    three 4-warp programs per SM; BlockConfig's caps (dx_maxnreg, chained_fwd_maxnreg, chained_bwd_maxnreg: 128)
    reach ptxas and hold them at 128 (session 26, H100 with documents at the 1.3B shape: dx 0.368 -> 0.327 ms, the
    chained states 0.407 -> 0.363 for their two launches, the chained dstates 0.208 -> 0.190). The chained states'
    forward needs its cap only without fold_dt_states (the default since session 43: 114 registers uncapped, Triton
    3.9), so its uncapped count is taken on that path, and its capped one on both."""
    import dataclasses

    from benchmarks import kernel_resources as kr
    from models.kernels.ssd_triton.config import block_config

    regs = {}
    for fold_states in (True, False):
        cfg = dataclasses.replace(block_config(256, 64, 128), fold_dt_states=fold_states)
        for name, kernel, ptrs, consts, warps, stages in kr.kernels(cfg, 64, 128, True):
            if name in ("chunk_scan_bwd_dx", "chained_dstates_bwd") and fold_states or name == "chained_states_fwd":
                assert warps == 4, (name, warps)
                cap = getattr(cfg, kr.MAXNREG[name])
                capped = kr.compile_sm90(kernel, ptrs, consts, warps, stages, cap, ones=frozenset({"G"}))
                free = kr.compile_sm90(kernel, ptrs, consts, warps, stages, None, ones=frozenset({"G"}))
                regs[name, fold_states] = (capped["registers"], free["registers"])
    assert len(regs) == 4 and all(c <= 128 for c, _ in regs.values()), regs
    assert all(f > 128 for (name, fold), (_, f) in regs.items() if name != "chained_states_fwd" or not fold), regs


def test_kernel_resources_layout_conversions_of_dx_sums():
    """kernel_resources.py --converts lists the IR's convert_layout ops; compiled for sm_90, dx with its row sums kept
    2-D (config dx_row_sums_2d, the default) converts no float32 [dx_k, P] tile, and with 1-D sums it converts two
    (the products Triton 3.6 moves through shared memory before reducing: chunk_scan_bwd.py)."""
    import dataclasses

    from benchmarks import kernel_resources as kr
    from models.kernels.ssd_triton.config import block_config

    ir = "%y = ttg.convert_layout %x : tensor<64x64xf32, #mma> -> tensor<64x64xf32, #blocked> loc(#loc3)"
    assert kr.layout_conversions(ir) == ["tensor<64x64xf32, #mma> -> tensor<64x64xf32, #blocked>"]
    tiles = []
    for sums_2d in (True, False):
        cfg = dataclasses.replace(block_config(256, 64, 128), dx_row_sums_2d=sums_2d)
        for name, kernel, ptrs, consts, warps, stages in kr.kernels(cfg, 64, 128, True):
            if name == "chunk_scan_bwd_dx":
                info = kr.compile_sm90(kernel, ptrs, consts, warps, stages, converts=True)
                tiles.append([c for c in info["layout_conversions"] if c.startswith("tensor<64x64xf32, #mma")])
    assert len(tiles[0]) == 0 and len(tiles[1]) == 2, tiles


def test_kernel_resources_loops_from_disassembly():
    """kernel_resources.py --loops: a loop is a branch back to a label at or before it (a forward branch or a lone
    branch to itself is none); its instructions counted by kind, predicates and modifiers stripped. And on a real
    compile for sm_90, the conv backward's stream loop is found and carries its loads and stores."""
    from benchmarks import kernel_resources as kr

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.64 R2, desc[UR4][R4.64] ;
        /*0020*/              @!P0 BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;
        /*0040*/                   MOV R5, R3 ;
        /*0050*/               @P1 BRA `(.L_x_1) ;
        /*0060*/                   MUFU.EX2 R6, R5 ;
.L_x_1:
        /*0070*/                   STG.E desc[UR4][R8.64], R6 ;
        /*0080*/               @P2 BRA `(.L_x_0) ;
.L_x_2:
        /*0090*/                   BRA `(.L_x_2);
"""
    assert kr.sass_loops(sass) == [
        dict(instructions=8, BAR=1, MOV=1, SHFL=1, MUFU=1, LDG=1, STG=1),
        {"kernel": dict(instructions=10, BAR=1, MOV=2, SHFL=1, MUFU=1, LDG=1, STG=1)},
    ]
    for name, kernel, ptrs, consts, warps, stages in kr.conv_kernels(True):
        if name == "conv_bwd":
            loops = kr.compile_sm90(kernel, ptrs, consts, warps, stages, loops=True)["loops"]
    assert len(loops) == 2 and loops[0]["LDG"] >= 2 and loops[0]["STG"] >= 1, loops
    assert loops[1]["kernel"]["instructions"] > loops[0]["instructions"], loops


def test_kernel_resources_folded_dt_drops_a_multiply_per_element():
    """config fold_dt (dt in the decay's exponent, dt.py's a2dt): compiled for sm_90 at the 1.3B tiles with documents,
    every per-head loop of the chunk scan and of dCB (those with 32 MUFU.EX2: one per element and head) runs at least
    one instruction per element fewer than without it (Triton 3.6: 334 -> 273, 584 -> 509, 615 -> 540; the multiply
    by dt and the a_s loads gone), with no more registers or spills."""
    import dataclasses

    from benchmarks import kernel_resources as kr
    from models.kernels.ssd_triton.config import block_config

    found = {}
    for fold in (False, True):
        cfg = dataclasses.replace(block_config(256, 64, 128), fold_dt=fold)
        for name, kernel, ptrs, consts, warps, stages in kr.kernels(cfg, 64, 128, True):
            if name in ("chunk_scan_fwd", "chunk_scan_bwd_dcb"):
                cap = getattr(cfg, kr.MAXNREG[name])
                info = kr.compile_sm90(kernel, ptrs, consts, warps, stages, cap, loops=True, ones=frozenset({"G"}))
                per_head = sorted(loop["instructions"] for loop in info["loops"][:-1] if loop.get("MUFU") == 32)
                found[name, fold] = (per_head, info["registers"], info["spill_stack_bytes"])
    for name in ("chunk_scan_fwd", "chunk_scan_bwd_dcb"):
        (plain, regs, spills), (folded, regs_f, spills_f) = found[name, False], found[name, True]
        assert len(plain) == len(folded) >= 1, found
        assert all(f <= p - 32 for p, f in zip(plain, folded)), (name, plain, folded)
        assert regs_f <= regs + 2 and spills_f <= spills, found


def test_kernel_resources_folded_dt_in_the_chunk_states():
    """config fold_dt_states (the chunk states' scale exp(a_last - a_s) dt_s as 2^(a_last log2(e) - a2dt_s)):
    compiled for sm_90 at the 1.3B tiles with documents, the product loop of the chained states' forward and of dB
    runs at least 16 instructions fewer per iteration (Triton 3.6: 307 -> 273, 251 -> 230; 3.9: 290 -> 271, 256 ->
    236: dt's load and multiply gone), with no more registers or spills."""
    import dataclasses

    from benchmarks import kernel_resources as kr
    from models.kernels.ssd_triton.config import block_config

    found = {}
    for fold in (False, True):
        cfg = dataclasses.replace(block_config(256, 64, 128), fold_dt=True, fold_dt_states=fold)
        for name, kernel, ptrs, consts, warps, stages in kr.kernels(cfg, 64, 128, True):
            if name in ("chained_states_fwd", "chunk_state_bwd_db"):
                cap = getattr(cfg, kr.MAXNREG[name])
                info = kr.compile_sm90(kernel, ptrs, consts, warps, stages, cap, loops=True, ones=frozenset({"G"}))
                product_loop = next(loop for loop in info["loops"][:-1] if loop.get("HGMMA"))
                found[name, fold] = (product_loop["instructions"], info["registers"], info["spill_stack_bytes"])
    for name in ("chained_states_fwd", "chunk_state_bwd_db"):
        (plain, regs, spills), (folded, regs_f, spills_f) = found[name, False], found[name, True]
        assert folded <= plain - 16, found
        assert regs_f <= regs and spills_f <= spills, found


def test_kernel_resources_states_scale_from_the_dt_kernel():
    """config states_scale (the dt kernel writes the chunk states' whole scale, documents masked): compiled for
    sm_90 at the 1.3B tiles with documents, the chained states' forward loop runs at least 40 instructions fewer per
    iteration than with fold_dt_states alone (Triton 3.6: 273 -> 218, as without documents: no ids, a_last or
    exponent in the loop), and within 128 registers without spills (four programs per SM)."""
    import dataclasses

    from benchmarks import kernel_resources as kr
    from models.kernels.ssd_triton.config import block_config

    found = {}
    for given in (False, True):
        cfg = dataclasses.replace(block_config(256, 64, 128), fold_dt=True, fold_dt_states=True, states_scale=given)
        for name, kernel, ptrs, consts, warps, stages in kr.kernels(cfg, 64, 128, True):
            if name == "chained_states_fwd":
                cap = getattr(cfg, kr.MAXNREG[name])
                info = kr.compile_sm90(kernel, ptrs, consts, warps, stages, cap, loops=True, ones=frozenset({"G"}))
                product_loop = next(loop for loop in info["loops"][:-1] if loop.get("HGMMA"))
                found[given] = (product_loop["instructions"], product_loop.get("MUFU", 0), info["registers"],
                                info["spill_stack_bytes"])  # fmt: skip
    (plain, _, _, _), (given, mufu, regs, spills) = found[False], found[True]
    assert given <= plain - 40 and mufu == 0, found
    assert regs <= 128 and spills == 0, found


def test_kernel_resources_norms_instructions_per_element():
    """kernel_resources.py compiles the norms too (norm_kernels: the block's add + RMSNorm, the gated norm) for
    sm_90 at the 1.3B widths, without spills, and their instructions per element of a row stay near what session 38
    chose them for (Triton 3.6 / 3.9: add + RMSNorm forward 17.5 / 18.0 per element of the kernel, backward 18.9 per
    element of the rows loop; gated norm forward 30, backward 36.3 / 36.3): at 8 elements per thread instead of 16
    the add + RMSNorm ran 26 and drew 6% more joules (docs/performance.md, session 38)."""
    from benchmarks import kernel_resources as kr
    from models.kernels import add_rmsnorm_triton as an
    from models.kernels import gated_rmsnorm_triton as gn

    per_element = {}
    elements = dict(add_rmsnorm_fwd=an._FWD_ELEMS_PER_THREAD, add_rmsnorm_bwd=an._BWD_ELEMS_PER_THREAD,
                    gated_norm_fwd=gn._FWD_ELEMS_PER_THREAD, gated_norm_bwd=gn._BWD_ELEMS_PER_THREAD)  # fmt: skip
    for name, kernel, ptrs, consts, warps, stages in kr.norm_kernels():
        info = kr.compile_sm90(kernel, ptrs, consts, warps, stages, loops=True)
        assert info["spill_stack_bytes"] == 0, (name, info)
        rows_loop = [loop for loop in info["loops"] if "kernel" not in loop]
        count = rows_loop[0]["instructions"] if rows_loop else info["loops"][-1]["kernel"]["instructions"]
        per_element[name] = count / elements[name]
    limits = dict(add_rmsnorm_fwd=20, add_rmsnorm_bwd=21, gated_norm_fwd=32, gated_norm_bwd=40)
    assert all(per_element[k] <= limit for k, limit in limits.items()), per_element


def test_kernel_resources_conv_one_document_branch(monkeypatch):
    """conv_triton's one-document branch compiled for sm_90 (1.3B tiles, documents): the backward then holds two
    stream loops, the one-document loop as short as the loop compiled without documents (Triton 3.6: 301 against
    377 instructions per two steps) and the other within a few of before (373; Triton 3.9: 300 / 381 against 376);
    the forward holds two bodies (twice the MUFU); registers within a few (Triton 3.6: 128 and 127 against 128 and
    126, so four programs per SM stay; 3.9: 132 and 136). Whether it pays is a GPU measurement (docs/performance.md,
    session 41)."""
    from benchmarks import kernel_resources as kr
    from models.kernels import conv_triton as ct

    def compiled(has_seq: bool, branch: bool) -> dict:
        monkeypatch.setattr(ct, "_FWD_ONE_DOC_BRANCH", branch)
        monkeypatch.setattr(ct, "_BWD_ONE_DOC_BRANCH", branch)
        return {
            name: kr.compile_sm90(kernel, ptrs, consts, warps, stages, loops=True)
            for name, kernel, ptrs, consts, warps, stages in kr.conv_kernels(has_seq)
        }

    masked, plain, branched = compiled(True, False), compiled(False, False), compiled(True, True)
    step_loops = {k: sorted(x["instructions"] for x in v["conv_bwd"]["loops"][:-1]) for k, v in
                  dict(masked=masked, plain=plain, branched=branched).items()}  # fmt: skip
    assert len(step_loops["masked"]) == len(step_loops["plain"]) == 1 and len(step_loops["branched"]) == 2, step_loops
    (one_doc, tested), (before,), (without,) = step_loops["branched"], step_loops["masked"], step_loops["plain"]
    assert one_doc <= without + 2 and tested <= before + 8 and one_doc < tested, step_loops
    fwd_mufu = {
        k: v["conv_fwd"]["loops"][-1]["kernel"]["MUFU"] for k, v in dict(masked=masked, branched=branched).items()
    }
    assert fwd_mufu["branched"] == 2 * fwd_mufu["masked"], fwd_mufu
    for name in ("conv_fwd", "conv_bwd"):
        assert branched[name]["registers"] <= masked[name]["registers"] + 10, (name, branched, masked)


def test_kernel_resources_optimizer_update_without_shared_memory():
    """kernel_resources.py compiles the optimizer's kernels too; for sm_90 our AdamW's update moves nothing through
    shared memory (the bf16 copies stored in the float32 results' layout: with 8-element copy stores Triton moved
    p, m and v to another layout through shared memory, 11 barriers per program) and takes under 32 instructions
    per element (56 with the float64 bias corrections per program, 24 after the cuts: components/adamw_triton.py)."""
    from benchmarks import kernel_resources as kr
    from components import adamw_triton

    found = {}
    for name, kernel, arg_types, consts, warps, stages in kr.optimizer_kernels():
        found[name] = kr.compile_sm90(kernel, arg_types, consts, warps, stages, loops=True, converts=True)
    assert set(found) == {"adamw", "adamw_step_scalars", "sumsq"}, found
    update = found["adamw"]
    per_element = update["loops"][-1]["kernel"]["instructions"] / (adamw_triton.BLOCK / (32 * adamw_triton.WARPS))
    assert update["layout_conversions"] == [] and update["shared_bytes"] == 0, update
    assert "BAR" not in update["loops"][-1]["kernel"] and per_element < 32, (per_element, update)


def test_bench_ssd_numerics_over_seeds_ratio_of_mean_errors(monkeypatch):
    """bench_ssd.py --numerics_seeds: per output the ratio of the mean errors over the seeds (not the mean of the
    per-seed ratios) and the per-seed ratios' range; one seed gives numerics() as it is."""
    from benchmarks import bench_ssd

    errors = {7: (1.0, 2.0), 8: (3.0, 2.0), 9: (2.0, 2.0)}  # seed -> (ours, mamba_ssm) error of dA

    def fake(fns, shape, with_seq, with_init, seed=7):
        o, m = errors[seed]
        return {"ours": {"dA": o}, "mamba_ssm": {"dA": m}, "ratio_ours_over_mamba": {"dA": o / m}}

    monkeypatch.setattr(bench_ssd, "numerics", fake)
    r = bench_ssd.numerics_over_seeds(None, None, False, False, 3)
    assert r["ours"]["dA"] == pytest.approx(2.0) and r["mamba_ssm"]["dA"] == pytest.approx(2.0)
    assert r["ratio_ours_over_mamba"]["dA"] == pytest.approx(1.0)
    assert r["per_seed_ratio_range"]["dA"] == pytest.approx((0.5, 1.5))
    assert bench_ssd.numerics_over_seeds(None, None, False, False, 1) == fake(None, None, False, False)


def test_bench_ssd_at_chunk_replaces_the_chunk_size():
    """bench_ssd.py --our_chunk: our entry point called with its own chunk size, everything else passed through."""
    from benchmarks import bench_ssd

    seen = {}

    def fn(x, dt, A, B, C, chunk_size, **kw):
        seen.update(chunk=chunk_size, **kw)
        return x

    assert bench_ssd.at_chunk(fn, 0) is fn
    assert bench_ssd.at_chunk(fn, 128)(1, 2, 3, 4, 5, 256, D=6) == 1 and seen == {"chunk": 128, "D": 6}


def test_bench_ssd_set_overrides_config_fields():
    """bench_ssd.py --set FIELD=VALUE: Python literals for real config fields; an unknown field or a value that is no
    literal is refused by name before any GPU work."""
    import argparse

    from benchmarks import bench_ssd

    ap = argparse.ArgumentParser()
    assert bench_ssd.parse_sets(ap, ["keep_states=True", "dx_warps=8", "heads_per_prog=8"]) == {
        "keep_states": True,
        "dx_warps": 8,
        "heads_per_prog": 8,
    }
    for bad in ("keep_state=True", "keep_states=Tru"):
        with pytest.raises(SystemExit):
            bench_ssd.parse_sets(ap, [bad])


def test_bench_norm_shapes_match_the_models_and_cpu_refusal():
    """bench_norm.py's operands are the fused mixer's at the 370M / 1.3B flavors with the compare_mamba_ssm batches:
    B * L rows of d_inner, z a slice of zxbcdt (2 d_inner + 2 G N + H wide); without CUDA the script stops before any
    work, naming what it needs."""
    from benchmarks import bench_norm
    from models.args import build_model_args

    for name, flavor, tokens in (("1.3b", "1.3B", 4 * 4096), ("370m", "370M", 8 * 2048)):
        a = build_model_args(flavor)
        width = 2 * a.d_inner + 2 * a.ngroups * a.d_state + a.nheads
        assert bench_norm.SHAPES[name] == (tokens, a.d_inner, width) and a.ngroups == 1
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            bench_norm.main([])


def test_launch_overhead_smoke_run_on_cpu(tmp_path):
    """benchmarks/launch_overhead.py on the CPU: Triton's interpreter, fast_launch inactive, every row measured.
    A subprocess, since the script selects the interpreter for its whole process."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "launch.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "benchmarks/launch_overhead.py", "--iters", "3", "--out", str(out)],
        cwd=repo, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fast_launch active: False" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [row["launch"].split(",")[0] for row in rows][:4] == ["kernel[grid]", "fast_launch"] * 2
    assert all(row["host_us"] > 0 for row in rows)
