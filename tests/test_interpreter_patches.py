"""tests/interpreter_child.py's patches of Triton's interpreter, which every interpreter case runs under: the integer
overflow checks it builds and drops are skipped (patch_interpreter_overflow_checks), and int32 arithmetic past its
range still wraps as it does on the GPU, with the checks built or not; the dtype lookup it remembers
(patch_interpreter_dtype_lookup) gives what Triton's own gives, for every dtype and for blocks of them."""

from __future__ import annotations

import pytest

from tests.interpreter_child import child_results, run_checks

pytest.importorskip("triton")


def check_overflow_checks_skipped() -> dict:
    import dataclasses

    import numpy as np
    import torch
    import triton
    import triton.language as tl
    import triton.runtime.interpreter as interp

    @triton.jit
    def wrapping_kernel(X, OUT, scale, N: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(X + offs)
        tl.store(OUT + offs, x * scale + scale - x)  # int32 products and sums past 2^31

    builder = interp.interpreter_builder
    assert not builder.options.debug and not builder.options.sanitize_overflow, builder.options  # run_checks patched
    x = torch.tensor([3, 70_000, -70_000, 2**30, -(2**31), 0, 0, 0], dtype=torch.int32)
    scale = 65_537
    exact = x.numpy().astype(np.int64) * scale + scale - x.numpy()
    want = exact.astype(np.int32)  # two's complement wrap
    patched, outs = builder.options, {}
    try:
        for sanitize in (True, False):  # the checks built (Triton's default) and skipped (the patch)
            builder.options = dataclasses.replace(patched, sanitize_overflow=sanitize)
            out = torch.empty_like(x)
            wrapping_kernel[(1,)](x, out, scale, N=x.numel())
            outs[sanitize] = out.numpy()
    finally:
        builder.options = patched
    assert (outs[True] == want).all() and (outs[False] == want).all(), (outs, want)
    return {"wrapped": int((exact != want).sum())}


def check_dtype_lookup_remembered() -> int:
    import inspect

    import triton.language as tl
    import triton.runtime.interpreter as interp

    lookup = interp._get_np_dtype
    assert getattr(lookup, "remembers", False), lookup  # run_checks patched it
    original = inspect.getclosurevars(lookup).nonlocals["lookup"]
    dtypes = [v for v in vars(tl).values() if isinstance(v, tl.dtype) and not isinstance(v, tl.pointer_type)]
    dtypes = [d for d in dtypes if d.name not in ("void", "fp8e4b15x4")]
    types = dtypes + [tl.pointer_type(tl.float32)] + [tl.block_type(d, [4, 8]) for d in dtypes]
    for t in types + types:  # the second time from what it remembers
        assert lookup(t) == original(t), t
    return len(types)


def child() -> None:
    run_checks({"overflow_checks": check_overflow_checks_skipped, "dtype_lookup": check_dtype_lookup_remembered})


@pytest.fixture(scope="module")
def results():
    return child_results("tests.test_interpreter_patches")


def test_overflow_checks_skipped_and_int32_wraps_as_on_the_gpu(results):
    r = results["overflow_checks"]
    assert r["ok"], r["out"]
    assert r["out"] == {"wrapped": 4}, r["out"]  # four of the values do overflow


def test_dtype_lookup_remembered_gives_what_triton_gives(results):
    r = results["dtype_lookup"]
    assert r["ok"], r["out"]
    assert r["out"] > 20, r["out"]
