"""Recurrent decoding on CUDA.

1. mamba_ssm's selective_state_update and causal_conv1d's causal_conv1d_update against the step references
   (models/kernels/step_reference.py) over several steps, fp32 and bf16: the reference runs in float64 on the
   same (already rounded) inputs, so the error measured is the kernel's own.
2. The model's decode steps (step kernels) against its parallel forward (the fused training kernels: ours under
   backend "auto", mamba_ssm's under "mamba_ssm"), for the Mamba and the hybrid debug models, and a left-padded
   batch against single prompts.

Errors are relative: ||got - want|| / ||want|| for the ops, max |got - want| / max |want| for logits.
Skipped without CUDA or without the step kernels.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from generation import left_pad  # noqa: E402
from models.kernels import cuda as kcuda  # noqa: E402
from models.kernels import step_ops  # noqa: E402
from models.kernels.step_reference import causal_conv1d_update_ref, selective_state_update_ref  # noqa: E402
from tests.test_decode import perturbed_model, prefill_then_decode, tokens  # noqa: E402

if not kcuda.cuda_kernels_available():  # the step kernels come with the others (one loader)
    pytest.skip(f"step kernels unavailable: {kcuda.cuda_kernels_import_error()}", allow_module_level=True)

pytestmark = pytest.mark.gpu
DEV = "cuda"
# Ops: (output, fp32 state) tolerances. Both compute in fp32; bf16 outputs are rounded to bf16 (2^-8).
OP_TOL = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (1e-2, 1e-5)}
# Logits, step vs parallel: different kernels (chunked SSD with tf32 dots vs the recurrence), then 4-6 layers.
LOGIT_TOL = {torch.float32: 5e-3, torch.bfloat16: 5e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ngroups", [1, 2])
@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), (0.01, 0.5)])
@pytest.mark.parametrize("with_z", [False, True])
def test_selective_state_update_kernel_matches_reference(dtype, ngroups, dt_limit, with_z):
    b, H, P, N, steps = 3, 8, 64, 128, 5
    g = torch.Generator(device=DEV).manual_seed(0)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, device=DEV, dtype=dt)

    A_HPN = (-torch.rand(H, generator=g, device=DEV) - 0.5)[:, None, None].expand(H, P, N)
    D_HP, dt_bias_HP = randn(H)[:, None].expand(H, P), randn(H)[:, None].expand(H, P)
    state_k = randn(b, H, P, N, dt=torch.float32)
    state_r = state_k.double()
    for step in range(steps):
        x, z = randn(b, H, P), randn(b, H, P) if with_z else None
        dt_BHP = randn(b, H)[:, :, None].expand(b, H, P)
        B, C = randn(b, ngroups, N), randn(b, ngroups, N)
        y_k = step_ops.selective_state_update(
            state_k, x, dt_BHP, A_HPN, B, C, D_HP, z, dt_bias_HP, dt_softplus=True, dt_limit=dt_limit, backend="cuda"
        )
        y_r = selective_state_update_ref(
            state_r,
            *(t.double() if t is not None else None for t in (x, dt_BHP, A_HPN, B, C, D_HP, z, dt_bias_HP)),
            dt_softplus=True,
            dt_limit=dt_limit,
        )
        assert y_k.dtype == dtype
        out_tol, state_tol = OP_TOL[dtype]
        assert rel_err(y_k, y_r) < out_tol, f"step {step}: y error {rel_err(y_k, y_r):.2e}"
        assert rel_err(state_k, state_r) < state_tol, f"step {step}: state error {rel_err(state_k, state_r):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_conv1d_update_kernel_matches_reference(dtype):
    b, d, W, steps = 3, 264, 4, 6  # the model's conv state: width inputs, oldest first
    g = torch.Generator(device=DEV).manual_seed(0)
    weight = torch.randn(d, W, generator=g, device=DEV, dtype=dtype)
    bias = torch.randn(d, generator=g, device=DEV, dtype=dtype)
    state_k = torch.randn(b, d, W, generator=g, device=DEV, dtype=dtype)
    state_r = state_k.double()
    for step in range(steps):
        x = torch.randn(b, d, generator=g, device=DEV, dtype=dtype)
        out_k = step_ops.causal_conv1d_update(x, state_k, weight, bias, "silu", backend="cuda")
        out_r = causal_conv1d_update_ref(x.double(), state_r, weight.double(), bias.double(), "silu")
        assert rel_err(out_k, out_r) < OP_TOL[dtype][0], f"step {step}: error {rel_err(out_k, out_r):.2e}"
        assert torch.equal(state_k.double(), state_r), f"step {step}: the shifted state differs"


def cuda_model(flavor: str, dtype: torch.dtype, backend: str = "auto"):
    """backend "auto": our Triton SSD for the parallel forward and the prefill (final states), mamba_ssm's step
    kernels; "mamba_ssm": mamba_ssm's kernels for both, or an error."""
    model = copy.deepcopy(perturbed_model(flavor)).to(device=DEV, dtype=dtype)
    model.set_kernel_backend(backend)
    return model


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flavor", ["debug", "hybrid_moe_debug"])
@pytest.mark.parametrize("k", [70, 2])  # crosses two chunk boundaries; shorter than d_conv - 1
@pytest.mark.parametrize("backend", ["auto", "mamba_ssm"])
def test_decode_steps_match_the_parallel_forward_on_cuda(flavor, dtype, k, backend):
    model = cuda_model(flavor, dtype, backend)
    ids_BS = tokens(2, k + 8, seed=k).to(DEV)
    with torch.no_grad():
        want_BSV = model(ids_BS)
    got = prefill_then_decode(model, ids_BS, k)
    for i in range(got.shape[1]):
        err = max_rel(got[:, i], want_BSV[:, k - 1 + i])
        assert err < LOGIT_TOL[dtype], f"{flavor} {dtype}, prefill {k}, column {k - 1 + i}: error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("flavor", ["debug", "hybrid_moe_debug"])
def test_left_padded_batch_matches_single_prompts_on_cuda(flavor, dtype):
    model = cuda_model(flavor, dtype)
    prompt_lengths, n_new = [67, 2, 9], 5
    rows = [tokens(1, n + n_new, seed=10 + n)[0] for n in prompt_lengths]
    ids_BS, lengths_B = left_pad([r[:n].tolist() for r, n in zip(rows, prompt_lengths)], pad_id=7, device=DEV)
    ids_BS = torch.cat([ids_BS, torch.stack([r[n:] for r, n in zip(rows, prompt_lengths)]).to(DEV)], dim=1)
    batch = prefill_then_decode(model, ids_BS, max(prompt_lengths), lengths_B)
    for row, (r, n) in enumerate(zip(rows, prompt_lengths)):
        alone = prefill_then_decode(model, r[None].to(DEV), n)
        err = max_rel(batch[row], alone[0])
        assert err < LOGIT_TOL[dtype], f"{flavor} {dtype}: prompt of {n} tokens in a padded batch, error {err:.2e}"
