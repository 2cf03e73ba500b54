"""Which kernel each backend picks, the CUDA wrappers' argument plumbing (stand-ins, no GPU), and clear errors."""

import sys
import types

import pytest
import torch

from models.kernels import (
    add_rmsnorm,
    add_rmsnorm_ref,
    causal_conv1d,
    causal_conv1d_ref,
    mamba_split_conv1d_scan,
    mamba_split_conv1d_scan_ref,
    ops,
    rmsnorm_gated,
    rmsnorm_gated_ref,
    ssd_chunk_scan,
    ssd_chunk_scan_ref,
    ssd_triton,
)
from models.kernels import cuda as kcuda
from tests.test_kernels_reference import F64, INF, make_seq_idx, ssd_call, ssd_inputs

# ----------------------------------------------------------------------------- dispatch


def test_dispatch_on_cpu():
    inp = ssd_inputs()
    for backend in ("auto", "reference"):
        torch.testing.assert_close(
            ssd_call(ssd_chunk_scan, inp, 8, backend=backend), ssd_call(ssd_chunk_scan_ref, inp, 8)
        )
    for strict in ("mamba_ssm", "cuda"):  # "cuda": the older name of "mamba_ssm"
        with pytest.raises(ValueError, match="CUDA tensors"):
            ssd_call(ssd_chunk_scan, inp, 8, backend=strict)
    with pytest.raises(ValueError, match="CUDA tensors"):
        ssd_call(ssd_chunk_scan, inp, 8, backend="triton")  # ours, CUDA only (CPU: tests/test_ssd_triton.py)
    with pytest.raises(ValueError, match="unknown"):
        ssd_call(ssd_chunk_scan, inp, 8, backend="nope")
    x = torch.randn(1, 4, 6)
    w = torch.randn(4, 3)
    torch.testing.assert_close(causal_conv1d(x, w, backend="auto"), causal_conv1d_ref(x, w))
    torch.testing.assert_close(
        rmsnorm_gated(x, torch.ones(6), backend="reference"), rmsnorm_gated_ref(x, torch.ones(6))
    )
    torch.testing.assert_close(add_rmsnorm(x, x, torch.ones(6))[0], add_rmsnorm_ref(x, x, torch.ones(6))[0])
    assert callable(mamba_split_conv1d_scan)
    # Importing the kernel layer must never import mamba_ssm / causal_conv1d.
    assert "mamba_ssm" not in sys.modules and "causal_conv1d" not in sys.modules


def test_auto_picks_our_triton_ssd_on_cuda(monkeypatch):
    """Which SSD each backend picks for a CUDA tensor (a stand-in object: this runs without a GPU)."""
    on_gpu = types.SimpleNamespace(is_cuda=True, device="cuda:0")
    monkeypatch.setattr(ssd_triton, "triton_available", lambda: True)
    monkeypatch.setattr(kcuda, "cuda_kernels_available", lambda: True)
    assert ops.use_triton_ssd("auto", on_gpu) and ops.use_triton_ssd("triton", on_gpu)
    assert not ops.use_triton_ssd("mamba_ssm", on_gpu) and not ops.use_triton_ssd("reference", on_gpu)
    assert ops.use_cuda_kernels("auto", on_gpu) and ops.use_cuda_kernels("mamba_ssm", on_gpu)  # conv / norms
    cpu = torch.zeros(1)
    assert not ops.use_triton_ssd("auto", cpu) and not ops.use_cuda_kernels("auto", cpu)
    # Without triton, "auto" falls back to mamba_ssm's SSD; "triton" says why it can't run.
    monkeypatch.setattr(ssd_triton, "triton_available", lambda: False)
    monkeypatch.setattr(ssd_triton, "triton_import_error", lambda: "ImportError: no triton")
    assert not ops.use_triton_ssd("auto", on_gpu) and ops.use_cuda_kernels("auto", on_gpu)
    with pytest.raises(RuntimeError, match="triton does not import.*mamba_ssm"):
        ops.use_triton_ssd("triton", on_gpu)
    monkeypatch.setattr(kcuda, "cuda_kernels_available", lambda: False)
    monkeypatch.setattr(kcuda, "cuda_kernels_import_error", lambda: "ImportError: no mamba_ssm")
    with pytest.raises(RuntimeError, match="mamba_ssm / causal_conv1d kernels are unavailable"):
        ops.use_cuda_kernels("mamba_ssm", on_gpu)


