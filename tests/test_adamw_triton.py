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
    a tensor of many blocks); raises AssertionError on a difference. Once with sizes that are not all multiples of 4
    (the kernel's scalar loads), once with sizes that are (its ALIGNED vector loads)."""
    # matrices decay, vectors do not (build_optimizer's groups)
    check_shapes([(33, 5), (300,), (7, 9), (130,), (12,)], device, aligned=False)
    check_shapes([(32, 8), (300,), (8, 12), (132,), (12,)], device, aligned=True)
    # training.grad_dtype bfloat16: two matrices' gradients in bf16 (a launch of their own, read as float32), against
    # torch's fused AdamW on the same values upcast (ShardLocalAdamW's torch path)
    check_shapes([(33, 5), (300,), (7, 9), (130,), (12,), (3, 11)], device, aligned=False, bf16_matrices=True)
    check_shapes([(32, 8), (300,), (8, 12), (132,), (12,), (4, 12)], device, aligned=True, bf16_matrices=True)


def check_shapes(shapes, device: str, aligned: bool, bf16_matrices: bool = False) -> None:
    from components import adamw_triton
    from components.optimizer import build_optimizer
    from configs.job_config import Optimizer

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
        if bf16_matrices:
            # two of the decayed group's three matrices: its launches then mix dtypes, and address two bf16 tensors
            grads = [g.bfloat16() if i in (0, 2) else g for i, g in enumerate(grads)]
        for opt, m in ((ref, ref_model), (ours, our_model)):
            for p, g in zip(m.parameters(), grads):
                p.grad_dtype = g.dtype  # training.grad_dtype's (components/gradient_dtype.py)
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
    n_launches = 3 if bf16_matrices else 2  # the decayed group's two dtypes, or one dtype per group
    assert [t.aligned for t in ours._tables.groups.values()] == [aligned] * n_launches, "meant for the other path"
    if bf16_matrices:
        assert sorted(str(dtype) for _, dtype in ours._tables.groups) == [
            "torch.bfloat16", "torch.float32", "torch.float32"
        ]  # fmt: skip


def check_weight_copies(device: str = "cpu") -> None:
    """optimizer.weight_copies: the same launch writes each weight's current bf16 copy as the updated weight rounded
    to nearest even (bit for bit torch's cast on the GPU), writes nothing on a skipped step, and leaves a copy alone
    once the weight changed under it (a torch op bumped its version): the next use remakes it, at the same address."""
    from components import adamw_triton
    from components.optimizer import build_optimizer
    from configs.job_config import Optimizer
    from models.kernels import weight_copies

    bf16 = torch.bfloat16
    if device == "cpu":
        adamw_triton.BLOCK = 64
    torch.manual_seed(2)
    m = torch.nn.Module()
    m.ps = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(s, device=device)) for s in [(33, 5), (300,), (7, 9)]]
    )
    params = list(m.parameters())
    opt = build_optimizer([m], Optimizer(lr=1e-2, weight_decay=0.1, implementation="triton"), device, bf16)
    assert opt._tables.copies_dtype == bf16 and weight_copies.copies_dtype() == bf16
    off = build_optimizer([m], Optimizer(implementation="triton", weight_copies=False), device, bf16)
    assert off._tables.copies_dtype is None

    def make_copy(p):  # what a product's compute_weight does on CUDA (the CPU keeps no copies of its own)
        if device == "cuda":
            return weight_copies.copy_of(p, bf16)
        weight_copies._COPIES[p] = (p.detach().to(bf16), p._version)
        return weight_copies._COPIES[p][0]

    def bits(t):
        return t.view(torch.int16).clone()

    def is_cast_of(c, p):  # bit for bit on the GPU; Triton's interpreter truncates to bf16 (one unit in the last place)
        d = (bits(c).int() - bits(p.detach().to(bf16)).int()).abs().max().item()
        return d == 0 if device == "cuda" else d <= 1

    try:
        copies = [make_copy(p) for p in params[:2]]  # the third weight has none
        assert weight_copies.current_copies(params)[:2] == copies and weight_copies.current_copies(params)[2] is None

        def step(skip: bool) -> None:
            for p in params:
                p.grad = torch.randn_like(p)
            opt.found_inf = torch.tensor(1.0 if skip else 0.0, device=device)
            opt.step()

        before = [p.detach().clone() for p in params]
        step(skip=False)
        for p, c, b in zip(params, copies, before):
            assert not torch.equal(p, b), "the step did not update the weight"
            assert is_cast_of(c, p), "the copy is not the updated weight's bf16 cast"
        kept = [bits(c) for c in copies]
        step(skip=True)  # a non-finite step: no weight, moment or copy changes
        assert all(torch.equal(bits(c), k) for c, k in zip(copies, kept))
        with torch.no_grad():
            params[0].add_(1.0)  # changed by a torch op: its copy is stale from now on
        stale = bits(copies[0])
        step(skip=False)
        assert weight_copies.current_copies(params)[0] is None
        assert torch.equal(bits(copies[0]), stale), "a stale copy was written"
        assert is_cast_of(copies[1], params[1])
        if device == "cuda":  # the next use remakes it in place: the tables keep its address
            remade = weight_copies.compute_weight(params[0], bf16)
            assert remade is copies[0] and is_cast_of(remade, params[0])
    finally:
        weight_copies.enable(None)


def child() -> None:
    """The child process (TRITON_INTERPRET=1): check() and check_weight_copies() on CPU tensors."""
    run_checks({"adamw": check, "weight_copies": check_weight_copies})


@pytest.fixture(scope="module")
def interpreted():
    return child_results("tests.test_adamw_triton")


def test_triton_adamw_equals_fused_adamw_in_the_interpreter(interpreted):
    assert interpreted["adamw"]["ok"], interpreted["adamw"]["out"]


def test_triton_adamw_writes_current_weight_copies_in_the_interpreter(interpreted):
    assert interpreted["weight_copies"]["ok"], interpreted["weight_copies"]["out"]


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
