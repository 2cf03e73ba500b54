"""Our gated RMSNorm halves (models/kernels/gated_rmsnorm_triton.py) on the CPU, through Triton's interpreter.

Forward (out, rstd) and backward (dy, dz written into a strided view, dweight, the recomputed output) against
rmsnorm_gated_ref in float64 with autograd, on the same (already rounded) inputs: norm_before_gate False and True,
one and two groups, a width that is not a power of two (masked tails), y / z / dout / dz as row-strided views into
wider buffers, more rows than backward programs and not a multiple of them (and fewer rows than programs), the output
recomputed or not, float32 and bfloat16. float32: the interpreter computes in float32 numpy, errors ~1e-7, tolerance
1e-5. bfloat16: the outputs are rounded once, so ours must sit as close to the float64 reference as a float32 torch
computation rounded to bfloat16 does (within 25%). The interpreter rounds float32 to bfloat16 toward zero where the
GPU rounds to nearest (twice the error), so here the float32 computation is truncated the same way; the GPU test
(tests/gpu/test_kernels_gpu.py) holds the compiled kernels to mamba_ssm's rounding.

As in test_ssd_triton.py, Triton reads TRITON_INTERPRET when first imported, so the cases run in one child process
with the variable set (all of them, once per session, ~10 s); each test reads its case's result.
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter_child import child_results, run_checks

pytest.importorskip("triton")

EPS = 1e-5

# name -> (M, D, group_size, norm_before_gate, recompute, dtype, weight dtype). The CPU launch counts 4 SMs, so the
# backward runs 16 / groups programs: 37 rows give some programs 3 rows, one 1 and some none; 5 rows fewer than that.
CASES = {
    "fp32_gate_first_1group": (37, 48, 48, False, True, "float32", "float32"),
    "fp32_norm_first_1group": (37, 48, 48, True, False, "float32", "float32"),
    "fp32_gate_first_2groups": (37, 48, 24, False, False, "float32", "float32"),
    "fp32_norm_first_2groups": (29, 64, 32, True, True, "float32", "float32"),
    "fp32_fewer_rows_than_programs": (5, 40, 20, False, True, "float32", "float32"),
    "bf16_gate_first_1group": (37, 48, 48, False, True, "bfloat16", "float32"),
    "bf16_norm_first_2groups": (37, 48, 24, True, True, "bfloat16", "bfloat16"),
}


def _as_interpreter_rounds(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> dtype as Triton's interpreter casts it: toward zero for bfloat16 (the low 16 bits dropped)."""
    if dtype != torch.bfloat16:
        return t.to(dtype)
    return (t.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact: the low bits are zero


def check_case(M, D, group_size, norm_before_gate, recompute, dtype, w_dtype, seed=0) -> dict:
    """One case in the child (TRITON_INTERPRET=1): relative errors of ours against the float64 reference (and, for
    bfloat16, of float32 torch rounded to bfloat16); raises AssertionError on a contract violation."""
    from models.kernels.gated_rmsnorm_triton import gated_rmsnorm_bwd, gated_rmsnorm_fwd
    from models.kernels.norm_reference import rmsnorm_gated_ref

    g = torch.Generator().manual_seed(seed)
    dt, wdt = getattr(torch, dtype), getattr(torch, w_dtype)
    # Row-strided views with a contiguous last dim, each with its own row stride (z as it sits in zxbcdt).
    y = torch.randn(M, D + 3, generator=g).to(dt)[:, 3:]
    z = torch.randn(M, 2 * D + 11, generator=g).to(dt)[:, D + 7 : 2 * D + 7]
    dout = torch.randn(M, D + 5, generator=g).to(dt)[:, 5:]
    w = (1 + 0.2 * torch.randn(D, generator=g)).to(wdt)
    dz_buf = torch.full((M, D + 9), float("nan"), dtype=dt)
    dz = dz_buf[:, 4 : D + 4]
    assert len({t.stride(0) for t in (y, z, dout, dz)}) == 4 and min(t.stride(0) for t in (y, z, dout, dz)) > D

    out, rstd = gated_rmsnorm_fwd(y, w, z, EPS, group_size, norm_before_gate)
    dy, dw, out_again = gated_rmsnorm_bwd(dout, y, w, z, rstd, EPS, group_size, norm_before_gate, dz, recompute)
    assert out.dtype == dt and dy.dtype == dt and dw.dtype == wdt and rstd.dtype == torch.float32
    assert out.shape == dy.shape == (M, D) and rstd.shape == (M * D // group_size,)
    assert torch.isnan(dz_buf[:, :4]).all() and torch.isnan(dz_buf[:, D + 4 :]).all(), "dz written outside its view"
    if recompute:
        assert torch.equal(out_again, out), "recomputed output differs from the forward's"
    else:
        assert out_again is None

    def grads(cdt):
        leaves = [t.detach().to(cdt).requires_grad_() for t in (y, w, z)]
        ref = rmsnorm_gated_ref(leaves[0], leaves[1], leaves[2], EPS, group_size, norm_before_gate)
        ref.backward(dout.to(cdt))
        return dict(out=ref.detach(), dy=leaves[0].grad, dw=leaves[1].grad, dz=leaves[2].grad)

    want = grads(torch.float64)
    y64 = y.double() * (torch.nn.functional.silu(z.double()) if not norm_before_gate else 1)
    ms = y64.unflatten(-1, (D // group_size, group_size)).square().mean(-1)  # [M, groups]
    want["rstd"] = torch.rsqrt(ms + EPS).t().reshape(-1)  # group-major: group * M + row

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    got = dict(out=out, rstd=rstd, dy=dy, dw=dw, dz=dz)
    errors = {k: rel(got[k], want[k]) for k in got}
    result = {"ours": errors}
    if dt == torch.float32:
        bad = {k: e for k, e in errors.items() if not e <= 1e-5}
    else:  # bfloat16 rounding: ours against float32 torch rounded once to the outputs' dtypes
        f32 = grads(torch.float32)
        rounded = {k: rel(_as_interpreter_rounds(f32[k], got[k].dtype), want[k]) for k in f32}
        result["float32_rounded"] = rounded
        bad = {k: (e, rounded[k]) for k, e in errors.items() if k in rounded and not e <= 1.25 * rounded[k] + 1e-6}
        bad |= {"rstd": errors["rstd"]} if not errors["rstd"] <= 1e-5 else {}
    assert not bad, f"over tolerance: {bad}; all: {result}"
    return result


def check_autograd_op(seed=0) -> dict:
    """ops.rmsnorm_gated under backend 'triton' (the unfused mixer's norm: context parallel): our kernels as one
    autograd op on [B, L, D], z a strided slice, against the float64 reference; float32, one and two groups, both
    gate orders. Relative errors of the output and the three gradients."""
    from models.kernels import ops
    from models.kernels.norm_reference import rmsnorm_gated_ref

    g = torch.Generator().manual_seed(seed)
    errors = {}
    for group_size, nbg in ((48, False), (24, True)):
        x = torch.randn(2, 5, 48, generator=g).requires_grad_()
        z_buf = torch.randn(2, 5, 60, generator=g)
        z = z_buf[..., 6:54].detach().requires_grad_()  # a slice, as z sits in zxbcdt
        w = (1 + 0.2 * torch.randn(48, generator=g)).requires_grad_()
        dout = torch.randn(2, 5, 48, generator=g)
        out = ops.rmsnorm_gated(x, w, z, eps=EPS, group_size=group_size, norm_before_gate=nbg, backend="triton")
        assert type(out.grad_fn).__name__ == "_RMSNormGatedBackward", out.grad_fn  # ours, not the reference
        out.backward(dout)
        leaves = [t.detach().double().requires_grad_() for t in (x, w, z)]
        ref = rmsnorm_gated_ref(*leaves, eps=EPS, group_size=group_size, norm_before_gate=nbg)
        ref.backward(dout.double())
        for name, a, b in (("out", out, ref), ("dx", x.grad, leaves[0].grad), ("dw", w.grad, leaves[1].grad),
                           ("dz", z.grad, leaves[2].grad)):  # fmt: skip
            errors[f"{name}_g{group_size}"] = ((a.double() - b.double()).norm() / b.double().norm()).item()
    bad = {k: e for k, e in errors.items() if not e <= 1e-5}
    assert not bad, f"over tolerance: {bad}"
    return errors


def check_blocks(seed=0) -> dict:
    """y as K column blocks [K, M, D / K] (context parallel's all-to-all output, rows strided inside each block):
    the forward's out and rstd and the backward's dy (in the blocks' layout), dz and dw equal the dense rows' bit for
    bit, for a group spanning the blocks and for groups inside them; ops.rmsnorm_gated_blocks (the autograd op) gives
    the dense op's values and gradients, y's back as blocks."""
    from models.kernels import ops
    from models.kernels.gated_rmsnorm_triton import gated_rmsnorm_bwd, gated_rmsnorm_fwd

    g = torch.Generator().manual_seed(seed)
    M, K, d = 6, 2, 24
    D = K * d
    sizes = {}
    for group_size, nbg in ((48, False), (16, True)):
        y, z, dout = (torch.randn(M, D, generator=g) for _ in range(3))
        w = 1 + 0.2 * torch.randn(D, generator=g)
        buf = torch.full((K, M, d + 4), float("nan"))
        blocks = buf[..., 2 : d + 2]
        blocks.copy_(y.view(M, K, d).permute(1, 0, 2))
        out_d, rstd_d = gated_rmsnorm_fwd(y, w, z, EPS, group_size, nbg)
        out_b, rstd_b = gated_rmsnorm_fwd(blocks, w, z, EPS, group_size, nbg)
        assert torch.equal(out_b, out_d) and torch.equal(rstd_b, rstd_d), "forward differs on blocks"
        dz_d, dz_b = torch.empty_like(z), torch.empty_like(z)
        dy_d, dw_d, _ = gated_rmsnorm_bwd(dout, y, w, z, rstd_d, EPS, group_size, nbg, dz_d, False)
        dy_b, dw_b, _ = gated_rmsnorm_bwd(dout, blocks, w, z, rstd_b, EPS, group_size, nbg, dz_b, False)
        assert dy_b.shape == (K, M, d), dy_b.shape
        assert torch.equal(dy_b.permute(1, 0, 2).reshape(M, D), dy_d), "dy differs on blocks"
        assert torch.equal(dz_b, dz_d) and torch.equal(dw_b, dw_d), "dz / dw differ on blocks"

        leaves_b = [t.clone().requires_grad_() for t in (blocks.contiguous(), w, z)]
        leaves_d = [t.clone().requires_grad_() for t in (y, w, z)]
        kw = dict(eps=EPS, group_size=group_size, norm_before_gate=nbg, backend="triton")
        out_b = ops.rmsnorm_gated_blocks(*leaves_b, **kw)
        out_d = ops.rmsnorm_gated(*leaves_d, **kw)
        assert type(out_b.grad_fn).__name__ == "_RMSNormGatedBackward", out_b.grad_fn
        out_b.backward(dout)
        out_d.backward(dout)
        assert torch.equal(out_b, out_d)
        assert torch.equal(leaves_b[0].grad.permute(1, 0, 2).reshape(M, D), leaves_d[0].grad)
        assert torch.equal(leaves_b[1].grad, leaves_d[1].grad) and torch.equal(leaves_b[2].grad, leaves_d[2].grad)
        sizes[f"g{group_size}"] = group_size
    return sizes


def child() -> None:
    """The child process: every case under the interpreter (tests/interpreter_child.py)."""
    checks = {name: (lambda args=args: check_case(*args)) for name, args in CASES.items()}
    checks["autograd_op"] = check_autograd_op
    checks["blocks"] = check_blocks
    run_checks(checks)


@pytest.fixture(scope="module")
def results():
    return child_results("tests.test_gated_rmsnorm_triton")


@pytest.mark.parametrize("case", list(CASES))
def test_gated_rmsnorm_against_float64_reference(results, case):
    r = results[case]
    assert r["ok"], r["out"]


def test_autograd_op_through_ops_rmsnorm_gated(results):
    r = results["autograd_op"]
    assert r["ok"], r["out"]


def test_column_blocks_equal_dense_rows(results):
    r = results["blocks"]
    assert r["ok"], r["out"]


def test_rejects_what_the_kernels_cannot_take():
    """Checks on the host, before any launch (no interpreter needed): a group that does not divide the width, a z
    without a contiguous last dim, a strided weight, rstd of the wrong size."""
    from models.kernels.gated_rmsnorm_triton import gated_rmsnorm_bwd, gated_rmsnorm_fwd

    y, w = torch.randn(4, 12), torch.ones(12)
    with pytest.raises(ValueError, match="group_size"):
        gated_rmsnorm_fwd(y, w, y, EPS, 5, False)
    with pytest.raises(ValueError, match="contiguous last dim"):
        gated_rmsnorm_fwd(y, w, torch.randn(12, 4).t(), EPS, 12, False)
    with pytest.raises(ValueError, match="weight"):
        gated_rmsnorm_fwd(y, torch.ones(24)[::2], y, EPS, 12, False)
    with pytest.raises(ValueError, match="rstd"):
        gated_rmsnorm_bwd(y, y, w, y, torch.ones(3), EPS, 12, False, torch.empty_like(y), True)
