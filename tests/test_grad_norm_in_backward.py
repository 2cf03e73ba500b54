"""components/grad_norm_in_backward.py on the CPU, its sums of squares under Triton's interpreter: a small stack of
linear layers (float32 and bf16 gradients, sizes of several blocks and not multiples of the block or of 4) trained
for steps with several launches in each backward, each of two programs that sum every other block. Its norm equals,
bit for bit, the one table launch over each dtype's gradients reduced as parallelisms.grad_norm does it, and
float64's within 1e-6; the first step, a step whose gradients change (a parameter without one, then with one again)
take global_grad_norm and learn the new layout; a backward it was not armed for leaves it untouched."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter_child import child_results, run_checks

pytest.importorskip("triton")

BLOCK = 64


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5)
    )
    model[2].weight.grad_dtype = torch.bfloat16  # a second dtype, as training.grad_dtype gives the linear weights
    return model


def _one_launch_norm(params, sumsq) -> torch.Tensor:
    """What global_grad_norm gives on CUDA (one table launch per dtype, the dtypes' sums stacked), on the CPU."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    sums = [sumsq(gs) for gs in by_dtype.values()]
    local = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
    return (torch.zeros((), dtype=torch.float32) + local).sqrt()


def check() -> dict:
    from components.grad_norm_in_backward import GradNormInBackward
    from components.sumsq_triton import TableSumOfSquares
    from parallelisms.grad_norm import global_grad_norm

    model = _model()
    params = list(model.parameters())
    norm = GradNormInBackward(params, torch.device("cpu"), bucket_bytes=600, side_programs=2, block=BLOCK,
                              num_warps=1)  # fmt: skip
    sumsq = TableSumOfSquares(block=BLOCK, num_warps=1)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for step in range(6):
        for p in params:
            p.grad = None
        if step == 3:  # the last layer's bias without a gradient: another layout
            model[4].bias.requires_grad_(False)
        if step == 4:
            model[4].bias.requires_grad_(True)
        x = torch.randn(7, 13, generator=gen) * (step + 1)
        before = norm.launches
        model(x).square().sum().backward()  # not armed: nothing launched
        assert norm.launches == before
        for p in params:
            p.grad = None
        norm.arm()
        model(x).square().sum().backward()
        got = norm.norm()
        want_bits = _one_launch_norm(params, sumsq)
        want = torch.cat([p.grad.double().flatten() for p in params if p.grad is not None]).norm().item()
        assert got.dtype == torch.float32 and got.dim() == 0
        assert abs(got.item() - want) / want < 1e-6, (step, got.item(), want)
        if norm.in_backward:  # taken in the backward: the one launch's bits
            assert torch.equal(got, want_bits), (step, got.item(), want_bits.item())
        else:  # the first step or a new layout: global_grad_norm's
            assert torch.equal(got, global_grad_norm(params)), step
        seen.append(norm.launches if norm.in_backward else 0)
        for p in params:  # the gradients are the backward's, untouched
            assert p.grad is None or p.grad.dtype == (torch.bfloat16 if p is model[2].weight else torch.float32)
    # no layout yet; a parameter without a gradient; one with a gradient again: global_grad_norm, then the new layout
    assert seen[0] == seen[3] == seen[4] == 0, seen
    assert seen[1] == seen[2] == seen[5] and seen[1] >= 3, seen  # several groups in each backward
    norm.remove()
    return {"launches": seen}


def child() -> None:
    run_checks({"in_backward": check})


def test_grad_norm_in_backward_in_the_interpreter():
    r = child_results("tests.test_grad_norm_in_backward")["in_backward"]
    assert r["ok"], r["out"]
