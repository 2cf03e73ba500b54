"""A tall weight gradient in row blocks (autocast_linear.WEIGHT_GRAD_ROW_BLOCK), the shape cuBLAS runs faster at the
1.3B's in_proj (benchmarks/bench_products.py): the unsplit product's values up to its summation order, alone and in
the model's backward (in_proj's weight through norm_linear)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from models import build_model_args  # noqa: E402
from models.init import init_weights  # noqa: E402
from models.kernels import autocast_linear, weight_copies  # noqa: E402
from models.mamba2.model import Mamba2LM  # noqa: E402

pytestmark = pytest.mark.gpu
_PLAIN_ROW_BLOCKS = autocast_linear._row_blocks


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_grad_in_row_blocks_equals_one_product(monkeypatch, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dy = torch.randn(4096, 1168, device="cuda", generator=gen).to(torch.bfloat16)
    x = torch.randn(4096, 256, device="cuda", generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(autocast_linear, "WEIGHT_GRAD_ROW_BLOCK", None)
    whole = autocast_linear.weight_grad(dy, x, dtype)
    monkeypatch.setattr(autocast_linear, "WEIGHT_GRAD_ROW_BLOCK", 512)
    blocks = autocast_linear.weight_grad(dy, x, dtype)
    assert blocks.dtype == dtype and blocks.shape == whole.shape
    # float32: each element one float32 sum of K = 4,096 terms, in cuBLAS's order for each shape (~sqrt(K) eps: 4e-6)
    assert _rel(blocks, whole) < (4e-3 if dtype == torch.bfloat16 else 2e-5)


def _model_grads(monkeypatch, blocks: bool):
    monkeypatch.setattr(autocast_linear, "WEIGHT_GRAD_ROW_BLOCK", 512 if blocks else None)
    taken = []

    def counting(rows):
        out = _PLAIN_ROW_BLOCKS(rows)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(autocast_linear, "_row_blocks", counting)
    args = build_model_args("debug", {"d_model": 256, "n_layers": 3, "d_state": 64, "headdim": 32, "chunk_size": 128,
                                      "recompute_in_proj_input": True})  # fmt: skip
    torch.manual_seed(0)
    model = Mamba2LM(args).cuda()
    init_weights(model, seed=0, init_std=0.02)
    ids = torch.randint(0, args.vocab_size, (2, 1024), generator=torch.Generator().manual_seed(1)).cuda()
    weight_copies.enable(torch.bfloat16)
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids)
        loss.backward()
    finally:
        weight_copies.enable(None)
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}, taken


def test_the_model_with_in_proj_weight_gradients_in_row_blocks_matches_the_plain_one(monkeypatch):
    loss0, grads0, taken0 = _model_grads(monkeypatch, blocks=False)
    loss1, grads1, taken1 = _model_grads(monkeypatch, blocks=True)
    assert any(taken1) and not any(taken0), (taken0, taken1)  # in_proj's 1,168 rows: blocks; out_proj's 256: none
    assert torch.equal(loss0, loss1)  # the forward is unchanged
    far = {n: _rel(g, grads0[n]) for n, g in grads1.items() if _rel(g, grads0[n]) > 1e-2}
    assert not far, far
