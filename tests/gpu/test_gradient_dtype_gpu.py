"""training.grad_dtype bfloat16 on the GPU (components/gradient_dtype.py): under bf16 autocast with float32 weights,
packed documents and the 1.3B config's memory options, the products write the linear weights' gradients in bf16 —
each the float32 gradient's bf16 rounding up to cuBLAS's order of summation — and leave the loss and every other
gradient bit for bit as they were; the gradient norm and our AdamW take them (their table kernels' bf16 launches)."""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from components.gradient_dtype import set_linear_weight_grad_dtype  # noqa: E402
from components.optimizer import build_optimizer  # noqa: E402
from configs.job_config import Optimizer  # noqa: E402
from models import build_model_args  # noqa: E402
from models.init import init_weights  # noqa: E402
from models.mamba2.model import Mamba2LM  # noqa: E402
from parallelisms.grad_norm import global_grad_norm  # noqa: E402

pytestmark = pytest.mark.gpu
B, L = 2, 1024


def _model(grad_dtype: str) -> Mamba2LM:
    args = build_model_args("debug", {"d_model": 256, "n_layers": 4, "d_state": 64, "headdim": 32, "chunk_size": 128,
                                      "recompute_in_proj_input": True, "fuse_gate_into_scan": True,
                                      "ssd_keep_states": True, "ssd_keep_conv_layers": 2})  # fmt: skip
    model = Mamba2LM(args).cuda()
    init_weights(model, seed=0, init_std=0.02)
    set_linear_weight_grad_dtype([model], grad_dtype)
    return model


def _loss(model: Mamba2LM) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.args.vocab_size, (B, L), generator=gen).cuda()
    seq = torch.zeros(B, L, dtype=torch.int32)
    seq[:, L // 3 :] += 1
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids, seq_idx=seq.cuda(), labels=ids)
    loss.backward()
    return loss.detach()


def test_bf16_linear_weight_gradients_are_the_float32_ones_rounded():
    ref, ours = _model("float32"), _model("bfloat16")
    assert torch.equal(_loss(ref), _loss(ours))
    linear = {n for n, p in ours.named_parameters() if p.grad_dtype == torch.bfloat16}
    assert len(linear) == 2 * ours.args.n_layers
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        if name not in linear:
            assert q.grad.dtype == torch.float32 and torch.equal(q.grad, p.grad), name
            continue
        assert q.grad.dtype == torch.bfloat16, name
        g32 = p.grad
        exact = (q.grad == g32.to(torch.bfloat16)).float().mean().item()
        rel = ((q.grad.float() - g32).abs() / g32.abs().clamp_min(1e-30)).max().item()
        assert exact >= 0.95 and rel <= 2**-7, (name, exact, rel)  # within one bf16 unit of the float32 gradient
    # the norm over both dtypes, in float32 from the values themselves
    want = torch.cat([q.grad.double().flatten() for q in ours.parameters()]).norm().item()
    assert abs(global_grad_norm(list(ours.parameters())).item() - want) / want < 1e-6
    # our AdamW (triton tables, a bf16 launch) against torch's fused AdamW on float32 copies of the same values
    for p, q in zip(ref.parameters(), ours.parameters()):
        p.grad = q.grad.float()
    opts = [
        build_optimizer([m], Optimizer(lr=1e-3, implementation=impl), "cuda")
        for m, impl in ((ref, "fused"), (ours, "triton"))
    ]
    for opt in opts:
        opt.grad_scale, opt.found_inf = torch.tensor(1.3, device="cuda"), torch.tensor(0.0, device="cuda")
        opt.step()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        rel = ((p - q).double().norm() / p.double().norm()).item()
        assert rel < 1e-6, (name, rel)
