"""Our fused residual add + RMSNorm (models/kernels/add_rmsnorm_triton.py, the blocks' pre-norm) on the CPU, through
Triton's interpreter: against add_rmsnorm_ref in float64 with autograd, both outputs used downstream.

As in test_ssd_triton.py, Triton reads TRITON_INTERPRET when first imported, so the cases run in one child process
with the variable set (once per session); each test reads its case's result.
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter_child import child_results, run_checks

pytest.importorskip("triton")


def check_add_rmsnorm(b, L, D, seed, x_dtype, residual, residual_in_fp32=False, residual_unused=False):
    """add_rmsnorm_triton against add_rmsnorm_ref in float64: normed output, new residual (and its dtype), and the
    gradients of x, residual and weight with both outputs used downstream (the new residual's own gradient flows
    back through the add), or with residual_unused only the normed output (norm_f's case: the new residual's
    gradient then reaches the backward as None). residual: None, "float32" or "x" (x's dtype)."""
    from models.kernels.add_rmsnorm_triton import add_rmsnorm_triton
    from models.kernels.norm_reference import add_rmsnorm_ref

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, x_dtype)
    x = torch.randn(b, L, D, generator=g).to(dt)
    res = (
        None
        if residual is None
        else (torch.randn(b, L, D, generator=g) * 2).to(torch.float32 if residual == "float32" else dt)
    )
    w = 1 + 0.2 * torch.randn(D, generator=g)
    c_y, c_s = (
        torch.randn(b, L, D, generator=g, dtype=torch.float64),
        torch.randn(b, L, D, generator=g, dtype=torch.float64),
    )
    out = {}
    for name, fn, up in (("ours", add_rmsnorm_triton, False), ("ref", add_rmsnorm_ref, True)):
        leaves = [None if t is None else (t.double() if up else t.clone()).requires_grad_() for t in (x, res, w)]
        y, s = fn(leaves[0], leaves[1], leaves[2], eps=1e-5, residual_in_fp32=residual_in_fp32)
        ((y.double() * c_y).sum() + (0 if residual_unused else (s.double() * c_s).sum())).backward()
        out[name] = dict(
            y=y, s=s, dx=leaves[0].grad, dw=leaves[2].grad, **({} if res is None else {"dres": leaves[1].grad})
        )
    want_s = res.dtype if res is not None else (torch.float32 if residual_in_fp32 else dt)
    assert out["ours"]["s"].dtype == want_s and out["ours"]["y"].dtype == dt, (out["ours"]["s"].dtype, want_s)
    assert out["ours"]["dx"].dtype == dt
    tol = 1e-5 if dt == torch.float32 else 2e-3  # float16 outputs carry its rounding (2^-11)
    errors = {
        k: ((out["ours"][k].double() - v.double()).norm() / v.double().norm()).item() for k, v in out["ref"].items()
    }
    bad = {k: e for k, e in errors.items() if not e <= tol}
    assert not bad, f"over {tol}: {bad}; all: {errors}"
    return errors


# name -> check_add_rmsnorm's arguments: the first block (no residual, new residual in float32), a float32 residual
# with float16 x (the bf16 model's case), a residual in x's dtype; a width that is not a power of two (masked tails)
# and more rows than backward programs (each sums several rows' weight gradient)
CASES = {
    "first_block_float32_residual": dict(b=2, L=37, D=48, seed=1, x_dtype="float32", residual=None,
                                         residual_in_fp32=True),
    "float16_x_float32_residual": dict(b=2, L=37, D=48, seed=2, x_dtype="float16", residual="float32"),
    "residual_in_x_dtype": dict(b=1, L=20, D=64, seed=3, x_dtype="float32", residual="x"),
    "new_residual_unused": dict(b=1, L=20, D=64, seed=4, x_dtype="float32", residual="float32",
                                residual_unused=True),
}  # fmt: skip


def child():
    run_checks({name: (lambda kw=kw: check_add_rmsnorm(**kw)) for name, kw in CASES.items()})


@pytest.fixture(scope="module")
def results():
    return child_results("tests.test_add_rmsnorm_triton")


@pytest.mark.parametrize("case", list(CASES))
def test_add_rmsnorm_against_float64_reference(results, case):
    r = results[case]
    assert r["ok"], r["out"]
