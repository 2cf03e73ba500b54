"""The step's end without a host sync: outcomes read a step late (components/step_outcome.py), the optimizer step
skipped and clipped inside fused AdamW (components/optimizer.py), the MoE bias update masked on the device."""

from __future__ import annotations

import math

import pytest
import torch

from components.optimizer import skips_on_device, take_optimizer_steps
from components.step_outcome import StepOutcome, StepOutcomes, StepReport, nonfinite
from parallelisms.grad_norm import clip_grads_, global_grad_norm

CPU = torch.device("cpu")


def _push(outcomes, step, loss, grad_norm=1.0, votes=0.0, load=None, tokens=100, val=None):
    t = lambda v: torch.tensor(float(v))  # noqa: E731
    outcomes.push(step, t(loss), t(grad_norm), t(votes), None if load is None else t(load), lr=0.1 * step,
                  tokens=tokens, val=val or {})  # fmt: skip


def test_outcomes_come_back_in_step_order_up_to_the_step_asked_for():
    outcomes = StepOutcomes(CPU)
    for step, loss in [(1, 2.5), (2, 2.25), (3, float("nan"))]:
        _push(outcomes, step, loss, load=1.5 if step == 2 else None)
    first = outcomes.take(1)
    assert [o.step for o in first] == [1] and first[0].loss == 2.5 and first[0].lr == pytest.approx(0.1)
    assert outcomes.take(1) == []  # nothing left up to step 1
    rest = outcomes.take(3)
    assert [o.step for o in rest] == [2, 3]
    assert rest[0].expert_load == 1.5 and rest[1].expert_load is None
    assert not rest[0].skipped and rest[1].skipped and math.isnan(rest[1].loss)
    assert 0 <= first[0].end_s <= rest[0].end_s <= rest[1].end_s


class _Metrics:
    def __init__(self):
        self.records = {}

    def log(self, step, record):
        self.records[step] = record


def _outcome(step, loss=2.0, grad_norm=1.0, votes=0.0, end_s=None, val=None):
    return StepOutcome(step, loss, grad_norm, votes, None, 0.1, 1000, float(step) if end_s is None else end_s,
                       val or {})  # fmt: skip


def test_report_logs_on_its_frequency_and_times_between_step_ends():
    metrics = _Metrics()
    report = StepReport(metrics, log_freq=2, total_steps=5, skip_nonfinite_grads=0, tokens_per_sec_divisor=1,
                        flops_per_token=6.0, peak_flops=60_000.0, device=CPU)  # fmt: skip
    for step in range(1, 6):
        assert report(_outcome(step, val={"val_loss": 1.0} if step == 3 else None)) is None
    assert sorted(metrics.records) == [2, 3, 4, 5]  # every 2nd, the validation step, the last
    # step 2 ended 2 s after the start with 2000 tokens since; step 3 1 s after step 2 with 1000
    assert metrics.records[2]["tokens_per_sec"] == pytest.approx(1000.0)
    assert metrics.records[3]["tokens_per_sec"] == pytest.approx(1000.0) and metrics.records[3]["val_loss"] == 1.0
    assert metrics.records[4]["mfu"] == pytest.approx(1000.0 * 6.0 / 60_000.0)


def test_report_stops_on_a_nonfinite_loss_and_on_too_many_nonfinite_norms_in_a_row():
    metrics = _Metrics()
    report = StepReport(metrics, 10, 100, skip_nonfinite_grads=1, tokens_per_sec_divisor=1, flops_per_token=1.0,
                        peak_flops=0.0, device=CPU)  # fmt: skip
    assert report(_outcome(1, grad_norm=float("nan"))) is None  # one in a row: skipped, logged as such
    assert metrics.records[1]["skipped"] is True
    assert report(_outcome(2)) is None  # the streak ends
    assert report(_outcome(3, grad_norm=float("inf"))) is None
    problem = report(_outcome(4, grad_norm=float("nan")))  # two in a row > 1
    assert problem is not None and "gradient norm is nan at step 4" in problem.what and not problem.hint
    problem = report(_outcome(5, loss=float("nan")))
    assert problem is not None and problem.what == "loss is nan at step 5"
    strict = StepReport(metrics, 10, 100, 0, 1, 1.0, 0.0, CPU)
    assert "skip_nonfinite_grads" in strict(_outcome(1, grad_norm=float("nan"))).hint