def test_bad_inputs_raise_clear_errors():
    inp = ssd_inputs()
    with pytest.raises(ValueError, match="ngroups=3 must divide nheads=4"):
        ssd_chunk_scan_ref(
            inp["x"], inp["dt"], inp["A"], torch.randn(2, 24, 3, 5, dtype=F64), torch.randn(2, 24, 3, 5, dtype=F64), 8
        )
    bad_seq = inp["seq_idx"].flip(1)
    with pytest.raises(ValueError, match="non-decreasing"):
        ssd_chunk_scan_ref(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 8, seq_idx=bad_seq)
    with pytest.raises(ValueError, match="initial_states"):
        ssd_chunk_scan_ref(
            inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 8, initial_states=torch.zeros(2, 4, 3, 4, dtype=F64)
        )


# ----------------------------------------------------------------------------- CUDA wrapper plumbing


def test_cuda_wrappers_pass_arguments_like_upstream(monkeypatch):
    """The wrappers in models.kernels.cuda, fed stand-ins with the upstream signatures, equal the references.

    The stand-ins check what the real kernels require (int32 seq_idx, channel-last x with seq_idx,
    bias dtype == weight dtype), so argument order and layout handling are tested without a GPU.
    """
    from models.kernels import cuda as kcuda

    def chunk_scan(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        z=None,
        dt_bias=None,
        initial_states=None,
        seq_idx=None,
        cu_seqlens=None,
        dt_softplus=False,
        dt_limit=(0.0, INF),
        return_final_states=False,
        return_varlen_states=False,
    ):
        assert seq_idx is None or (seq_idx.dtype == torch.int32 and seq_idx.is_contiguous())
        return ssd_chunk_scan_ref(
            x,
            dt,
            A,
            B,
            C,
            chunk_size,
            D=D,
            z=z,
            dt_bias=dt_bias,
            dt_softplus=dt_softplus,
            dt_limit=dt_limit,
            seq_idx=seq_idx,
            initial_states=initial_states,
            return_final_states=return_final_states,
        )

    def conv_fn(
        x,
        weight,
        bias=None,
        seq_idx=None,
        initial_states=None,
        return_final_states=False,
        final_states_out=None,
        activation=None,
    ):
        if seq_idx is not None:
            assert seq_idx.dtype == torch.int32 and x.stride(1) == 1 and x.stride(2) % 8 == 0
        assert bias is None or bias.dtype == weight.dtype
        return causal_conv1d_ref(x, weight, bias, seq_idx, activation)

    def gated_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
        assert bias is None
        return rmsnorm_gated_ref(x, weight, z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)

    def rms_fn(
        x,
        weight,
        bias,
        residual=None,
        x1=None,
        weight1=None,
        bias1=None,
        eps=1e-6,
        dropout_p=0.0,
        rowscale=None,
        prenorm=False,
        residual_in_fp32=False,
        return_dropout_mask=False,
    ):
        assert prenorm and bias is None
        return add_rmsnorm_ref(x, residual, weight, eps=eps, residual_in_fp32=residual_in_fp32)

    def split_fn(
        zxbcdt,
        conv1d_weight,
        conv1d_bias,
        dt_bias,
        A,
        D,
        chunk_size,
        initial_states=None,
        seq_idx=None,
        dt_limit=(0.0, INF),
        return_final_states=False,
        activation="silu",
        rmsnorm_weight=None,
        rmsnorm_eps=1e-6,
        outproj_weight=None,
        outproj_bias=None,
        headdim=None,
        ngroups=1,
        norm_before_gate=True,
    ):
        assert seq_idx is None or seq_idx.dtype == torch.int32
        return mamba_split_conv1d_scan_ref(
            zxbcdt,
            conv1d_weight,
            conv1d_bias,
            dt_bias,
            A,
            D,
            chunk_size,
            seq_idx=seq_idx,
            dt_limit=dt_limit,
            activation=activation,
            rmsnorm_weight=rmsnorm_weight,
            rmsnorm_eps=rmsnorm_eps,
            outproj_weight=outproj_weight,
            outproj_bias=outproj_bias,
            headdim=headdim,
            ngroups=ngroups,
            norm_before_gate=norm_before_gate,
            initial_states=initial_states,
            return_final_states=return_final_states,
        )

    monkeypatch.setattr(
        kcuda,
        "_KERNELS",
        dict(
            mamba_chunk_scan_combined=chunk_scan,
            causal_conv1d_fn=conv_fn,
            rmsnorm_fn=gated_fn,
            rms_norm_fn=rms_fn,
            mamba_split_conv1d_scan_combined=split_fn,
        ),
    )

    inp = ssd_inputs()
    inp["seq_idx"] = inp["seq_idx"].long()
    kw = dict(dt_softplus=True, dt_limit=(0.0, 4.0))
    for a, e in zip(ssd_call(kcuda.ssd_chunk_scan_cuda, inp, 8, **kw), ssd_call(ssd_chunk_scan_ref, inp, 8, **kw)):
        torch.testing.assert_close(a, e)

    g = torch.Generator().manual_seed(9)
    x_BLD = torch.randn(2, 15, 24, generator=g)
    w, bias = torch.randn(16, 4, generator=g), torch.randn(16, generator=g).double()
    seq = make_seq_idx(2, 15, [[4], [9]]).long()
    for xv in (x_BLD[..., :16].transpose(1, 2), x_BLD[..., :16].transpose(1, 2).contiguous()):  # strided, chan-first
        torch.testing.assert_close(
            kcuda.causal_conv1d_cuda(xv, w, bias, seq, "silu"), causal_conv1d_ref(xv, w, bias.float(), seq, "silu")
        )
    with pytest.raises(ValueError, match="multiple of 8"):
        kcuda.causal_conv1d_cuda(torch.randn(1, 6, 5), torch.randn(6, 4), None, seq[:1, :5])

    z = torch.randn(2, 15, 16, generator=g)
    torch.testing.assert_close(
        kcuda.rmsnorm_gated_cuda(x_BLD[..., :16], torch.ones(16), z, group_size=8),
        rmsnorm_gated_ref(x_BLD[..., :16], torch.ones(16), z, group_size=8),
    )
    for a, e in zip(
        kcuda.add_rmsnorm_cuda(x_BLD, None, torch.ones(24), residual_in_fp32=True),
        add_rmsnorm_ref(x_BLD, None, torch.ones(24), residual_in_fp32=True),
    ):
        torch.testing.assert_close(a, e)

    H, P, N = 8, 2, 4  # zxbcdt width 48 and 24 conv channels: multiples of 8, as the fused kernel needs
    dim, conv_dim = H * P, H * P + 2 * N
    zxbcdt = torch.randn(2, 15, dim + conv_dim + H, generator=g)
    args = (
        zxbcdt,
        torch.randn(conv_dim, 4, generator=g),
        torch.randn(conv_dim, generator=g),
        torch.zeros(H),
        -torch.ones(H),
        torch.ones(H),
        8,
    )
    kw = dict(
        seq_idx=seq,
        rmsnorm_weight=torch.ones(dim),
        headdim=P,
        norm_before_gate=False,
        initial_states=torch.randn(2, H, P, N, generator=g),
        return_final_states=True,
    )
    for a, e in zip(kcuda.mamba_split_conv1d_scan_cuda(*args, **kw), mamba_split_conv1d_scan_ref(*args, **kw)):
        torch.testing.assert_close(a, e)


