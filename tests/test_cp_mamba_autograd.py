"""The CP mixer's fused autograd nodes (parallelisms/cp_mamba_autograd.py) against their unfused definitions:
values and gradients of every input, in float64 (and under bf16 autocast for the in_proj), the backward's scatter of
repeated (replicated B / C) rows included."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from parallelisms.context_parallel import MambaContextParallel
from tests.dist_utils import FakeGroup, run_distributed


class _Mixer(nn.Module):
    """The attributes MambaContextParallel.from_mixer reads (mamba_ssm Mamba2 names), random values."""

    def __init__(self, nheads=8, headdim=2, ngroups=1, d_state=3, d_conv=4, D_has_hdim=False, conv_bias=True):
        super().__init__()
        g = torch.Generator().manual_seed(nheads * 7 + ngroups)
        self.nheads, self.ngroups, self.d_state, self.D_has_hdim = nheads, ngroups, d_state, D_has_hdim
        self.d_ssm = nheads * headdim
        conv_dim = self.d_ssm + 2 * ngroups * d_state
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim, padding=d_conv - 1, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.randn(nheads, generator=g) * 0.5)
        self.A_log = nn.Parameter(torch.log(torch.rand(nheads, generator=g) + 0.5))
        self.D = nn.Parameter(torch.randn(self.d_ssm if D_has_hdim else nheads, generator=g))
        self.in_proj = nn.Linear(5, 2 * self.d_ssm + 2 * ngroups * d_state + nheads, bias=False)


def _sliced_reference(cpm):
    """The unfused definition: get_* slices, A = -exp(A_log), D in the SSD's layout."""
    d_shape = (cpm.nheads_local, cpm.headdim) if cpm.D_has_hdim else (cpm.nheads_local,)
    return (
        cpm.get_conv1d_weight().squeeze(1),
        cpm.get_conv1d_bias(),
        cpm.get_dt_bias(),
        -torch.exp(cpm.get_A_log().float()),
        cpm.get_D().reshape(d_shape),
    )


@pytest.mark.parametrize(
    "cp, rank, ngroups, D_has_hdim, conv_bias",
    [(2, 1, 1, False, True), (4, 2, 2, True, True), (2, 0, 4, True, False), (4, 3, 1, False, False)],
)
def test_local_params_match_slices(cp, rank, ngroups, D_has_hdim, conv_bias):
    """One gather / one scatter: the same slices as get_* and, for random output gradients, the same full-size
    parameter gradients (zero outside this rank's slices: a wrong index would put them elsewhere)."""
    ref = _Mixer(nheads=8, ngroups=ngroups, D_has_hdim=D_has_hdim, conv_bias=conv_bias).double()
    mine = copy.deepcopy(ref)
    want = _sliced_reference(MambaContextParallel.from_mixer(ref, FakeGroup(cp, rank)))
    got = MambaContextParallel.from_mixer(mine, FakeGroup(cp, rank)).local_params()
    g = torch.Generator().manual_seed(3)
    grads = []
    for w, m in zip(want, got):
        if w is None:
            assert m is None
            continue
        assert m.shape == w.shape and m.dtype == w.dtype
        torch.testing.assert_close(m, w, rtol=0, atol=0)
        grads.append(torch.randn(w.shape, dtype=w.dtype, generator=g))
    present = lambda ts: [t for t in ts if t is not None]  # noqa: E731
    torch.autograd.backward(present(want), grads)
    torch.autograd.backward(present(got), grads)
    for (name, p), (_, p_ref) in zip(mine.named_parameters(), ref.named_parameters()):
        if name.startswith("in_proj"):
            continue
        assert p.grad is not None and p.grad.shape == p.shape, name
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-15, atol=0, msg=lambda m: f"grad of {name}\n{m}")