def test_a_stop_vote_stops_every_step_but_the_last():
    report = StepReport(_Metrics(), 10, 5, 0, 1, 1.0, 0.0, CPU)
    assert report.stop_requested(_outcome(3, votes=1.0)) and not report.stop_requested(_outcome(3))
    assert not report.stop_requested(_outcome(5, votes=2.0))


def _model_with_grads(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model(torch.randn(5, 8)).square().sum().backward()
    return model


@pytest.mark.parametrize("max_norm", [0.05, 1e6, 0.0])  # clipping, not clipping, clipping off
def test_fused_step_with_the_clip_divisor_equals_clipping_then_stepping(max_norm):
    """The clipping folded into fused AdamW's grad_scale gives the update of clip_grads_ + a foreach AdamW."""
    ref, fused = _model_with_grads(), _model_with_grads()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1, foreach=True)
    opt_fused = torch.optim.AdamW(fused.parameters(), lr=0.1, weight_decay=0.1, fused=True)
    assert skips_on_device(opt_fused) and not skips_on_device(opt_ref)
    for i in range(3):
        if i:  # new gradients, the same on both
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i))
            for model, opt in ((ref, opt_ref), (fused, opt_fused)):
                opt.zero_grad()
                model(x).square().sum().backward()
        norm_ref = global_grad_norm(list(ref.parameters()))
        norm_fused = global_grad_norm(list(fused.parameters()))
        torch.testing.assert_close(norm_fused, norm_ref, rtol=1e-6, atol=0)  # equal up to the updates' rounding
        take_optimizer_steps([opt_ref], list(ref.parameters()), norm_ref, max_norm, skip=False)
        skip = nonfinite(torch.tensor(1.0), norm_fused)
        take_optimizer_steps([opt_fused], list(fused.parameters()), norm_fused, max_norm, skip=skip)
    for a, b in zip(ref.parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    if max_norm == 0.05:  # it did clip: an unclipped step differs
        unclipped = _model_with_grads()
        opt = torch.optim.AdamW(unclipped.parameters(), lr=0.1, weight_decay=0.1, foreach=True)
        opt.step()
        assert not torch.allclose(next(unclipped.parameters()), next(ref.parameters()))


@pytest.mark.parametrize("fused", [True, False])
def test_a_nonfinite_step_leaves_weights_moments_and_step_count_untouched(fused):
    model = _model_with_grads()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=0.1, fused=fused, foreach=not fused)
    take_optimizer_steps([opt], params, global_grad_norm(params), 1.0, skip=torch.tensor(0.0) if fused else False)
    before = [p.detach().clone() for p in params]
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    params[0].grad.view(-1)[0] = float("nan")
    norm = global_grad_norm(params)
    skip = nonfinite(torch.tensor(1.0), norm)
    assert skip.item() == 1.0 and skip.dtype == torch.float32 and skip.dim() == 0
    take_optimizer_steps([opt], params, norm, 1.0, skip=skip if fused else bool(skip.item()))
    for p, b, m in zip(params, before, moments, strict=True):
        assert torch.equal(p, b) and torch.equal(opt.state[p]["exp_avg"], m)
        assert float(opt.state[p]["step"]) == 1.0


def test_clip_grads_scales_to_the_max_norm():
    model = _model_with_grads()
    params = list(model.parameters())
    norm = global_grad_norm(params)
    clip_grads_(params, 0.5 * norm.item(), norm)
    assert global_grad_norm(params).item() == pytest.approx(0.5 * norm.item(), rel=1e-5)
