"""The dense products in the shapes cuBLAS runs faster (benchmarks/bench_products.py): a tall weight gradient in row
blocks (autocast_linear.WEIGHT_GRAD_ROW_BLOCK) and in_proj's input gradient over a reduction zero-padded to a
multiple of weight_copies.ROW_PAD (the mixer's backward writes dzxbcdt's rows padded, the weight's bf16 copy is kept
padded). Each gives the unsplit product's values up to its summation order, and the padded path is the one taken."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from models import build_model_args  # noqa: E402
from models.init import init_weights  # noqa: E402
from models.kernels import autocast_linear, norm_linear, weight_copies  # noqa: E402
from models.mamba2.model import Mamba2LM  # noqa: E402

pytestmark = pytest.mark.gpu


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


def test_input_grad_runs_over_the_padded_reduction_only_where_both_sides_are_padded():
    """A weight's kept copy has zero rows up to ROW_PAD; dy marked zero-padded is read through its padding: NaN put
    there shows the padded product ran (NaN x 0), zeros give the plain product's values."""
    weight_copies.enable(torch.bfloat16)
    try:
        w = torch.nn.Parameter(torch.randn(1168, 256, device="cuda") * 0.02)
        w16 = weight_copies.compute_weight(w, torch.bfloat16)
        padded = weight_copies.zero_padded_rows(w16)
        assert padded is not None and padded.shape == (1280, 256)
        assert torch.equal(padded[:1168], w.detach().to(torch.bfloat16)) and not padded[1168:].any()
        assert weight_copies.zero_padded_rows(w.detach().to(torch.bfloat16)) is None  # a cast: not padded
        buf = torch.randn(512, 1280, device="cuda").to(torch.bfloat16)
        dy = buf[:, :1168]
        buf[:, 1168:] = float("nan")
        assert autocast_linear.input_grad(dy, w16, None).isfinite().all()  # not marked: the plain product
        assert autocast_linear.input_grad(dy, w16, 1280).isnan().all()  # marked: the padded product read it
        buf[:, 1168:] = 0
        plain = dy @ w16
        assert _rel(autocast_linear.input_grad(dy, w16, 1280), plain) < 4e-3
    finally:
        weight_copies.enable(None)


def _model_grads(monkeypatch, padded: bool):
    monkeypatch.setattr(weight_copies, "ROW_PAD", 128 if padded else None)
    monkeypatch.setattr(autocast_linear, "WEIGHT_GRAD_ROW_BLOCK", 512 if padded else None)
    taken = []
    plain_input_grad = autocast_linear.input_grad

    def counting(dy, w, width):
        taken.append(width is not None and weight_copies.zero_padded_rows(w) is not None)
        return plain_input_grad(dy, w, width)

    monkeypatch.setattr(norm_linear, "input_grad", counting)
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


def test_the_model_with_padded_in_proj_gradients_matches_the_plain_one(monkeypatch):
    loss0, grads0, taken0 = _model_grads(monkeypatch, padded=False)
    loss1, grads1, taken1 = _model_grads(monkeypatch, padded=True)
    assert taken1 and all(taken1) and not any(taken0), (taken0, taken1)
    assert torch.equal(loss0, loss1)  # the forward is unchanged
    far = {n: _rel(g, grads0[n]) for n, g in grads1.items() if _rel(g, grads0[n]) > 1e-2}
    assert not far, far