def test_local_params_mixed_dtypes_fall_back_to_slices():
    """One concatenation needs one dtype: with a float32 A_log beside float64 parameters, the per-parameter slices."""
    m = _Mixer(nheads=8, ngroups=2).double()
    m.A_log = nn.Parameter(m.A_log.detach().float())
    cpm = MambaContextParallel.from_mixer(m, FakeGroup(2, 1))
    for a, b in zip(cpm.local_params(), _sliced_reference(cpm)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------
# in_proj + all-to-all (gloo ranks)
# ----------------------------------------------------------------------------------------------------


def _in_proj_body(rank, cp, ngroups, with_bias, b, overlap):
    group = dist.group.WORLD
    torch.manual_seed(0)
    mixer = _Mixer(nheads=8, headdim=2, ngroups=ngroups).double()
    mixer.in_proj = nn.Linear(5, mixer.in_proj.out_features, bias=with_bias).double()
    ref = copy.deepcopy(mixer)
    cpm = MambaContextParallel.from_mixer(mixer, group, overlap=overlap)
    cpm_ref = MambaContextParallel.from_mixer(ref, group)
    s_local = 6
    gen = torch.Generator().manual_seed(10 + rank)
    u = torch.randn(b, s_local, 5, dtype=torch.float64, generator=gen)
    u_ref = u.clone().requires_grad_()
    u.requires_grad_()

    z, xBCdt = cpm.in_proj_pre_conv_ssm(u, mixer.in_proj)
    zxbcdt = ref.in_proj(u_ref)  # the definition: in_proj, then the all-to-all of its x B C dt part
    z_ref, xBCdt_ref = zxbcdt[..., : cpm.d_inner], cpm_ref.pre_conv_ssm(zxbcdt[..., cpm.d_inner :])
    assert type(xBCdt) is torch.Tensor and xBCdt.shape == xBCdt_ref.shape
    torch.testing.assert_close(z, z_ref, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(xBCdt, xBCdt_ref, rtol=1e-14, atol=1e-14)
    gz, gx = torch.randn(z.shape, dtype=z.dtype, generator=gen), torch.randn(xBCdt.shape, dtype=z.dtype, generator=gen)
    torch.autograd.backward([z, xBCdt], [gz, gx])
    torch.autograd.backward([z_ref, xBCdt_ref], [gz, gx])
    torch.testing.assert_close(u.grad, u_ref.grad, rtol=1e-13, atol=1e-13)
    for (name, p), (_, p_ref) in zip(mixer.in_proj.named_parameters(), ref.in_proj.named_parameters()):
        assert p.grad.shape == p.shape
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-13, atol=1e-13, msg=lambda m: f"grad of {name}\n{m}")

    # bf16 autocast (the GPU runs): products in bf16 as F.linear's, the float32 weight's gradient in float32
    m32, r32 = copy.deepcopy(mixer).float(), copy.deepcopy(ref).float()
    cpm32, cpm32_ref = MambaContextParallel.from_mixer(m32, group), MambaContextParallel.from_mixer(r32, group)
    u32, u32_ref = u.detach().float().requires_grad_(), u.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z, xBCdt = cpm32.in_proj_pre_conv_ssm(u32, m32.in_proj)
        zxbcdt = r32.in_proj(u32_ref)
        z_ref, xBCdt_ref = zxbcdt[..., : cpm.d_inner], cpm32_ref.pre_conv_ssm(zxbcdt[..., cpm.d_inner :])
    assert z.dtype == xBCdt.dtype == z_ref.dtype == torch.bfloat16
    torch.testing.assert_close(z, z_ref)
    torch.testing.assert_close(xBCdt, xBCdt_ref)
    torch.autograd.backward([z, xBCdt], [gz.bfloat16(), gx.bfloat16()])
    torch.autograd.backward([z_ref, xBCdt_ref], [gz.bfloat16(), gx.bfloat16()])
    assert u32.grad.dtype == torch.float32 and m32.in_proj.weight.grad.dtype == torch.float32
    torch.testing.assert_close(u32.grad, u32_ref.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(m32.in_proj.weight.grad, r32.in_proj.weight.grad, rtol=2e-2, atol=2e-2)
    return True


@pytest.mark.parametrize(
    "cp, ngroups, with_bias, b, overlap",
    [
        (2, 1, False, 1, True),
        (2, 2, True, 2, True),
        (4, 1, True, 1, True),
        (4, 2, False, 2, True),
        (2, 2, True, 2, False),
    ],
    ids=["cp2-replicated-b1", "cp2-unique-bias-b2", "cp4-replicated-bias-b1", "cp4-replicated-b2", "cp2-no-overlap"],
)
def test_in_proj_seq_to_heads_matches_in_proj_then_all_to_all(cp, ngroups, with_bias, b, overlap):
    """One node for in_proj + the all-to-all, overlapped both ways: the same z, xBCdt and gradients (u, weight,
    bias: the z rows by their product in place, the x B C dt rows scattered, replicated B / C rows summed) as in_proj
    followed by pre_conv_ssm."""
    assert all(run_distributed(_in_proj_body, cp, ngroups, with_bias, b, overlap))
