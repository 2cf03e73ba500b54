"""components/sumsq_triton.py (the global gradient norm's sum of squares on CUDA) on the CPU, through Triton's
interpreter: against float64 sums over tensors of several sizes (one of several blocks, one not a multiple of the
block, an empty one), with sizes that are all multiples of 4 (the kernel's 16-byte loads) and with some that are not,
new tensors at every call (the per-call address table) and a second pattern of sizes (its own block map); bf16 tensors
(training.grad_dtype's gradients) summed in float32 from their exact values."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter_child import child_results, run_checks

pytest.importorskip("triton")


def check() -> dict:
    from components import sumsq_triton

    sumsq = sumsq_triton.TableSumOfSquares(block=64, num_warps=1)
    gen = torch.Generator().manual_seed(0)
    cases = {
        "unaligned sizes": [(33,), (16, 5), (300,), (7, 9), (0,)],
        "multiples of 4": [(32,), (16, 5), (300,), (8, 9), (0,)],
    }
    seen = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, shapes in cases.items():
            for call in range(3):  # new tensors each call, as gradients are
                tensors = [(torch.randn(s, generator=gen) * (call + 1)).to(dtype) for s in shapes]
                want = sum((t.double() ** 2).sum().item() for t in tensors)  # of the bf16 values themselves
                got = sumsq(tensors)
                assert got.dtype == torch.float32 and got.dim() == 0, got
                rel = abs(got.item() - want) / want
                assert rel < 1e-6, (dtype, name, call, rel)
            block_map = sumsq.maps[(tuple(t.numel() for t in tensors), tensors[0].device, dtype)]
            seen[f"{name} {dtype}"] = block_map.sizes_aligned
    assert seen == {
        "unaligned sizes torch.float32": False,
        "multiples of 4 torch.float32": True,
        "unaligned sizes torch.bfloat16": False,
        "multiples of 4 torch.bfloat16": True,
    }, seen
    assert len(sumsq.maps) == 4  # one block map per pattern of sizes and dtype, kept across calls
    assert sumsq([torch.zeros(0)]).item() == 0.0
    with pytest.raises(ValueError, match="all float32 or all bf16"):
        sumsq([torch.randn(4, 4).t()])
    with pytest.raises(ValueError, match="all float32 or all bf16"):
        sumsq([torch.randn(4), torch.randn(4).bfloat16()])
    return seen


def child() -> None:
    run_checks({"sumsq": check})


def test_table_sum_of_squares_in_the_interpreter():
    r = child_results("tests.test_sumsq_triton")["sumsq"]
    assert r["ok"], r["out"]


def test_grad_norm_off_cuda_keeps_torch_norms():
    """On CPU gradients the global norm is torch's (the table kernel is for CUDA float32 gradients only)."""
    from components import sumsq_triton
    from parallelisms.grad_norm import global_grad_norm

    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(7))]
    for p in params:
        p.grad = torch.randn_like(p)
    want = torch.cat([p.grad.flatten() for p in params]).double().norm().item()
    assert abs(global_grad_norm(params).item() - want) / want < 1e-6
    assert not sumsq_triton.applies([p.grad for p in params])


def test_grad_norm_of_bf16_gradients_sums_in_float32():
    """training.grad_dtype bfloat16: gradients of two dtypes in one norm, each squared and summed in float32 from its
    exact value (torch's bf16 norm would round the norm itself to bf16: ~3 significant digits)."""
    from parallelisms.grad_norm import global_grad_norm

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 48)), torch.nn.Parameter(torch.randn(7))]
    params[0].grad_dtype = torch.bfloat16
    (params[0].sum() * 1.37 + (params[1] ** 2).sum()).backward()
    assert params[0].grad.dtype == torch.bfloat16 and params[1].grad.dtype == torch.float32
    want = torch.cat([p.grad.double().flatten() for p in params]).norm().item()
    got = global_grad_norm(params)
    assert got.dtype == torch.float32
    assert abs(got.item() - want) / want < 1e-6, (got.item(), want)
