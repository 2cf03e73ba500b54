"""The smaller benchmark scripts on the CPU: their refusals without CUDA or with bad shapes, their CPU-side helpers
(bench_conv's documents, bench_ssd's numerics ratio, chunk and --set, bench_norm's shapes, memory_peak, ncu_ssd,
efficiency_table, host_cost) and launch_overhead's smoke run."""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time

import pytest
import torch


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


def test_bench_mixer_refuses_bad_variants_before_timing(capsys):
    """--variant: an unknown config field and a value BlockConfig rejects are named before any GPU work (no CUDA is
    needed to be refused)."""
    from benchmarks import bench_mixer

    with pytest.raises(SystemExit):
        bench_mixer.main(["--variant", "scan_p=32,no_such_field=1"])
    assert "no_such_field" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_mixer.main(["--variant", "dcb_col_parts=3"])
    err = capsys.readouterr().err
    assert "--variant dcb_col_parts=3" in err and "power of two" in err, err


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
            ncu_ssd.main(["--shape", "370m", "--keep_states"])


def test_ncu_ssd_binds_keep_states(monkeypatch):
    """--keep_states reaches our SSD entry point (the configs' path), and is off without it."""
    from benchmarks import ncu_ssd
    from models.kernels import ssd_triton

    seen = []
    monkeypatch.setattr(ssd_triton, "ssd_chunk_scan_triton", lambda *a, **kw: seen.append(kw.get("keep_states")))
    ncu_ssd.profiled_function(True)(1, 2, 3, 4, 5, 256)
    ncu_ssd.profiled_function(False)(1, 2, 3, 4, 5, 256)
    assert seen == [True, False]


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


def test_step_energy_per_step_extra_and_cpu_smoke_run(tmp_path):
    """step_energy.py: per-step figures from one mark per step over the timed steps only (the last warm-up step's
    mark to the last one), --extra's forms and their refusals, and a smoke run of our side at the debug size on the
    CPU (times only: no energy counter there)."""
    from benchmarks import step_energy

    marks = [(0.0, 0.0), (1.0, 100.0), (1.5, 5000.0), (2.0, 10000.0), (2.5, 15000.0)]
    got = step_energy.per_step(marks, warmup=2)  # timed steps 3-5: marks 1 -> 4
    assert got["timed_steps"] == 3 and got["ms_per_step"] == pytest.approx(500.0)
    assert got["joules_per_step"] == pytest.approx(14.9 / 3) and got["watts"] == pytest.approx(14.9 / 1.5)
    assert step_energy.per_step([(0.0, None), (1.0, None)], warmup=1)["joules_per_step"] is None
    with pytest.raises(ValueError, match="no timed step"):
        step_energy.per_step(marks[:2], warmup=2)
    assert step_energy.parse_extra("none") == ("none", 0.0)
    assert step_energy.parse_extra("sleep2.5") == ("sleep", 2.5) and step_energy.parse_extra("copy4") == ("copy", 4)
    for bad in ("copy1.5", "sleep", "nap3", "copy-1"):
        with pytest.raises(ValueError, match="--extra"):
            step_energy.parse_extra(bad)
    with pytest.raises(SystemExit):
        step_energy.parse_args(["--side", "theirs", "--size", "debug"])
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the smoke run below is the CPU's")
    out = tmp_path / "r.json"
    result = step_energy.main(["--side", "ours", "--size", "debug", "--warmup", "1", "--steps", "2",
                               "--dump_folder", str(tmp_path / "run"), "--out", str(out)])  # fmt: skip
    assert result["timed_steps"] == 2 and result["ms_per_step"] > 0 and result["joules_per_step"] is None
    assert result["tokens_per_sec"] > 0 and json.loads(out.read_text())["side"] == "ours"


