"""The block's add + RMSNorm and in_proj as one Function that recomputes the normed rows in the norm's backward
(models/kernels/norm_linear.py, model.recompute_in_proj_input) on the CPU, through Triton's interpreter: bit for bit
the unfused pair (add_rmsnorm_triton's Function, then autocast_linear's), outputs and every gradient, with no copy of
the normed rows kept. The block's choice of the path is tested without the interpreter.

As in test_add_rmsnorm_triton.py, the interpreter cases run in one child process (once per session).
"""

from __future__ import annotations

import pytest
import torch

from tests.interpreter_child import child_results, run_checks

pytest.importorskip("triton")


def _saved_shapes(fn):
    """fn()'s result and the (shape, dtype) of every tensor autograd saved for the backward while it ran."""
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def check_norm_linear(b, L, D, F, seed, x_dtype, residual, residual_in_fp32=False, row_scaled=False,
                      out_unused=False):  # fmt: skip
    """add_rmsnorm_linear_triton against _AddRMSNorm (normed rows in bf16, as under autocast) followed by
    _AutocastLinear (bf16 product, float32 weight gradient): in_proj's output, the new residual, and the gradients of
    x, the residual, the norm weight and the linear weight, all bit for bit; the fused Function keeps no [rows, D]
    bf16 tensor (the normed rows) for its backward, the unfused pair does. residual: None or "float32"."""
    from models.kernels.add_rmsnorm_triton import _AddRMSNorm
    from models.kernels.autocast_linear import _AutocastLinear
    from models.kernels.norm_linear import add_rmsnorm_linear_triton
    from models.kernels.row_scale import RowScaled

    g = torch.Generator().manual_seed(seed)
    dt, bf16 = getattr(torch, x_dtype), torch.bfloat16
    tensors = dict(
        x=torch.randn(b, L, D, generator=g).to(dt),
        res=None if residual is None else torch.randn(b, L, D, generator=g) * 2,
        nw=1 + 0.2 * torch.randn(D, generator=g),
        lw=torch.randn(F, D, generator=g) * D**-0.5,
    )
    parts = torch.rand(b * L, 3, generator=g) * D if row_scaled else None
    c_out, c_s = torch.randn(b, L, F, generator=g), torch.randn(b, L, D, generator=g)
    out = {}
    for name in ("unfused", "fused"):
        leaves = {k: None if v is None else v.clone().requires_grad_() for k, v in tensors.items()}
        x_in = RowScaled(leaves["x"], parts, D, 1e-5) if row_scaled else leaves["x"]

        def run(leaves=leaves, x_in=x_in, name=name):
            if name == "fused":
                return add_rmsnorm_linear_triton(x_in, leaves["res"], leaves["nw"], 1e-5, residual_in_fp32,
                                                 leaves["lw"], bf16)  # fmt: skip
            x_ss = parts if row_scaled else None
            normed, s = _AddRMSNorm.apply(leaves["x"], leaves["res"], leaves["nw"], 1e-5, residual_in_fp32, bf16,
                                          x_ss, D if row_scaled else 1, 1e-5 if row_scaled else 0.0)  # fmt: skip
            return _AutocastLinear.apply(normed, leaves["lw"], bf16), s

        (y, s), saved = _saved_shapes(run)
        loss = (s.float() * c_s).sum() + (0 if out_unused else (y.float() * c_out).sum())
        loss.backward()
        out[name] = dict(y=y, s=s, **{"d" + k: v.grad for k, v in leaves.items() if v is not None})
        out[name, "normed kept"] = ((b * L, D), bf16) in saved or ((b, L, D), bf16) in saved
    assert out["unfused", "normed kept"] and not out["fused", "normed kept"]
    for k, v in out["unfused"].items():
        got = out["fused"][k]
        if v is None or got is None:
            assert v is None and got is None, k
            continue
        assert got.dtype == v.dtype and torch.equal(got, v), (k, (got.float() - v.float()).abs().max().item())
    return sorted(out["unfused"])


