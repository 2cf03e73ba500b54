"""optimizer.implementation "triton" (components/adamw_triton.py) on the CPU, through Triton's interpreter.

Against torch's fused AdamW (implementation "fused", the same ShardLocalAdamW and state) over five steps: two parameter
groups (weight decay and none), tensors that are not a multiple of the kernel's block (lowered to 64 in the child, so
tensors span several programs), fresh gradient tensors every step (the per-step address table), the trainer's
clipping divisor as grad_scale, a skipped step (found_inf 1: nothing may change, step counts included), a learning
rate that changes every step, and a load_state_dict in the middle (new state tensors: the tables must be rebuilt).
Parameters, both moments and the step counts within 1e-6. Triton reads TRITON_INTERPRET when first imported, so the
check runs in a child process with the variable set (tests/interpreter_child.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.interpreter_child import child_results, run_checks

pytest.importorskip("triton")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check(device: str = "cpu") -> None:
    """In the child (TRITON_INTERPRET=1), or on a GPU (tests/gpu/test_adamw_triton_gpu.py, the kernel's own block and
    a tensor of many blocks); raises AssertionError on a difference."""
    from components import adamw_triton
    from components.optimizer import build_optimizer
    from configs.job_config import Optimizer

    shapes = [(33, 5), (300,), (7, 9), (130,), (12,)]  # matrices decay, vectors do not (build_optimizer's groups)
    if device == "cpu":
        adamw_triton.BLOCK = 64
    else:
        shapes.append((1000, 777))

    def model() -> torch.nn.Module:
        torch.manual_seed(1)
        m = torch.nn.Module()
        m.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes])
        return m

    ref_model, our_model = model(), model()
    ref = build_optimizer([ref_model], Optimizer(lr=1e-2, weight_decay=0.1, implementation="fused"), device)
    ours = build_optimizer([our_model], Optimizer(lr=1e-2, weight_decay=0.1, implementation="triton"), device)
    assert ours._tables is not None and ref._tables is None

    def compare(tag: str) -> None:
        for p, q in zip(ref_model.parameters(), our_model.parameters()):
            assert _rel(q, p) <= 1e-6, (tag, "param", _rel(q, p))
            for key in ("exp_avg", "exp_avg_sq", "step"):
                a, b = ours.state[q][key], ref.state[p][key]
                assert _rel(a, b) <= 1e-6, (tag, key, _rel(a, b))

    scale = torch.tensor(2.5, device=device)
    for step in range(1, 6):
        grads = [torch.randn(s, device=device) for s in shapes]
        for opt, m in ((ref, ref_model), (ours, our_model)):
            for p, g in zip(m.parameters(), grads):
                p.grad = g.clone()  # a new tensor every step, as autograd's
            for group in opt.param_groups:
                group["lr"] = 1e-2 / step
            opt.grad_scale, opt.found_inf = scale, torch.tensor(1.0 if step == 2 else 0.0, device=device)
            opt.step()
        compare(f"step {step}")
        if step == 2:
            assert float(ours.state[next(iter(our_model.parameters()))]["step"]) == 1.0  # the skip counted nothing
        if step == 3:  # a checkpoint round trip: the state's tensors are replaced
            ours.load_state_dict(copy.deepcopy(ours.state_dict()))  # (a copy: load_state_dict keeps given tensors)
    assert not ours._tables.groups or all(t.grads.turn > 0 for t in ours._tables.groups.values())


def child() -> None:
    """The child process (TRITON_INTERPRET=1): check() on CPU tensors."""
    run_checks({"adamw": check})


def test_triton_adamw_equals_fused_adamw_in_the_interpreter():
    result = child_results("tests.test_adamw_triton")["adamw"]
    assert result["ok"], result["out"]


def test_triton_adamw_refused_without_cuda(monkeypatch):
    """On a CPU run (no interpreter) implementation 'triton' fails at build time, naming the fix."""
    from components.optimizer import build_optimizer
    from configs.job_config import Optimizer

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs the parameters on CUDA.*'auto' or 'fused'"):
        build_optimizer([torch.nn.Linear(2, 2)], Optimizer(implementation="triton"), "cpu")


def test_auto_keeps_torch_fused_for_parameters_off_the_gpu(monkeypatch):
    """A CUDA run whose parameters stay on the host (FSDP2's CPU offload): "auto" picks torch's fused AdamW, and
    "triton" is refused with its fix; so are parameters that are not float32."""
    from components.optimizer import build_optimizer
    from configs.job_config import Optimizer

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    opt = build_optimizer([torch.nn.Linear(2, 2)], Optimizer(), "cuda")
    assert opt._tables is None and opt.defaults["fused"]
    with pytest.raises(ValueError, match="FSDP's CPU offload"):
        build_optimizer([torch.nn.Linear(2, 2)], Optimizer(implementation="triton"), "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # past the device check: the dtype check, when built, before a step
    with pytest.raises(ValueError, match="float32 parameters only"):
        build_optimizer([torch.nn.Linear(2, 2).to(torch.bfloat16)], Optimizer(implementation="triton"), "cuda")
