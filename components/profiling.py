"""Per-step profiling: torch.profiler traces and CUDA memory snapshots of the steps [profiling] chooses.

    profiler = StepProfiler(cfg.profiling, cfg.job.dump_folder, rank, device)
    for step in range(start_step + 1, cfg.training.steps + 1):
        profiler.step(step)        # first line of the loop body: ends the previous step, begins this one
        ...
    profiler.close()               # ends the last step

A chosen step s (profiling.profile_steps, else every profiling.profile_freq steps) is the time from
`profiler.step(s)` to `profiler.step(s + 1)` (or close()), i.e. one whole iteration of the loop body. Outputs,
one file per rank, under <job.dump_folder> unless the folder is absolute:

    <save_traces_folder>/iteration_<s>/rank<r>_trace.json                     chrome://tracing / ui.perfetto.dev
    <save_memory_snapshot_folder>/iteration_<s>/rank<r>_memory_snapshot.pickle  https://pytorch.org/memory_viz
    <save_memory_snapshot_folder>/oom/rank<r>_memory_snapshot.pickle            written when CUDA runs out of memory

The torch profiler runs one warm-up step before each chosen step (unless the step before was chosen too), so the
cost of starting the tracer does not land in the trace. Memory snapshots need CUDA; elsewhere they are skipped
with one log line. The allocator history is recorded from construction (after the model is built; the optimizer
states, allocated in the first step, are in it) until the last explicitly chosen step has been dumped.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Iterable

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile

from configs.job_config import Profiling

logger = logging.getLogger(__name__)  # components/log.py: shown on rank 0 and the LOG_RANK ranks


def is_chosen(step: int, profile_steps: Iterable[int], profile_freq: int) -> bool:
    """Whether `step` is profiled: listed in profile_steps, or (no list given) divisible by profile_freq."""
    steps = list(profile_steps)
    if steps:
        return step in steps
    return profile_freq > 0 and step % profile_freq == 0


def output_folder(dump_folder: str, folder: str) -> str:
    """folder under dump_folder, unless it is absolute."""
    return folder if os.path.isabs(folder) else os.path.join(dump_folder, folder)


def validate_profiling(cfg: Profiling) -> None:
    """Bad [profiling] values, named with their fix."""
    if not (cfg.enable_profiling or cfg.enable_memory_snapshot):
        return
    bad = [s for s in cfg.profile_steps if not isinstance(s, int) or isinstance(s, bool) or s < 1]
    if bad:
        raise ValueError(f"profiling.profile_steps has {bad}: list training steps (integers >= 1), e.g. [5, 6]")
    if not cfg.profile_steps and cfg.profile_freq < 1:
        raise ValueError(f"profiling.profile_freq={cfg.profile_freq} must be >= 1, or set profiling.profile_steps")
    if cfg.enable_memory_snapshot and cfg.memory_snapshot_max_entries < 1:
        raise ValueError("profiling.memory_snapshot_max_entries must be >= 1")


class StepProfiler:
    """Traces and memory snapshots of the chosen steps; does nothing (and costs nothing) when both are disabled."""

    def __init__(self, cfg: Profiling, dump_folder: str, rank: int, device: torch.device):
        validate_profiling(cfg)
        self.cfg, self.rank, self.device = cfg, rank, device
        self.trace_folder = output_folder(dump_folder, cfg.save_traces_folder)
        self.snapshot_folder = output_folder(dump_folder, cfg.save_memory_snapshot_folder)
        self.last_listed = max(cfg.profile_steps) if cfg.profile_steps else None
        self._current: int | None = None  # the step now running (between step() calls)
        self._pending: int | None = None  # the step the torch profiler's schedule is being asked about
        self._torch_prof = None
        self._tracing = cfg.enable_profiling
        self._snapshots = cfg.enable_memory_snapshot
        if self._snapshots and device.type != "cuda":
            if rank == 0:
                logger.info(f"profiling: memory snapshots need CUDA; skipped on {device.type}")
            self._snapshots = False
        if self._snapshots:
            torch.cuda.memory._record_memory_history(max_entries=cfg.memory_snapshot_max_entries)
            self._attach_oom_observer()

    # -- the per-step call --------------------------------------------------------------------------------
    def step(self, step: int) -> None:
        """End the previous step (save its trace / snapshot if chosen) and begin `step`."""
        if self._tracing:
            self._pending = step
            if self._torch_prof is None:
                self._torch_prof = self._build_torch_profiler()  # asks the schedule about `step`
                self._torch_prof.step_num = step  # its "ProfilerStep#N" labels then name training steps
                self._torch_prof.start()
            else:
                self._torch_prof.step()  # may save the previous step's trace (on_trace_ready)
            if self.last_listed is not None and step > self.last_listed:
                self._stop_tracing()  # nothing left to trace: stop paying for the profiler
        if self._snapshots and self._current is not None and self._chosen(self._current):
            self._dump_snapshot(self._current)
            if self.last_listed is not None and self._current >= self.last_listed:
                self._stop_snapshots()
        self._current = step

    def close(self) -> None:
        """End the last step: save its trace / snapshot if chosen, and stop recording."""
        if self._tracing and self._torch_prof is not None:
            self._stop_tracing()
        if self._snapshots:
            if self._current is not None and self._chosen(self._current):
                self._dump_snapshot(self._current)
            self._stop_snapshots()
        self._current = None

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- torch.profiler -------------------------------------------------------------------------------------
    def _chosen(self, step: int) -> bool:
        return is_chosen(step, self.cfg.profile_steps, self.cfg.profile_freq)

    def _schedule(self, _profiler_step: int):
        """The action for the training step self._pending (the profiler's own step counter is ignored, so the
        mapping to training steps holds whatever step the run resumed from)."""
        s = self._pending
        if self._chosen(s):
            return ProfilerAction.RECORD_AND_SAVE  # one trace per chosen step
        if self._chosen(s + 1):
            return ProfilerAction.WARMUP
        return ProfilerAction.NONE

    def _build_torch_profiler(self):
        # One trace per chosen step is the point; torch's notice that each cycle starts afresh is noise here.
        warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        return profile(
            activities=activities, schedule=self._schedule, on_trace_ready=self._save_trace, record_shapes=True
        )

    def _save_trace(self, prof) -> None:
        """on_trace_ready: called as the recorded step (self._current, not yet advanced) ends."""
        step = self._current
        folder = os.path.join(self.trace_folder, f"iteration_{step}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        t0 = time.perf_counter()
        prof.export_chrome_trace(path)
        if self.rank == 0:
            logger.info(f"profiling: step {step} trace -> {path} ({time.perf_counter() - t0:.1f} s to write)")

    def _stop_tracing(self) -> None:
        if self._torch_prof is not None:
            self._torch_prof.stop()  # saves the trace of the running step if it is being recorded
        self._torch_prof, self._tracing = None, False

    # -- CUDA memory snapshots ------------------------------------------------------------------------------
    def _dump_snapshot(self, step: int | str) -> None:
        name = f"iteration_{step}" if isinstance(step, int) else step
        folder = os.path.join(self.snapshot_folder, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        if self.rank == 0:
            logger.info(f"profiling: step {step} memory snapshot -> {path}")

    def _stop_snapshots(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)
        self._snapshots = False

    def _attach_oom_observer(self) -> None:
        """Dump the history when the caching allocator runs out of memory (before the OOM error propagates)."""
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            return

        def on_oom(device, alloc, device_alloc, device_free):
            logger.warning(
                f"profiling: CUDA out of memory (asked {alloc / 2**30:.2f} GiB, {device_free / 2**30:.2f} GiB free)"
            )
            self._dump_snapshot("oom")

        attach(on_oom)
