"""GPU attention backends (flash-attn varlen, FlexAttention, SDPA) and grouped-GEMM experts vs the CPU paths."""

from __future__ import annotations

import copy

import pytest
import torch

from models.args import ModelArgs
from models.hybrid import Attention, MoE
from models.hybrid.attention import flash_varlen_available
from models.hybrid.moe import GroupedExperts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

D = 256
# Relative L2 error allowed against the float64 CPU reference (inputs/weights already rounded to the dtype).
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _seq_idx(lengths_per_row):
    rows = [torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(ls)]) for ls in lengths_per_row]
    return torch.stack(rows)


def _attn_pair(dtype, **kw):
    """(module on CUDA in dtype, float64 CPU copy with exactly the same (rounded) weights)."""
    torch.manual_seed(0)
    args = ModelArgs(d_model=D, n_heads=4, n_kv_heads=2, rope_theta=10000.0, **kw)
    m = Attention(args, 0, 4)
    g = torch.Generator().manual_seed(0)
    for name, p in m.named_parameters():
        m.init_param(name, p.data, g)
        p.data.mul_(3.0)  # larger logits than the 0.02 init so that the softmax is far from uniform
    m_gpu = copy.deepcopy(m).to("cuda", dtype)
    m_ref = m.to(dtype).double()
    return m_gpu, m_ref


# Several documents per row, lengths not multiples of any block size; one row a single document.
LENGTHS = [[37, 100, 3, 116], [256], [1, 128, 127]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash", "auto"])
def test_attention_backend_equals_cpu_reference(backend, dtype):
    if backend == "flash" and not flash_varlen_available():
        pytest.skip("flash-attn is not installed")
    if backend == "flash" and dtype == torch.float32:
        pytest.skip("flash-attn supports fp16 / bf16 only")
    m_gpu, m_ref = _attn_pair(dtype)
    m_gpu.backend = backend
    seq_idx = _seq_idx(LENGTHS)
    x = torch.randn(len(LENGTHS), 256, D).to(dtype)
    x_ref = x.double().requires_grad_()
    x_gpu = x.cuda().requires_grad_()
    grad_out = torch.randn(len(LENGTHS), 256, D).to(dtype)

    y_ref = m_ref(x_ref, seq_idx)
    y_ref.backward(grad_out.double())
    y = m_gpu(x_gpu, seq_idx.cuda())
    y.backward(grad_out.cuda())

    tol = TOL[dtype]
    assert _rel(y, y_ref) < tol, (backend, dtype, _rel(y, y_ref))
    assert _rel(x_gpu.grad, x_ref.grad) < tol, ("dx", _rel(x_gpu.grad, x_ref.grad))
    for name in ("wq", "wk", "wv", "wo"):
        g, g_ref = getattr(m_gpu, name).weight.grad, getattr(m_ref, name).weight.grad
        assert _rel(g, g_ref) < tol, (name, _rel(g, g_ref))


@pytest.mark.parametrize("backend", ["flex", "flash"])
def test_attention_backend_isolates_documents(backend):
    if backend == "flash" and not flash_varlen_available():
        pytest.skip("flash-attn is not installed")
    m_gpu, _ = _attn_pair(torch.bfloat16)
    m_gpu.backend = backend
    seq_idx = _seq_idx(LENGTHS).cuda()
    x = torch.randn(len(LENGTHS), 256, D, device="cuda", dtype=torch.bfloat16)
    x2 = x.clone()
    x2[0, :37] = torch.randn(37, D, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y, y2 = m_gpu(x, seq_idx), m_gpu(x2, seq_idx)
    assert torch.equal(y[0, 37:], y2[0, 37:]) or (y[0, 37:] - y2[0, 37:]).abs().max() < 1e-6
    assert torch.equal(y[1:], y2[1:])


def _experts_pair(E=6, dim=128, hidden=96):
    torch.manual_seed(1)
    ex = GroupedExperts(dim, hidden, E, 4)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ex_ref = copy.deepcopy(ex).double()
    ex_ref.backend = "loop"
    ex_gpu = ex.cuda()
    ex_gpu.backend = "grouped_mm"
    return ex_gpu, ex_ref


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm missing")
@pytest.mark.parametrize("counts", [[7, 0, 19, 1, 33, 4], [0, 0, 64, 0, 0, 0], [16, 16, 16, 16, 16, 16]])
def test_grouped_mm_experts_equal_loop(counts):
    ex_gpu, ex_ref = _experts_pair()
    counts_E = torch.tensor(counts)
    x = torch.randn(int(counts_E.sum()), 128).to(torch.bfloat16)
    gy = torch.randn(int(counts_E.sum()), 128).to(torch.bfloat16)
    x_ref = x.double().requires_grad_()
    x_gpu = x.cuda().requires_grad_()
    y_ref = ex_ref(x_ref, counts_E)
    y_ref.backward(gy.double())
    y = ex_gpu(x_gpu, counts_E.cuda())
    y.backward(gy.cuda())
    tol = TOL[torch.bfloat16]
    assert _rel(y, y_ref) < tol
    assert _rel(x_gpu.grad, x_ref.grad) < tol
    for name in ("w1", "w2", "w3"):
        g, g_ref = getattr(ex_gpu, name).grad, getattr(ex_ref, name).grad
        assert _rel(g, g_ref) < tol, (name, _rel(g, g_ref))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch._grouped_mm missing")
def test_moe_layer_grouped_mm_equals_loop_bf16():
    torch.manual_seed(2)
    args = ModelArgs(d_model=128, moe_num_experts=8, moe_top_k=2, moe_hidden_dim=64, moe_shared_experts=1)
    m = MoE(args, 0, 4).cuda().to(torch.bfloat16)
    x = torch.randn(2, 100, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        m.experts.backend = "grouped_mm"
        y = m(x)
        m.experts.backend = "loop"
        y_loop = m(x)
    assert _rel(y, y_loop) < TOL[torch.bfloat16]
