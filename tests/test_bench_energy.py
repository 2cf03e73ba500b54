"""benchmarks/bench_energy.py (and energy_ssd.py, its SSD modes) on the CPU: the step's call counts and energy
totals, its refusals, and every family's wiring at the debug size under Triton's interpreter (the GPU run is the
one that measures)."""

from __future__ import annotations

import collections

import pytest
import torch

from benchmarks import bench_energy as be
from benchmarks import energy_ssd as es
from tests.interpreter_child import child_results, run_checks

# The SSD's wiring is bench_ssd.fwd_bwd_fn's (tests/test_ssd_triton.py runs the kernels; the child runs it once, for
# --ssd_stages' launch counting); the optimizer is CUDA-only.
_CPU_SKIPPED = ("ssd_fwd_bwd", "optimizer")


def test_step_calls_count_what_one_step_runs():
    calls = be.step_calls(48)
    assert calls["conv_fwd"] == 96  # the forward and the backward's recompute
    assert calls["add_rmsnorm_fwd_bwd"] == 49  # every block and the final norm
    assert calls["lm_head_loss"] == calls["optimizer"] == 1
    assert {calls[k] for k in calls if k not in ("conv_fwd", "add_rmsnorm_fwd_bwd", "lm_head_loss", "optimizer")} == {
        48
    }


def test_step_totals_add_the_families_energy_and_divide_by_the_power_limit():
    calls = dict(a=2, b=1, c=1)
    rows = [
        dict(family="a", ms=0.5, mj_per_call=300.0),
        dict(family="b", ms=2.0, mj_per_call=1400.0),
        dict(family="copy", ms=0.5, mj_per_call=280.0),  # a reference: not in the step
    ]
    t = be.step_totals(rows, calls, power_limit_w=700.0)
    assert t["joules_by_family"] == pytest.approx(dict(a=0.6, b=1.4))
    assert t["joules"] == pytest.approx(2.0)
    assert t["ms_at_power_limit"] == pytest.approx(2.0 / 700.0 * 1e3)
    assert t["ms_sum"] == pytest.approx(3.0)
    assert t["missing"] == ["c"]


def test_stage_table_shares_the_whole_by_the_doubled_kernels():
    baselines = [dict(ms=1.0, mj_per_call=700.0), dict(ms=1.2, mj_per_call=720.0)]  # mean 1.1 ms, 710 mJ
    doubled = dict(a=dict(ms=1.3, mj_per_call=850.0), b=dict(ms=1.5, mj_per_call=910.0))
    rows = {r["kernel"]: r for r in es.stage_table(baselines, doubled, dict(a=1, b=2, chained_x=1))}
    assert (rows["a"]["ms"], rows["a"]["mj"], rows["a"]["watts"]) == pytest.approx((0.2, 140.0, 700.0))
    assert (rows["b"]["launches"], rows["b"]["ms"], rows["b"]["mj"]) == (2, pytest.approx(0.2), pytest.approx(100.0))
    rest = rows["rest: chained_x"]  # what was not doubled: the whole minus a once and b twice
    assert (rest["ms"], rest["mj"]) == pytest.approx((0.5, 370.0))
    assert (rows["whole"]["ms"], rows["whole"]["mj"], rows["whole"]["mj_spread"]) == pytest.approx((1.1, 710.0, 20.0))


def test_ssd_stages_doubles_each_kernel_in_turn(monkeypatch):
    """--ssd_stages' run with stand-ins: a step launching three kernels (one chained, which is never doubled) through
    FastLaunch, a measurement whose cost is 1 ms and 700 mJ per launch plus 0.5 ms and 300 mJ of the rest: each
    doubled kernel's share comes out as one launch's cost, the chained one lands in "rest" with torch's part."""
    from types import SimpleNamespace

    from models.kernels.fast_launch import FastLaunch

    real = collections.Counter()  # launches that reach the GPU: what kernel_launches wraps
    monkeypatch.setattr(FastLaunch, "launch", lambda self, grid, args, kwargs: real.update([self.kernel.fn.__name__]))
    kernels = {n: SimpleNamespace(kernel=SimpleNamespace(fn=SimpleNamespace(__name__=n)))
               for n in ("dx_kernel", "dcb_kernel", "chained_states_fwd_kernel")}  # fmt: skip

    def step():
        for n in ("dx_kernel", "dcb_kernel", "dcb_kernel", "chained_states_fwd_kernel"):
            FastLaunch.launch(kernels[n], None, (), {})

    def measure(fn):
        before = sum(real.values())
        fn()
        n = sum(real.values()) - before
        return dict(ms=n + 0.5, mj_per_call=700.0 * n + 300.0)

    rows = {r["kernel"]: r for r in es.ssd_stages(step, measure)}
    assert (rows["dx_kernel"]["launches"], rows["dcb_kernel"]["launches"]) == (1, 2)
    assert (rows["dx_kernel"]["ms"], rows["dx_kernel"]["mj"]) == pytest.approx((1.0, 700.0))
    assert (rows["dcb_kernel"]["ms"], rows["dcb_kernel"]["mj"]) == pytest.approx((1.0, 700.0))
    rest = rows["rest: chained_states_fwd_kernel"]
    assert (rest["ms"], rest["mj"]) == pytest.approx((1.5, 1000.0))
    assert (rows["whole"]["ms"], rows["whole"]["mj"]) == pytest.approx((4.5, 3100.0))


