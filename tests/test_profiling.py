"""components/profiling.py: traces land exactly at the chosen steps (each holding that step's work and no other
step's), nothing is written when disabled, memory snapshots skip on CPU, bad values fail clearly; and through
train.py: a 3-step run profiling step 2 writes one trace for step 2 and the same losses as an unprofiled run."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from torch.profiler import record_function

from components.profiling import StepProfiler, is_chosen, output_folder, validate_profiling
from configs.job_config import Profiling
from tests.parity import PARITY_ARGS, run_training


def _trace_names(path: Path) -> set[str]:
    return {e.get("name", "") for e in json.loads(path.read_text())["traceEvents"]}


def _run_loop(profiler: StepProfiler, steps: range) -> None:
    """A stand-in training loop whose step s does a matmul inside a region named marker_s."""
    for s in steps:
        profiler.step(s)
        with record_function(f"marker_{s}"):
            torch.randn(32, 32) @ torch.randn(32, 32)
    profiler.close()


def _iterations(folder: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in folder.glob("iteration_*")) if folder.exists() else []


def test_is_chosen():
    assert [s for s in range(1, 13) if is_chosen(s, [], 4)] == [4, 8, 12]
    assert [s for s in range(1, 13) if is_chosen(s, [3, 4, 11], 4)] == [3, 4, 11]  # the list wins over the freq
    assert not any(is_chosen(s, [], 0) for s in range(1, 5))
    assert output_folder("/run", "traces") == "/run/traces" and output_folder("/run", "/abs/t") == "/abs/t"


@pytest.mark.parametrize(
    "steps,cfg_kw,expected",
    [
        (range(1, 6), {"profile_steps": [2, 3, 5]}, [2, 3, 5]),  # consecutive chosen steps, and the last step
        (range(1, 6), {"profile_steps": [1]}, [1]),  # the first step (no warm-up step before it)
        (range(3, 8), {"profile_freq": 2}, [4, 6]),  # a run resumed at step 3: training step numbers
    ],
)
def test_traces_at_chosen_steps(tmp_path, steps, cfg_kw, expected):
    prof = StepProfiler(Profiling(enable_profiling=True, **cfg_kw), str(tmp_path), rank=0, device=torch.device("cpu"))
    _run_loop(prof, steps)
    folder = tmp_path / "profile_trace"
    assert _iterations(folder) == expected
    for s in expected:
        names = _trace_names(folder / f"iteration_{s}" / "rank0_trace.json")
        markers = {n for n in names if n.startswith("marker_")}
        assert markers == {f"marker_{s}"}, f"trace of step {s} holds {markers}"
        assert f"ProfilerStep#{s}" in names and "aten::mm" in names


def test_disabled_writes_nothing(tmp_path):
    _run_loop(StepProfiler(Profiling(profile_steps=[1, 2]), str(tmp_path), 0, torch.device("cpu")), range(1, 4))
    assert list(tmp_path.iterdir()) == []


def test_memory_snapshot_skipped_on_cpu(tmp_path, caplog):
    cfg = Profiling(enable_memory_snapshot=True, profile_steps=[1])
    with caplog.at_level(logging.INFO, logger="components.profiling"):
        _run_loop(StepProfiler(cfg, str(tmp_path), 0, torch.device("cpu")), range(1, 3))
    assert "memory snapshots need CUDA; skipped on cpu" in caplog.text
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"profile_steps": [0, 3]}, "profiling.profile_steps"),
        ({"profile_freq": 0}, "profiling.profile_freq=0"),
        ({"profile_steps": ["x"]}, "profiling.profile_steps"),
    ],
)
def test_bad_values(kw, msg):
    with pytest.raises(ValueError, match=msg):
        validate_profiling(Profiling(enable_profiling=True, **kw))
    validate_profiling(Profiling(enable_profiling=False, **kw))  # ignored while disabled


def test_train_py_traces_step_2_only(tmp_path):
    args = list(PARITY_ARGS)
    args[args.index("--training.steps") + 1] = "3"
    ref = run_training(1, args, tmp_path / "plain")
    got = run_training(
        1,
        args
        + [
            "--profiling.enable_profiling",
            "true",
            "--profiling.profile_steps",
            "[2]",
            "--profiling.enable_memory_snapshot",
            "true",
        ],
        tmp_path / "prof",
    )
    assert _iterations(tmp_path / "prof" / "profile_trace") == [2]
    assert not (tmp_path / "prof" / "memory_snapshot").exists()  # CPU: skipped
    assert not (tmp_path / "plain" / "profile_trace").exists()
    names = _trace_names(tmp_path / "prof" / "profile_trace" / "iteration_2" / "rank0_trace.json")
    # the whole step: forward, backward and the optimizer step
    assert {"ProfilerStep#2", "aten::mm", "MmBackward0", "Optimizer.step#ShardLocalAdamW.step"} <= names
    # profiling observes, it does not change the run
    assert [(r["step"], r["loss"]) for r in got] == [(r["step"], r["loss"]) for r in ref]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_traces_and_memory_snapshots(tmp_path):
    """On a GPU: the trace holds CUDA kernels; each chosen step's snapshot holds that step's allocations (a
    distinctive size per step) and not later ones; recording stops after the last listed step; OOM dumps too."""
    import pickle

    cfg = Profiling(enable_profiling=True, enable_memory_snapshot=True, profile_steps=[2, 3])
    prof = StepProfiler(cfg, str(tmp_path), rank=0, device=torch.device("cuda"))
    keep = []
    # bytes allocated in step s: 12, 14, ... MiB (whole 2 MiB multiples: the allocator's block is exactly that size)
    size_of = {s: (10 + 2 * s) * 2**20 for s in range(1, 7)}
    torch.cuda.empty_cache()
    for s in range(1, 6):
        prof.step(s)
        keep.append(torch.empty(size_of[s], dtype=torch.uint8, device="cuda"))
        torch.randn(256, 256, device="cuda") @ torch.randn(256, 256, device="cuda")
    prof.close()
    torch.cuda.synchronize()
    assert _iterations(tmp_path / "profile_trace") == [2, 3]
    events = json.loads((tmp_path / "profile_trace" / "iteration_2" / "rank0_trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    assert _iterations(tmp_path / "memory_snapshot") == [2, 3]
    for s in (2, 3):
        snap = pickle.loads(
            (tmp_path / "memory_snapshot" / f"iteration_{s}" / "rank0_memory_snapshot.pickle").read_bytes()
        )
        sizes = {e["size"] for trace in snap["device_traces"] for e in trace if e["action"] == "alloc"}
        assert size_of[s] in sizes and size_of[s + 1] not in sizes and size_of[1] in sizes
    # recording stopped with the last listed step: a later allocation is not in the history
    keep.append(torch.empty(size_of[6], dtype=torch.uint8, device="cuda"))
    later = {e["size"] for trace in torch.cuda.memory._snapshot()["device_traces"] for e in trace}
    assert size_of[6] not in later
    # out of memory: the observer writes oom/ (a fresh profiler, recording again)
    oom = StepProfiler(
        Profiling(enable_memory_snapshot=True, profile_steps=[99]), str(tmp_path / "o"), 0, torch.device("cuda")
    )
    oom.step(1)
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(2**50, dtype=torch.uint8, device="cuda")
    oom.close()
    assert (tmp_path / "o" / "memory_snapshot" / "oom" / "rank0_memory_snapshot.pickle").exists()
