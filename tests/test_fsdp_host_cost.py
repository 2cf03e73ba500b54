"""benchmarks/fsdp_host_cost.py on the CPU: the variants are built through the trainer's build path in one process per
rank, take turns, and train the same model: with the same tokens on every rank FSDP2's averaged gradient is one
rank's, so every variant's losses equal `one`'s step by step (fp32, gloo: 1e-5); bad variant lists are refused."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import fsdp_host_cost as fhc
from tests.dist_utils import run_distributed

VARIANTS = (
    "one,fsdp,units1=--parallelism.fsdp_blocks_per_unit 1,all=--parallelism.fsdp_replicate_params_below 0,"
    "onecopies=--optimizer.weight_copies false"  # a one-GPU layout with overrides
)


def _bench(rank, world_size, profile_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    return fhc.main(["--config", "configs/debug.toml", "--rows", "2", "--seq", "64", "--tiny", "1x32", "--rounds", "2",
                     "--steps", "2", "--variants", VARIANTS, "--profile", profile_dir])  # fmt: skip


def test_variants_train_the_same_model_in_turn(tmp_path):
    results = run_distributed(_bench, 2, str(tmp_path))
    names = ["one", "fsdp", "units1", "all", "onecopies"]
    for r in results:
        assert list(r) == names
        # (1 untimed + 2 turns x 2 steps) per batch kind, real then tiny, then 2 profiled steps
        assert all(len(v["losses"]) == 2 * (1 + 2 * 2) + 2 for v in r.values())
        assert all(v["real"] > 0 and v["tiny"] > 0 for v in r.values())
        one = r["one"]["losses"]
        assert one[-1] < one[0]  # it trains
        for name in names[1:]:
            for a, b in zip(r[name]["losses"], one):
                assert abs(a - b) <= 1e-5 * abs(b), (name, r[name]["losses"], one)
    assert results[0]["fsdp"]["losses"] == results[1]["fsdp"]["losses"]
    for name in names:  # --profile: a trace per variant and rank, a "ProfilerStep#i" span per profiled step
        for rank in range(2):
            with open(tmp_path / name / f"rank{rank}_trace.json") as f:
                events = json.load(f)["traceEvents"]
            steps = sorted(e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#"))
            assert steps == ["ProfilerStep#0", "ProfilerStep#1"], (name, rank, steps)


def test_variant_list_errors_name_the_fix():
    assert fhc.variant_specs("one,fsdp,u15=--parallelism.fsdp_blocks_per_unit 15") == [
        ("one", []),
        ("fsdp", []),
        ("u15", ["--parallelism.fsdp_blocks_per_unit", "15"]),
    ]
    assert [fhc.one_gpu_layout(n) for n in ("one", "onegraph", "fsdp", "units1", "all")] == [1, 1, 0, 0, 0]
    with pytest.raises(ValueError, match="takes no overrides"):
        fhc.variant_specs("fsdp=--parallelism.fsdp_blocks_per_unit 2")
    with pytest.raises(ValueError, match="distinct names"):
        fhc.variant_specs("one,one")


def test_profile_table_per_step(tmp_path, capsys):
    """--profile's table on a GPU trace (synthetic here): two ProfilerSteps over 0-200 ms, compute 0-80 and 100-160,
    an all-gather 70-90 (10 ms exposed): per step wall 100 ms, compute 70, NCCL 10 (5 exposed), idle 25."""
    ms = 1000  # trace times are in us
    steps = [("ProfilerStep#0", 0, 100), ("ProfilerStep#1", 100, 100)]
    events = [{"ph": "X", "cat": "user_annotation", "name": n, "ts": ts * ms, "dur": d * ms} for n, ts, d in steps]
    kernels = [("gemm", 0, 80), ("ssd", 100, 60), ("ncclDevKernel_AllGather", 70, 20)]
    events += [{"ph": "X", "cat": "kernel", "name": n, "ts": ts * ms, "dur": d * ms} for n, ts, d in kernels]
    (tmp_path / "fsdp").mkdir()
    (tmp_path / "fsdp" / "rank0_trace.json").write_text(json.dumps({"traceEvents": events}))
    fhc.print_profiles(str(tmp_path), ["fsdp"], steps=2)
    row = capsys.readouterr().out.splitlines()[-1]
    assert row == "| fsdp | 100.0 | 70.0 | 10.0 (5.0) | 25.0 | 1 |", row