def test_refusals_before_any_work():
    with pytest.raises(SystemExit):
        be.parse_args(["--size", "7b"])
    with pytest.raises(SystemExit):
        be.parse_args(["--ssd_stages", "--families", "copy"])
    with pytest.raises(SystemExit):
        be.parse_args(["--set", "overlap_dbc=True"])  # a misspelt config field
    assert be.parse_args(["--set", "overlap_dcb=True"]).config_overrides == {"overlap_dcb": True}
    with pytest.raises(SystemExit):
        be.parse_args(["--conv", "_FWD_ONE_DOC=True"])  # no such conv setting
    with pytest.raises(SystemExit):
        be.parse_args(["--conv", "_FWD_ONE_DOC_BRANCH=yes"])  # no Python literal
    assert be.parse_args(["--conv", "_BWD_ONE_DOC_BRANCH=True"]).conv_settings == {"_BWD_ONE_DOC_BRANCH": True}
    with pytest.raises(ValueError, match="NOT_DOUBLED"):
        with es.kernel_launches(collections.Counter(), double="chained_states_fwd_kernel"):
            pass
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            be.main(["--size", "debug"])


def test_variant_plan_puts_a_baseline_on_either_side_of_every_variant():
    assert es.variant_plan(5) == [None, 0, 1, None, 2, 3, None, 4, None]
    assert es.variant_plan(1) == [None, 0, None]
    assert es.variant_plan(3, baseline_every=1) == [None, 0, None, 1, None, 2, None]


def test_variant_table_compares_each_variant_with_its_neighbouring_baselines():
    rows = [
        dict(index=None, ms=1.0, mj_per_call=100.0),
        dict(index=0, ms=0.9, mj_per_call=99.0),
        dict(index=1, failed="OutOfResources"),
        dict(index=None, ms=1.2, mj_per_call=102.0),
        dict(index=2, ms=1.1, mj_per_call=98.0),
        dict(index=None, ms=1.0, mj_per_call=100.0),
    ]
    t = es.variant_table(rows)
    assert t[1]["vs_baselines"] == pytest.approx(99.0 / 101.0 - 1)
    assert t[1]["ms_vs_baselines"] == pytest.approx(0.9 / 1.1 - 1)
    assert t[4]["vs_baselines"] == pytest.approx(98.0 / 101.0 - 1)
    assert "vs_baselines" not in t[2]
    assert t[0]["baselines_spread"] == pytest.approx(0.02)


def test_ssd_variants_checks_outputs_catches_failures_and_restores_the_config():
    """The --variant run's logic with stand-ins for the kernels' outputs and the measurement: every config patched in
    turn (the stand-ins read it), a variant whose outputs differ is marked, a failing one (refused by BlockConfig, or
    in the measurement) is a row with its error and the run goes on, and the base config (--set) is what stays
    patched afterwards."""
    from benchmarks import bench_ssd
    from models.kernels.ssd_triton import autograd as ours_autograd

    def current():  # the config our SSD would run with now
        return ours_autograd.block_config(256, 64, 128)

    def outputs(fn, inp, Q, dy):
        c = current()
        return [torch.ones(3) * (2.0 if c.bcf_n == 16 else 1.0)]  # bcf_n=16 "computes something else"

    def measure(step):
        c = current()
        if c.bcf_warps == 2:
            raise RuntimeError("out of resources")
        return dict(ms=1.0, watts=700.0, mj_per_call=100.0 - c.bcf_warps)  # bcf_warps 8: 4 mJ less than 4

    problem = dict(fn=None, inp=dict(x=torch.zeros(2)), Q=256, dy=None)
    variants = [dict(bcf_warps=8), dict(dcb_col_parts=3), dict(bcf_warps=2), dict(bcf_n=16)]
    try:
        rows = es.ssd_variants(problem, variants, dict(overlap_dcb=False), measure, outputs)
        assert [r["index"] for r in rows] == es.variant_plan(4)
        by_name = {r["variant"]: r for r in rows}
        assert by_name["bcf_warps=8"]["vs_baselines"] == pytest.approx(96.0 / 96.0 - 1 - 4.0 / 96.0)
        assert not by_name["bcf_warps=8"]["differs"]
        assert by_name["dcb_col_parts=3"]["failed"].startswith("ValueError: BlockConfig.dcb_col_parts")  # refused
        assert by_name["bcf_warps=2"]["failed"] == "RuntimeError: out of resources"  # failed in the measurement
        assert by_name["bcf_n=16"]["differs"] and by_name["bcf_n=16"]["max_rel_diff"] == pytest.approx(1.0)
        assert current().overlap_dcb is False and current().bcf_warps != 8  # the base (--set) stays patched

        def interrupted(step):  # not an Exception: the run stops, with the base patched back
            if current().bcf_warps == 8:
                raise KeyboardInterrupt
            return measure(step)

        with pytest.raises(KeyboardInterrupt):
            es.ssd_variants(problem, variants, dict(overlap_dcb=False), interrupted, outputs)
        assert current().overlap_dcb is False and current().bcf_warps != 8
    finally:
        bench_ssd.patched_config({})


