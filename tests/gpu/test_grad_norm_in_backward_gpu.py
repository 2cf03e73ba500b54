"""training.grad_norm_in_backward on one GPU (components/grad_norm_in_backward.py): the sums of squares taken on a
side stream during the backward give global_grad_norm's norm bit for bit, on a Mamba model with bf16 and float32
gradients (training.grad_dtype) over steps with new gradient tensors, in several launches per backward; through
train.py the losses and gradient norms of 6 steps equal those of the norm taken after the backward, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.launch import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
pytest.importorskip("triton")


def test_norm_in_backward_is_global_grad_norm_bit_for_bit():
    from components.grad_norm_in_backward import GradNormInBackward
    from components.gradient_dtype import set_linear_weight_grad_dtype
    from models import build_model_args
    from models.init import init_weights
    from models.mamba2.model import Mamba2LM
    from parallelisms.grad_norm import global_grad_norm

    args = build_model_args("debug", {"d_model": 256, "n_layers": 4, "d_state": 64, "headdim": 32, "chunk_size": 128})
    model = Mamba2LM(args).cuda()
    init_weights(model, seed=0, init_std=0.02)
    set_linear_weight_grad_dtype([model], "bfloat16")
    params = list(model.parameters())
    norm = GradNormInBackward(params, torch.device("cuda"), bucket_bytes=1 << 20)
    gen = torch.Generator().manual_seed(1)
    taken = []
    for step in range(4):
        ids = torch.randint(0, args.vocab_size, (2, 1024), generator=gen).cuda()
        for p in params:
            p.grad = None
        norm.arm()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, labels=ids)
        (loss * (step + 1)).backward()
        got = norm.norm()
        assert torch.equal(got, global_grad_norm(params)), (step, got.item(), global_grad_norm(params).item())
        taken.append((norm.in_backward, norm.launches))
    assert {p.grad.dtype for p in params} == {torch.float32, torch.bfloat16}
    assert not taken[0][0] and all(t[0] and t[1] >= 4 for t in taken[1:]), taken


ARGS = [
    "--job.config_file", "configs/debug.toml", "--training.steps", "6", "--training.seq_len", "512",
    "--training.mixed_precision_param", "bfloat16", "--training.grad_dtype", "bfloat16", "--training.max_norm", "0.1",
    "--training.deterministic", "true", "--metrics.log_freq", "1",
    "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false", "--validation.enable", "false",
]  # fmt: skip


def test_train_losses_and_norms_equal_the_norm_after_backward(tmp_path):
    cache = tmp_path / "triton"  # one autotuning cache: both runs use the same kernel configurations
    after = train([*ARGS, "--training.grad_norm_in_backward", "false"], tmp_path / "after", autotune_cache=cache)
    during = train([*ARGS, "--training.grad_norm_in_backward", "true"], tmp_path / "during", autotune_cache=cache)
    assert [r["step"] for r in during] == list(range(1, 7))
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in during] == [r[key] for r in after], key
    assert during[-1]["loss"] < during[0]["loss"]
