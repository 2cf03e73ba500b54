"""The trainer's step never makes the host wait for the GPU (components/step_outcome.py): a profiled step holds no
stream or device synchronisation (what `.item()`, `.tolist()` or `.cpu()` of a CUDA tensor, or
torch.cuda.synchronize, would add), only the event wait for the previous step's outcome. A guard against a sync
creeping back into the loop, the model or the kernels' host code (each costs the GPU the host's time to the next
launch: 9-29 ms per 1.3B step before, docs/performance.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.gpu.launch import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize")


def _host_calls(trace: Path) -> list[dict]:
    return [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]


def _inside(call: dict, events: list[dict]) -> str:
    """The host ops a call ran inside, outermost first (where a sync came from: aten::item, a module, ...)."""
    t0, t1 = call["ts"], call["ts"] + call.get("dur", 0)
    outer = [
        e for e in events
        if e is not call and e.get("tid") == call.get("tid") and e["ts"] <= t0 and e["ts"] + e.get("dur", 0) >= t1
    ]  # fmt: skip
    return " > ".join(e["name"] for e in sorted(outer, key=lambda e: -e.get("dur", 0)))


@pytest.mark.parametrize("extra", [[], ["--training.document_masking", "false"]], ids=["documents", "rows"])
def test_a_training_step_does_not_wait_for_the_gpu(tmp_path, extra):
    args = [
        "--job.config_file", "configs/debug.toml", "--training.steps", "5", "--training.seq_len", "512",
        "--metrics.log_freq", "1", "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
        "--validation.enable", "false", "--profiling.enable_profiling", "true", "--profiling.profile_steps", "[3]",
        *extra,
    ]  # fmt: skip
    records = train(args, tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # every step still logged, a step late
    events = _host_calls(tmp_path / "run" / "profile_trace" / "iteration_3" / "rank0_trace.json")
    names = [e.get("name", "") for e in events]
    assert any(n.startswith("ProfilerStep#3") for n in names)
    # Only inside the step: the profiler synchronises the device itself where its recording starts and stops.
    chains = [(e, _inside(e, events)) for e in events if e.get("name") in SYNCS]
    syncs = [f"{e['name']} in {chain}" for e, chain in chains if "ProfilerStep#3" in chain]
    assert not syncs, "step 3 waited for the GPU:\n" + "\n".join(syncs)
    assert "cudaEventSynchronize" in names  # the previous step's outcome, read once this step is queued