# The first block (float32 x, no residual, the new residual in float32), a later block (bf16 x, float32 residual),
# the fused gate's RowScaled output as x, in_proj's output unused (only the residual's gradient flows); widths that
# are not powers of two and more rows than the backward's programs
CASES = {
    "first_block": dict(b=2, L=37, D=48, F=40, seed=1, x_dtype="float32", residual=None, residual_in_fp32=True),
    "later_block": dict(b=2, L=37, D=48, F=72, seed=2, x_dtype="bfloat16", residual="float32"),
    "row_scaled_input": dict(b=1, L=30, D=64, F=40, seed=3, x_dtype="bfloat16", residual="float32", row_scaled=True),
    "output_unused": dict(b=1, L=20, D=64, F=24, seed=4, x_dtype="bfloat16", residual="float32", out_unused=True),
}


def child():
    run_checks({name: (lambda kw=kw: check_norm_linear(**kw)) for name, kw in CASES.items()})


@pytest.fixture(scope="module")
def results():
    return child_results("tests.test_norm_linear")


@pytest.mark.parametrize("case", list(CASES))
def test_norm_linear_equals_the_unfused_pair(results, case):
    r = results[case]
    assert r["ok"], r["out"]


def test_blocks_take_the_fused_path_where_it_applies(monkeypatch):
    """model.recompute_in_proj_input: a Mamba block calls ops.add_rmsnorm_linear (then the mixer from in_proj's
    output) exactly where ops.add_rmsnorm_linear_applies says so; off, or in attention / MLP blocks, it never asks."""
    from models import build_model_args
    from models.kernels import ops
    from models.mamba2.block import Block

    calls = []

    def fake_fused(hidden, residual, norm_w, eps, res_fp32, lin_w):
        calls.append(lin_w.shape)
        return torch.zeros(*hidden.shape[:-1], lin_w.shape[0]), hidden.float() + (0 if residual is None else residual)

    monkeypatch.setattr(ops, "add_rmsnorm_linear", fake_fused)
    hidden = torch.randn(1, 8, 128)
    for on, applies, letter, expected in (
        (True, True, "M", 1),
        (True, False, "M", 0),
        (False, True, "M", 0),
        (True, True, "-", 0),
    ):
        asked = []
        monkeypatch.setattr(
            ops, "add_rmsnorm_linear_applies", lambda *a, applies=applies, **k: asked.append(a) or applies
        )
        calls.clear()
        block = Block(build_model_args("debug", {"recompute_in_proj_input": on}), 0, letter)
        seen = []
        if letter == "M":
            monkeypatch.setattr(block.mixer, "forward_from_in_proj", lambda z, seq_idx=None: seen.append(z.shape) or z)
        block(hidden, None)
        assert len(calls) == expected, (on, applies, letter)
        if asked:  # the mixer's in_proj weight and bias (a bias rules the path out), the residual's dtype setting
            assert asked[0][2] is block.mixer.in_proj.weight and asked[0][3] is block.mixer.in_proj.bias
            assert asked[0][4] is True
        if expected:
            assert calls == [block.mixer.in_proj.weight.shape] and seen == [(1, 8, block.mixer.in_proj.out_features)]


def test_where_the_fused_path_applies(monkeypatch):
    """add_rmsnorm_linear_applies, given our kernels and autocast's float32-gradient path (both stood in for, as on a
    GPU under autocast): no for a linear bias (norm_linear.py has none) or a residual stream that is not float32 (the
    rewritten rows would differ from the forward's), yes otherwise; on the CPU as it is, never."""
    from models.kernels import ops

    x16, w = torch.randn(2, 4, 8).bfloat16(), torch.nn.Parameter(torch.randn(6, 8))
    res32, res16 = torch.randn(2, 4, 8), torch.randn(2, 4, 8).bfloat16()
    assert not ops.add_rmsnorm_linear_applies(x16, res32, w, None, True)  # the CPU: never
    monkeypatch.setattr(ops, "use_triton_ssd", lambda backend, t: True)
    monkeypatch.setattr(ops, "float32_weight_grad_applies", lambda x, weight, bias: True)
    assert ops.add_rmsnorm_linear_applies(x16, res32, w, None, False)
    assert ops.add_rmsnorm_linear_applies(x16, None, w, None, True)  # the first block: a float32 new residual
    assert not ops.add_rmsnorm_linear_applies(x16, res32, w, torch.zeros(6), True)
    assert not ops.add_rmsnorm_linear_applies(x16, res16, w, None, True)
    assert not ops.add_rmsnorm_linear_applies(x16, None, w, None, False)  # a bf16 new residual
