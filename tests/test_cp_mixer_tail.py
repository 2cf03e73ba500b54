"""The CP mixer's tail as one autograd node (parallelisms/cp_mixer_tail.py) against the unfused CP chain it replaces
(conv, SSD, the all-to-all back, gated norm and out_proj as separate nodes), on 2 gloo ranks with our Triton SSD under
Triton's interpreter: the output and the gradient of the input and of every parameter, on every rank, within 1e-5.

Cases: the generic path (conv and norm through autograd, as on the CPU) and the kernel-halves path (CUDA's wiring,
with the halves replaced by the references as tests/test_ssd_triton.py does for the fused mixer without CP); with and
without documents (seq_idx), the load-balanced token layout, ngroups 1 (B / C replicated over the ranks) and 2, D of
[H] and [H, P], a length that is not a multiple of the chunk."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os

import pytest
import torch

from tests.dist_utils import run_distributed

pytest.importorskip("triton")


def _case(rank, world, halves, load_balance, docs, ngroups, D_has_hdim, seq_len):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch.distributed as dist

    from models.args import ModelArgs
    from models.mamba2.mixer import Mamba2Mixer
    from parallelisms.context_parallel import MambaContextParallel
    from parallelisms.sequence_sharding import shard_sequence

    torch.manual_seed(0)
    args = ModelArgs(
        d_model=16, n_layers=2, d_state=8, expand=2, headdim=8, ngroups=ngroups, chunk_size=8, D_has_hdim=D_has_hdim
    )
    fused = Mamba2Mixer(args, layer_id=0, n_layers=2)
    with torch.no_grad():  # random values where the model's init would set constants
        for p in (fused.dt_bias, fused.A_log, fused.D, fused.norm.weight, fused.conv1d.bias):
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p is fused.norm.weight else 0.0))
        fused.A_log.abs_()
    unfused = copy.deepcopy(fused)
    unfused.args = dataclasses.replace(args, use_fused_path=False)
    b = 2
    u = torch.randn(b, seq_len, args.d_model)
    g_out = torch.randn(b, seq_len, args.d_model)
    seq_idx = None
    if docs:  # documents of several lengths, one boundary at a chunk start
        seq_idx = torch.tensor([0] * 8 + [1] * 5 + [2] * (seq_len - 13)).repeat(b, 1)
        seq_idx[1, 20:] += 1
    u_local = shard_sequence(u, rank, world, load_balance)
    g_local = shard_sequence(g_out, rank, world, load_balance)
    results = []
    for m in (fused, unfused):
        m.backend = "triton"
        m.cp = MambaContextParallel.from_mixer(m, dist.group.WORLD, load_balance=load_balance)
        x = u_local.clone().requires_grad_()
        with _halves_from_references() if halves else contextlib.nullcontext():
            out = m(x, seq_idx)
            assert (type(out.grad_fn).__name__ == "_CPMixerTailBackward") == (m is fused), type(out.grad_fn)
            out.backward(g_local)
        grads = {n: p.grad for n, p in m.named_parameters()}
        results.append((out.detach(), x.grad, grads))
    (out_f, dx_f, grads_f), (out_u, dx_u, grads_u) = results
    scale = lambda t: t.abs().max().item()  # noqa: E731
    torch.testing.assert_close(out_f, out_u, rtol=1e-5, atol=1e-5 * scale(out_u))
    torch.testing.assert_close(dx_f, dx_u, rtol=1e-5, atol=1e-5 * scale(dx_u))
    for name, g in grads_u.items():
        assert grads_f[name] is not None, name
        torch.testing.assert_close(
            grads_f[name], g, rtol=1e-5, atol=1e-5 * scale(g), msg=lambda msg, n=name: f"grad of {n}: {msg}"
        )
    return scale(out_u)


def _halves_from_references():
    from tests.test_ssd_triton import kernel_halves_from_references

    return kernel_halves_from_references()


@pytest.mark.parametrize(
    "halves, load_balance, docs, ngroups, D_has_hdim, seq_len",
    [
        (False, False, True, 1, False, 32),
        (True, True, True, 1, False, 32),
        (True, False, False, 2, True, 28),
        (False, True, False, 2, True, 32),
    ],
)
def test_cp_mixer_tail_matches_the_unfused_chain(monkeypatch, halves, load_balance, docs, ngroups, D_has_hdim, seq_len):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the spawned ranks when they first import triton
    out = run_distributed(_case, 2, halves, load_balance, docs, ngroups, D_has_hdim, seq_len)
    assert all(s > 0 for s in out)  # the outputs are not all zeros
