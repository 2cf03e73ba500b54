"""bench_optimizer.py --as_trained on the CPU under Triton's interpreter (the debug flavor): the setting it times is the
trainer's one-GPU step with bf16 gradients for the blocks' linear weights and the weights' bf16 copies written by the
step, and its byte count is the one its copy bound is scaled to. The GPU-only pieces are stood in for in the child:
CUDA-event timing (one call), the weight copies' CUDA check (copies of CPU weights), the capture query."""

from __future__ import annotations

import pytest
import torch

from tests.interpreter_child import child_results, run_checks

pytest.importorskip("triton")


def check_as_trained() -> dict:
    from benchmarks import bench_optimizer
    from components.gradient_dtype import linear_weights
    from models import build_model_args, build_model_on_meta
    from models.kernels import weight_copies

    bench_optimizer.time_step = lambda fn, iters: (fn(), dict(ms=1.0, host_ms=0.5))[1]
    torch.cuda.synchronize = lambda *a: None
    torch.cuda.is_current_stream_capturing = lambda: False
    weight_copies._wants_copy = lambda w, dtype: (
        dtype == weight_copies.copies_dtype() and type(w) is torch.nn.Parameter and w.dtype == torch.float32
    )
    real_generator = torch.Generator
    torch.Generator = lambda device=None: real_generator()  # the bench seeds a generator on the weights' device
    gen = real_generator().manual_seed(0)
    model = build_model_on_meta(build_model_args("debug"))
    model.to_empty(device="cpu")
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in params:
            p.normal_(0.0, 0.02, generator=gen)
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    before = [p.detach().clone() for p in params]
    rows = bench_optimizer.as_trained_rows(model, params, iters=1, copy_bound_ms=2.0, sumsq_blocks=[4096])

    bf16 = torch.bfloat16
    linear = {id(w) for w in linear_weights([model])}
    assert linear and all((p.grad.dtype == bf16) == (id(p) in linear) for p in params)
    matrices = [p for p in params if p.dim() == 2]
    copies = weight_copies.current_copies(params)
    for p, c in zip(params, copies):
        if p.dim() == 2:  # written by the step: the updated weight in bf16 (Triton's interpreter truncates, the GPU
            # rounds to nearest even: tests/test_adamw_triton.py)
            truncated = (p.detach().view(torch.int32) & -65536).view(torch.float32).to(bf16)
            assert c is not None and (torch.equal(c, p.detach().to(bf16)) or torch.equal(c, truncated))
        else:
            assert c is None
    assert all(not torch.equal(b, p) for b, p in zip(before, params))  # every parameter stepped
    n = sum(p.numel() for p in params)
    grad_bytes = sum(p.numel() * (2 if id(p) in linear else 4) for p in params)
    moved = 24 * n + grad_bytes + 2 * sum(p.numel() for p in matrices)
    names = ["grad_norm_as_trained", "grad_norm_as_trained_4096", "adamw_as_trained", "copy_bound_as_trained"]
    assert [r["row"] for r in rows] == names
    assert rows[0]["bytes"] == rows[1]["bytes"] == grad_bytes
    assert rows[2]["bytes"] == rows[3]["bytes"] == moved
    assert (rows[2]["ms"], rows[2]["host_ms"]) == (1.0, 0.5)
    assert rows[3]["ms"] == pytest.approx(2.0 * moved / (28 * n))
    return moved


def child():
    run_checks({"as_trained": check_as_trained})


def test_as_trained_steps_with_bf16_linear_gradients_and_writes_the_copies():
    result = child_results("tests.test_bench_optimizer")["as_trained"]
    assert result["ok"], result["out"]
