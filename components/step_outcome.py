"""What each training step ends with, read by the host one step late, so that the GPU never waits for the host.

A step ends with device scalars: the global mean loss, the global gradient norm, the ranks' SIGTERM votes and the MoE
load (all all-reduced, equal on every rank). Reading them at once (`.item()`) makes the host wait for the step's
last kernel before it launches anything of the next step: the GPU then idles while the host prepares the next batch
and launches the first kernels (9-29 ms of a 1.3B step on one H100, docs/performance.md). Instead:
- the optimizer skips a non-finite step on the device (fused AdamW's found_inf; components/optimizer.py);
- `push` copies the step's scalars to pinned host memory behind its kernels and records an event;
- `take(step - 1)` reads the previous step's once this step's work is queued, so the GPU always has a step queued.
The host reads a step at once (`take(step)`) where it must know it before going on: a checkpoint, validation or last
step, a stop, and every step of an optimizer that cannot skip on the device (which reads it before its update).
`StepReport` then does what the host does with an outcome, in step order: stop on a non-finite loss or too many
non-finite gradient norms in a row, warn on a skipped step, log the metrics.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from components.metrics import memory_gib

logger = logging.getLogger(__name__)

_LOSS, _GRAD_NORM, _STOP_VOTES, _EXPERT_LOAD = range(4)


def nonfinite(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """1.0 where the step's loss or gradient norm is NaN or infinite, else 0.0: a 0-d float32 device tensor, the
    found_inf that fused AdamW skips the step on."""
    return (~(torch.isfinite(loss) & torch.isfinite(grad_norm))).float()


@dataclass
class StepOutcome:
    """A step's scalars on the host, and what the host knew when it launched the step."""

    step: int
    loss: float
    grad_norm: float
    stop_votes: float  # ranks that had received SIGTERM when the step's loss was all-reduced
    expert_load: float | None  # the busiest expert's load over the mean (models with MoE layers)
    lr: float
    tokens: int  # tokens this rank processed in the step
    end_s: float  # when the step (its validation included) ended: seconds since the loop's start
    val: dict = field(default_factory=dict)  # validation metrics taken after the step

    @property
    def skipped(self) -> bool:
        """Non-finite: the optimizer left the step out (on the device, or the host never called it)."""
        return not (math.isfinite(self.loss) and math.isfinite(self.grad_norm))


@dataclass
class _Pending:
    step: int
    values: torch.Tensor  # [4] float32, pinned host memory being filled by a copy behind the step's kernels
    ready: torch.cuda.Event | float  # CUDA: recorded behind the copy; CPU: the step's end, time.perf_counter()
    meta: dict


class StepOutcomes:
    """The steps launched but not yet read on the host, oldest first (see the module docstring)."""

    def __init__(self, device: torch.device):
        """Call where the loop starts: the steps' end times are measured from here (on the GPU, by CUDA events:
        GPU time, whatever the host does meanwhile)."""
        self.device = device
        self._pending: deque[_Pending] = deque()
        self._start_s = time.perf_counter()
        self._start_event = None
        if device.type == "cuda":
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()

    def push(self, step: int, loss, grad_norm, stop_votes, expert_load, *, lr: float, tokens: int, val: dict) -> None:
        """Start copying step `step`'s device scalars to the host (0-d tensors; expert_load may be None); no sync."""
        load = expert_load if expert_load is not None else torch.full((), float("nan"), device=self.device)
        values = torch.stack([t.detach().float().reshape(()) for t in (loss, grad_norm, stop_votes, load)])
        if values.is_cuda:
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
            values = host
        else:
            ready = time.perf_counter()
        meta = dict(lr=lr, tokens=tokens, val=val, has_load=expert_load is not None)
        self._pending.append(_Pending(step, values, ready, meta))

    def take(self, through_step: int) -> list[StepOutcome]:
        """The outcomes of every pushed step up to `through_step`, oldest first; waits for their copies only."""
        out = []
        while self._pending and self._pending[0].step <= through_step:
            p = self._pending.popleft()
            if isinstance(p.ready, torch.cuda.Event):
                p.ready.synchronize()
                end_s = self._start_event.elapsed_time(p.ready) / 1000.0
            else:
                end_s = p.ready - self._start_s
            v = p.values.tolist()
            m = p.meta
            out.append(
                StepOutcome(
                    step=p.step,
                    loss=v[_LOSS],
                    grad_norm=v[_GRAD_NORM],
                    stop_votes=v[_STOP_VOTES],
                    expert_load=v[_EXPERT_LOAD] if m["has_load"] else None,
                    lr=m["lr"],
                    tokens=m["tokens"],
                    end_s=end_s,
                    val=m["val"],
                )
            )
        return out