def test_variant_refusals():
    with pytest.raises(SystemExit):
        be.parse_args(["--variant", "dcb_col_part=2"])  # no such field
    with pytest.raises(SystemExit):
        be.parse_args(["--variant", "dcb_col_parts=2", "--families", "copy"])
    with pytest.raises(SystemExit):
        be.parse_args(["--variant", "dcb_col_parts=2", "--ssd_stages"])
    with pytest.raises(SystemExit):
        be.parse_args(["--variant", ","])
    a = be.parse_args(["--variant", "dcb_col_parts=2", "--variant", "bcf_n=64,bcf_warps=8"])
    assert a.variants == [dict(dcb_col_parts=2), dict(bcf_n=64, bcf_warps=8)]


def _ssd_variant_wiring() -> dict:
    """--variant's wiring with the real kernels (interpreter; a problem smaller than the debug size's, shaped like
    ssd_problem's, since the three runs take ~12 s each at that size): a tile variant computes the same function (its
    outputs within float32 rounding of the baseline's), and measure_fn gets a step that runs the SSD."""
    from benchmarks.bench_ssd import make_inputs
    from models.kernels.ssd_triton import ssd_chunk_scan_triton

    ran = []

    def measure(step):
        step()
        ran.append(1)
        return dict(ms=1.0, watts=1.0, mj_per_call=1.0)

    cpu = torch.device("cpu")
    problem = dict(
        fn=ssd_chunk_scan_triton,
        inp=make_inputs(dict(b=1, L=128, H=4, P=16, N=16, G=1), True, 0, device=cpu),
        Q=64,
        dy=torch.randn(1, 128, 4, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    )
    assert set(problem) == set(be.ssd_problem("debug", cpu))  # the same keys as the real problem's
    rows = es.ssd_variants(problem, [dict(dx_heads=2)], {}, measure)
    assert len(ran) == 3 and [r["index"] for r in rows] == [None, 0, None]
    assert not rows[1]["differs"] and rows[1]["max_rel_diff"] < 1e-4, rows[1]
    return dict(max_rel_diff=rows[1]["max_rel_diff"])


def _ran(fn) -> None:
    fn()  # its outputs are tensors, which the child's JSON report does not carry


def _ssd_launches_counted_and_doubled(ssd_step) -> dict:
    """--ssd_stages' wiring: every SSD kernel's launches counted by name, and a doubled kernel launched twice per call
    (the outer count sees each launch the inner one makes)."""
    outer, inner = collections.Counter(), collections.Counter()
    with es.kernel_launches(outer), es.kernel_launches(inner, double="chunk_scan_bwd_dx_kernel"):
        ssd_step()
    assert {"chunk_scan_fwd_kernel", "chunk_scan_bwd_dx_kernel", "chunk_scan_bwd_dcb_kernel"} <= set(inner), inner
    assert outer["chunk_scan_bwd_dx_kernel"] == 2 * inner["chunk_scan_bwd_dx_kernel"] == 2
    assert all(outer[k] == n for k, n in inner.items() if k != "chunk_scan_bwd_dx_kernel")
    return dict(inner)


def child():
    fams = be.families("debug", torch.device("cpu"))
    assert fams["optimizer"] is None
    checks = {name: (lambda fn=fn: _ran(fn)) for name, fn in fams.items() if name not in _CPU_SKIPPED}
    checks["ssd_stages"] = lambda: _ssd_launches_counted_and_doubled(fams["ssd_fwd_bwd"])
    checks["ssd_variants"] = _ssd_variant_wiring
    run_checks(checks)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is the CPU's stand-in for the GPU run")
def test_every_family_runs_at_the_debug_size_under_the_interpreter():
    results = child_results("tests.test_bench_energy")
    step_families = set(be.step_calls(1)) - set(_CPU_SKIPPED)
    assert set(results) - {"ssd_fwd_bwd_mamba_ssm"} == step_families | {"copy", "ssd_stages", "ssd_variants"}
    failed = {name: r["out"] for name, r in results.items() if not r["ok"]}
    assert not failed, failed