def test_references_run_on_meta_tensors():
    # Shape inference (e.g. pipeline stages built on the meta device) must go through the references.
    with torch.device("meta"):
        x, dt, B = torch.randn(2, 24, 4, 3), torch.randn(2, 24, 4), torch.randn(2, 24, 1, 5)
        seq = torch.zeros(2, 24, dtype=torch.int32)
        y, fin = ssd_chunk_scan(x, dt, -torch.ones(4), B, B, 8, seq_idx=seq, return_final_states=True)
        assert y.shape == x.shape and fin.shape == (2, 4, 3, 5)
        assert causal_conv1d(torch.randn(2, 8, 24), torch.randn(8, 4), None, seq, "silu").shape == (2, 8, 24)


def test_row_scaled_output_materialized_for_other_norm_backends():
    """A mixer output with its rows' scale pending (models/kernels/row_scale.RowScaled, model.fuse_gate_into_scan)
    given to ops.add_rmsnorm with a backend other than ours is scaled first: the same result as the scaled rows
    given plainly, and the gradient reaching the unscaled values is the scaled rows' times the scale (the contract
    the mixer's backward relies on); the scale's parts get none."""
    from models.kernels import ops
    from models.kernels.reference import add_rmsnorm_ref
    from models.kernels.row_scale import RowScaled, row_rstd

    gen = torch.Generator().manual_seed(0)
    values = torch.randn(2, 5, 8, generator=gen, requires_grad=True)
    parts = torch.rand(10, 3, generator=gen) * 4
    residual, weight = torch.randn(2, 5, 8, generator=gen), torch.rand(8, generator=gen) + 0.5
    cot = torch.randn(2, 5, 8, generator=gen)
    normed, new_res = ops.add_rmsnorm(RowScaled(values, parts, 12, 1e-5), residual, weight, backend="reference")
    rstd = row_rstd(parts, 12, 1e-5)
    assert torch.allclose(rstd, torch.rsqrt(parts.sum(-1) / 12 + 1e-5))
    scaled = (values.detach() * rstd.view(2, 5, 1)).requires_grad_(True)
    want_normed, want_res = add_rmsnorm_ref(scaled, residual, weight)
    assert torch.allclose(normed, want_normed, atol=1e-6) and torch.allclose(new_res, want_res, atol=1e-6)
    (normed * cot).sum().backward()
    (want_normed * cot).sum().backward()
    assert torch.allclose(values.grad, scaled.grad * rstd.view(2, 5, 1), atol=1e-6)