def test_step_energy_clock_summary_and_sampler():
    """step_energy.py's clock sampling: only the samples inside the timed window count; the medians, percentiles and
    the shares at the power cap / a thermal limit come from the reasons' bits; a sampler with a fake NVML reader
    samples on its thread until stopped, and one whose reader fails keeps the error instead of dying silently."""
    from benchmarks import step_energy

    cap, hot = step_energy.CLOCK_EVENT_BITS["sw_power_cap"], 0x20  # 0x20: SW thermal slowdown
    samples = [(0.5, 1980.0, 100.0, 0)]  # before the window: idle, full clock
    samples += [(1.0 + 0.1 * i, 1500.0 + 10 * i, 690.0 + i, cap if i < 6 else 0) for i in range(10)]
    samples += [(2.0, 1400.0, 700.0, cap | hot), (9.0, 1980.0, 80.0, 1)]  # the last one after the window
    got = step_energy.clock_summary(samples, 1.0, 2.0)
    assert got["clock_samples"] == 11
    assert got["sm_mhz_median"] == 1540.0 and got["sm_mhz_p10"] == 1500.0 and got["sm_mhz_p90"] == 1580.0
    assert got["sampled_watts_median"] == 695.0
    assert got["power_cap_share"] == pytest.approx(7 / 11) and got["thermal_share"] == pytest.approx(1 / 11)
    empty = step_energy.clock_summary(samples, 3.0, 4.0)
    assert empty["clock_samples"] == 0 and empty["sm_mhz_median"] is None and empty["power_cap_share"] is None

    calls = []
    sampler = step_energy.ClockSampler(lambda: calls.append(1) or (1700.0, 650.0, cap), period_s=0.001).start()
    deadline = time.monotonic() + 10
    while len(calls) < 5 and time.monotonic() < deadline:
        time.sleep(0.005)
    taken = sampler.stop()
    assert len(taken) >= 5 and sampler.error is None
    assert all(t1 >= t0 for (t0, *_), (t1, *_) in zip(taken, taken[1:]))  # host times, in order
    assert step_energy.clock_summary(taken, taken[0][0], taken[-1][0])["power_cap_share"] == 1.0

    def unsupported():
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    broken = step_energy.ClockSampler(unsupported, period_s=0.001).start()
    deadline = time.monotonic() + 10
    while broken.error is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert broken.stop() == [] and "NOT_SUPPORTED" in broken.error
    with pytest.raises(SystemExit):
        step_energy.parse_args(["--side", "ours", "--sample_ms", "-1"])

    class FakeNvml:  # bench_energy._Nvml's reads, as clock_sampler wires them
        sm_clock, power_w, clock_event_reasons = (lambda self: 1650), (lambda self: 699.5), (lambda self: cap)

    assert step_energy.clock_sampler(None, 50) is None and step_energy.clock_sampler(FakeNvml(), 0) is None
    wired = step_energy.clock_sampler(FakeNvml(), 1)
    deadline = time.monotonic() + 10
    while not wired.samples and time.monotonic() < deadline:
        time.sleep(0.005)
    assert wired.stop()[0][1:] == (1650, 699.5, cap) and wired.error is None


