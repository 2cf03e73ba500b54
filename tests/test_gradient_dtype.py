"""training.grad_dtype bfloat16 (components/gradient_dtype.py) on the CPU: which weights get bf16 gradients, that each
is the float32 gradient rounded to bf16 once (torch autocast's value) while every other gradient is unchanged, that an
AdamW step on them equals one on those rounded values in float32, and the trainer end to end."""

from __future__ import annotations

import torch

from components.gradient_dtype import linear_weights, set_linear_weight_grad_dtype
from components.optimizer import build_optimizer
from configs.job_config import Optimizer
from models import build_model_args
from models.init import init_weights
from models.mamba2.model import Mamba2LM
from tests.parity import PARITY_ARGS, assert_same_losses, losses_by_step, run_training


def _model(args) -> Mamba2LM:
    model = Mamba2LM(args)
    init_weights(model, seed=3)
    return model


def _backward(model: Mamba2LM, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()


def test_linear_weights_get_bf16_gradients_rounded_once_and_adamw_steps_on_their_values():
    args = build_model_args("debug", {"tie_embeddings": False})
    ref, ours = _model(args), _model(args)
    assert set_linear_weight_grad_dtype([ours], "float32") == 0
    n = set_linear_weight_grad_dtype([ours], "bfloat16")
    names = sorted(name for name, p in ours.named_parameters() if p.grad_dtype == torch.bfloat16)
    want = sorted(f"layers.{i}.mixer.{lin}.weight" for i in ours.layers for lin in ("in_proj", "out_proj"))
    assert names == want and n == len(want), names  # not lm_head, norms, conv, A_log, D, dt_bias, embedding
    assert len(linear_weights([ours])) == n

    tokens = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    _backward(ref, tokens)
    _backward(ours, tokens)
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        if name in want:
            assert q.grad.dtype == torch.bfloat16, name
            assert torch.equal(q.grad, p.grad.to(torch.bfloat16)), name  # rounded once, to nearest even
            p.grad = q.grad.float()  # the reference steps on the same values, in float32
        else:
            assert q.grad.dtype == torch.float32 and torch.equal(q.grad, p.grad), name

    # torch's fused AdamW (ShardLocalAdamW upcasts the bf16 gradients for it; the triton tables read them as they
    # are: tests/test_adamw_triton.py), clipping divisor as the trainer passes it
    opts = [build_optimizer([m], Optimizer(lr=1e-2, implementation="fused"), "cpu") for m in (ref, ours)]
    for opt in opts:
        opt.grad_scale, opt.found_inf = torch.tensor(1.7), torch.tensor(0.0)
        opt.step()
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert torch.equal(p, q), name


def test_trainer_with_bf16_gradients_and_a_resume(tmp_path):
    """One microbatch per step (the option's condition): the first step's loss is the float32 run's (no update has
    happened), the later ones close to it; a run stopped after step 2 and resumed from its checkpoint (DCP's
    optimizer-state load gives the weights float32 gradients before the trainer sets their dtype) reproduces the
    uninterrupted run's losses. A constant LR after warm-up, so that a 2-step run's LRs are the 3-step run's first
    two."""
    args = PARITY_ARGS + ["--training.local_batch_size", "8", "--training.steps", "3", "--lr_scheduler.decay_ratio",
                          "0.0", "--checkpoint.enable", "true", "--checkpoint.interval", "1"]  # fmt: skip
    bf16 = [*args, "--training.grad_dtype", "bfloat16"]
    ref_l = losses_by_step(run_training(1, args, tmp_path / "f32"))
    straight = run_training(1, bf16, tmp_path / "bf16")
    got_l = losses_by_step(straight)
    assert sorted(got_l) == [1, 2, 3]
    assert abs(got_l[1] - ref_l[1]) <= 1e-6 * abs(ref_l[1])
    for step in (2, 3):
        assert abs(got_l[step] - ref_l[step]) <= 1e-3 * abs(ref_l[step]), (step, got_l[step], ref_l[step])
    # Adam's first update is sign(g) (m / sqrt(v) = g / |g|), so step 2 cannot tell the dtypes apart; step 3 can
    assert got_l[3] != ref_l[3], "the bf16 gradients changed nothing"
    run_training(1, [*bf16, "--training.steps", "2"], tmp_path / "resumed")
    assert_same_losses(straight, run_training(1, bf16, tmp_path / "resumed"))