@dataclass
class NonFiniteStep:
    """Why a run must stop after a step: its message, and a hint for the user."""

    what: str
    hint: str = ""


class StepReport:
    """What the host does with each step's outcome, in step order: the non-finite checks, the warning on a skipped
    step and the metrics record (loss, grad norm, lr, tokens/s and MFU since the last record, memory)."""

    def __init__(self, metrics, log_freq: int, total_steps: int, skip_nonfinite_grads: int, tokens_per_sec_divisor,
                 flops_per_token: float, peak_flops: float, device: torch.device):  # fmt: skip
        self.metrics, self.log_freq, self.total_steps = metrics, log_freq, total_steps
        self.skip_budget = skip_nonfinite_grads
        self.divisor = tokens_per_sec_divisor  # pipeline stages sharing a replica's tokens
        self.flops_per_token, self.peak, self.device = flops_per_token, peak_flops, device
        self.nonfinite_streak = 0
        self.last_end_s, self.tokens_since_log = 0.0, 0  # the last logged step's end (0: the loop's start)

    def __call__(self, o: StepOutcome) -> NonFiniteStep | None:
        """Log `o` (on logging steps and on every skipped, stopping or validation step); return why the run must stop
        (a non-finite loss, or more non-finite gradient norms in a row than training.skip_nonfinite_grads), else
        None. The values are all-reduced, so every rank returns the same."""
        if not math.isfinite(o.loss):
            return NonFiniteStep(f"loss is {o.loss} at step {o.step}")
        self.nonfinite_streak = self.nonfinite_streak + 1 if o.skipped else 0
        if self.nonfinite_streak > self.skip_budget:
            return NonFiniteStep(
                f"the global gradient norm is {o.grad_norm} at step {o.step} (its loss {o.loss:.4f} is finite)",
                hint=""
                if self.skip_budget
                else " To skip such steps instead, set --training.skip_nonfinite_grads N (N in a row at most).",
            )
        if o.skipped:
            logger.warning(
                f"step {o.step}: the global gradient norm is {o.grad_norm}: step skipped, no optimizer update "
                f"({self.nonfinite_streak} in a row; at most training.skip_nonfinite_grads={self.skip_budget})"
            )
        self.tokens_since_log += o.tokens
        if o.step % self.log_freq == 0 or o.step == self.total_steps or o.val or o.skipped or self.stop_requested(o):
            self._log(o)
        return None

    def stop_requested(self, o: StepOutcome) -> bool:
        """A rank received SIGTERM before step `o` ended (and it is not the last step): every rank stops after the
        step it reads this in, and saves that step."""
        return o.stop_votes > 0 and o.step < self.total_steps

    def _log(self, o: StepOutcome) -> None:
        # Between the ends of the steps (GPU time on the GPU), not when the host got to read them: the host reads a
        # step late, and the last steps of a run at once.
        dt = max(o.end_s - self.last_end_s, 1e-9)
        tps = self.tokens_since_log / dt / self.divisor  # tokens/s per device
        record = {
            "loss": o.loss,
            "grad_norm": o.grad_norm,
            "lr": o.lr,
            "tokens_per_sec": tps,
            "mfu": tps * self.flops_per_token / self.peak if self.peak else 0.0,
            "memory_gib": memory_gib(self.device),
            **o.val,
        }
        if o.skipped:
            record["skipped"] = True
        if o.expert_load is not None:  # busiest expert / mean, worst MoE layer (E / top_k at most)
            record["moe_max_load_ratio"] = o.expert_load
        self.metrics.log(o.step, record)
        self.last_end_s, self.tokens_since_log = o.end_s, 0