def test_bench_embedding_checks_its_arguments_and_refuses_the_cpu():
    """bench_embedding.py rejects a bad --hot before anything runs, and without CUDA stops naming what it needs."""
    from benchmarks import bench_embedding

    with pytest.raises(SystemExit, match="--hot"):
        bench_embedding.main(["--hot", "1.5"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            bench_embedding.main([])


def test_bench_products_shapes_and_variants_equal_the_whole_products():
    """bench_products.py's products are the model's (in_proj's 2 d_inner + 2 ngroups d_state + nheads columns, the
    padded vocabulary), and each way it splits or pads a product gives the whole product's values (float64 on the
    CPU, so only summation order could differ), so a faster variant it reports is one the model may take; it names
    an unknown flavor and stops without CUDA before any work."""
    from benchmarks import bench_products as bp

    assert [s[:4] for s in bp.product_shapes("1.3B")] == [
        ("in_proj", 16384, 8512, 2048), ("out_proj", 16384, 2048, 4096), ("lm_head", 16384, 50288, 2048)
    ]  # fmt: skip
    assert [s[2] for s in bp.product_shapes("370M")] == [4384, 1024, 50288]
    assert bp.row_cuts(8512) == [[8192], [8448], [4352]] and bp.row_cuts(4384) == [[4096], [4352], [2304]]
    assert bp.row_cuts(8448) == [[8192], [4224]] and bp.row_cuts(2048) == [[1024]] and bp.row_cuts(1024) == []
    assert bp.half_cut(4096) == 2048 and bp.half_cut(4384) == 2304 and bp.half_cut(1024) is None
    assert bp.padded_ks(8512) == [8576, 8704] and bp.padded_ks(2048) == []
    g = torch.Generator().manual_seed(0)
    M, N, K = 96, 200, 48
    x, w, dy = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((M, K), (N, K), (M, N)))
    nan = float("nan")
    dw = bp.dw_rows(dy, x, [128], torch.full((N, K), nan, dtype=torch.float64))
    torch.testing.assert_close(dw, dy.t() @ x, rtol=1e-12, atol=1e-12)
    for out_shape, a, b in (((N, K), dy.t(), x), ((M, K), dy, w)):  # dw and dx, in row and in column blocks
        for split, cut in ((bp.mm_rows, 40), (bp.mm_cols, 16)):
            got = split(a, b, [cut], torch.full(out_shape, nan, dtype=torch.float64))
            torch.testing.assert_close(got, a @ b, rtol=1e-12, atol=1e-12)
    fwd_pad = bp.fwd_padded(x, bp.zero_padded(w, 0, 256), N, torch.full((M, 256), nan, dtype=torch.float64))
    assert fwd_pad.shape == (M, N) and fwd_pad.stride() == (256, 1)
    torch.testing.assert_close(fwd_pad, x @ w.t(), rtol=1e-12, atol=1e-12)
    fwd = bp.fwd_split(x, w, 128, torch.full((M, N), nan, dtype=torch.float64))
    torch.testing.assert_close(fwd, x @ w.t(), rtol=1e-12, atol=1e-12)
    dy_pad, w_pad = bp.zero_padded(dy, 1, 256), bp.zero_padded(w, 0, 256)
    assert dy_pad.shape == (M, 256) and (dy_pad[:, N:] == 0).all() and torch.equal(w_pad[:N], w)
    torch.testing.assert_close(dy_pad @ w_pad, dy @ w, rtol=1e-12, atol=1e-12)
    dx = bp.dx_k_split_float32(dy, w, 128, torch.full((M, K), nan, dtype=torch.float64))
    torch.testing.assert_close(dx, dy @ w, rtol=1e-12, atol=1e-12)
    assert bp.rel_diff(dw, dy.t() @ x) < 1e-12 and bp.rel_diff(dw + 1, dw) > 1e-3
    whole = dict(row="dx", ms=0.8, tflops=700.0, rel_diff=0.0, sustained_ms=0.82, watts=690, sm_clock_mhz=1700, mj=0.5)
    half = dict(whole, row="dx cols 1024", ms=0.76, mj=0.55)
    assert bp.table_line("| x ", half, whole, False) == "| x | dx cols 1024 | 760.0 | 700 | -5.0% | 0.0e+00 |"
    assert bp.table_line("| x ", half, whole, True).endswith("| 820.0 | 690 | 1700 | 0.6 | +10.0% |")
    with pytest.raises(SystemExit, match="7B"):
        bp.main(["--flavors", "7B"])
    assert [s[0] for s in bp.product_shapes("370M")] == list(bp.PRODUCTS)
    with pytest.raises(SystemExit, match="--products: 'in_prj'"):
        bp.main(["--products", "in_proj,in_prj"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            bp.main([])
