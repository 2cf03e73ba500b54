"""The gradient norm's table sum of squares (components/sumsq_triton.py) compiled on a GPU: the global norm of float32
CUDA gradients equals float64 torch's, with every size a multiple of 4 (16-byte loads) and with some not, a tensor
of many blocks among them, over calls with new gradient tensors."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton")


@pytest.mark.parametrize("shapes", [[(1000, 777), (64,), (2048, 4)], [(1000, 777), (63,), (7, 9)]])
def test_global_grad_norm_table_kernel_on_cuda(shapes):
    from components import sumsq_triton
    from parallelisms import grad_norm

    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in shapes]
    for call in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * (call + 1)
        grads = [p.grad for p in params]
        assert sumsq_triton.applies(grads)
        want = torch.cat([g.flatten() for g in grads]).double().norm().item()
        got = grad_norm.global_grad_norm(params).item()
        assert abs(got - want) / want < 1e-6, (call, got, want)
    assert grad_norm._table_sumsq is not None and grad_norm._table_sumsq.maps
