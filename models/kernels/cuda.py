"""Thin wrappers over the mamba_ssm (Triton) and causal_conv1d (CUDA) kernels, imported lazily.

Nothing here imports mamba_ssm / causal_conv1d at module import time: the released packages cannot
be imported without their CUDA build. The first call (or cuda_kernels_available()) imports them,
once; the result is cached. Wrappers take the same arguments as the references in reference.py.
This is the one loader of those kernels: the decoding step kernels (step_ops.py) come from it too.
"""

from __future__ import annotations

import torch

__all__ = [
    "cuda_kernels_available",
    "cuda_kernels_import_error",
    "ssd_chunk_scan_cuda",
    "causal_conv1d_cuda",
    "rmsnorm_gated_cuda",
    "add_rmsnorm_cuda",
    "mamba_split_conv1d_scan_cuda",
    "kernels",
    "kernel_halves",
    "conv_forward",
    "conv_backward",
    "gated_rmsnorm_forward",
    "gated_rmsnorm_backward",
]

_KERNELS: dict | None = None
_IMPORT_ERROR: str | None = None


def _load() -> dict | None:
    """Every mamba_ssm / causal_conv1d kernel this repository calls (training and decoding), imported once."""
    global _KERNELS, _IMPORT_ERROR
    if _KERNELS is not None or _IMPORT_ERROR is not None:
        return _KERNELS
    if not torch.cuda.is_available():
        _IMPORT_ERROR = "CUDA is not available"
        return None
    try:
        from causal_conv1d import causal_conv1d_fn, causal_conv1d_update
        from mamba_ssm.ops.triton.layer_norm import rms_norm_fn
        from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
        from mamba_ssm.ops.triton.ssd_combined import (
            mamba_chunk_scan_combined,
            mamba_split_conv1d_scan_combined,
        )
    except Exception as e:  # ImportError, or an OSError / RuntimeError from a mismatched CUDA build
        _IMPORT_ERROR = f"{type(e).__name__}: {e}"
        return None
    _KERNELS = dict(
        causal_conv1d_fn=causal_conv1d_fn,
        rms_norm_fn=rms_norm_fn,
        rmsnorm_fn=rmsnorm_fn,
        mamba_chunk_scan_combined=mamba_chunk_scan_combined,
        mamba_split_conv1d_scan_combined=mamba_split_conv1d_scan_combined,
        selective_state_update=selective_state_update,
        causal_conv1d_update=causal_conv1d_update,
    )
    return _KERNELS


def cuda_kernels_available() -> bool:
    """True when CUDA is present and mamba_ssm + causal_conv1d import (checked once, then cached)."""
    return _load() is not None


def cuda_kernels_import_error() -> str | None:
    """Why the kernels are unavailable (None when they are, or before the first check)."""
    _load()
    return _IMPORT_ERROR


def kernels() -> dict:
    """The kernels by name (see _load), or a RuntimeError saying why they are unavailable."""
    k = _load()
    if k is None:
        raise RuntimeError(
            f"mamba_ssm / causal_conv1d GPU kernels are unavailable ({_IMPORT_ERROR}). Install mamba-ssm and "
            "causal-conv1d built for this torch / CUDA, or use backend='reference'."
        )
    return k


def _seq_idx_i32(seq_idx: torch.Tensor | None) -> torch.Tensor | None:
    # The kernels read seq_idx as contiguous int32.
    return None if seq_idx is None else seq_idx.to(torch.int32).contiguous()


def ssd_chunk_scan_cuda(
    x_BLHP,
    dt_BLH,
    A_H,
    B_BLGN,
    C_BLGN,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    dt_softplus=False,
    dt_limit=(0.0, float("inf")),
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
):
    return kernels()["mamba_chunk_scan_combined"](
        x_BLHP,
        dt_BLH,
        A_H,
        B_BLGN,
        C_BLGN,
        chunk_size,
        D=D,
        z=z,
        dt_bias=dt_bias,
        initial_states=initial_states,
        seq_idx=_seq_idx_i32(seq_idx),
        dt_softplus=dt_softplus,
        dt_limit=tuple(dt_limit),
        return_final_states=return_final_states,
    )


def _channel_last_ok(x_BDL: torch.Tensor) -> bool:
    # What the channel-last kernel accepts: D contiguous, and batch / time strides multiples of 8.
    return x_BDL.stride(1) == 1 and x_BDL.stride(2) % 8 == 0 and x_BDL.stride(0) % 8 == 0


def _conv_operands(x_BDL, weight_DW, bias_D, seq_idx_BL):
    """What the causal_conv1d kernels accept: x in a layout they handle, contiguous weight, bias in weight's dtype,
    int32 seq_idx."""
    b, d, L = x_BDL.shape
    # The kernel picks its channel-last variant whenever stride(1) == 1; the seq_idx path exists only there.
    wants_channel_last = seq_idx_BL is not None or (x_BDL.stride(1) == 1 and L > 1 and x_BDL.stride(2) > 1)
    if wants_channel_last and d % 8:
        if seq_idx_BL is not None:
            raise ValueError(
                f"causal_conv1d with seq_idx needs the channel count ({d}) to be a multiple of 8 "
                "(channel-last kernel); change the model sizes or use backend='reference'"
            )
        x_BDL, wants_channel_last = x_BDL.contiguous(), False
    if wants_channel_last and not _channel_last_ok(x_BDL):
        # A compact channel-last copy: same [B, D, L] shape, D contiguous, strides D and L*D.
        x_BDL = x_BDL.transpose(1, 2).contiguous().transpose(1, 2)
    if bias_D is not None and bias_D.dtype != weight_DW.dtype:
        bias_D = bias_D.to(weight_DW.dtype)  # the kernel requires bias and weight of one dtype
    return x_BDL, weight_DW.contiguous(), bias_D, _seq_idx_i32(seq_idx_BL)


def causal_conv1d_cuda(x_BDL, weight_DW, bias_D=None, seq_idx_BL=None, activation=None):
    x_BDL, weight_DW, bias_D, seq_idx_BL = _conv_operands(x_BDL, weight_DW, bias_D, seq_idx_BL)
    return kernels()["causal_conv1d_fn"](x_BDL, weight_DW, bias_D, seq_idx=seq_idx_BL, activation=activation)


# ---- forward / backward halves without autograd, for our fused mixer (split_conv1d_scan.py) ----------------------
# The conv's forward and backward (causal_conv1d's, the functions mamba_ssm's own fused mixer calls), and the gated
# RMSNorm's forward and its backward that also recomputes the normed output (ours, gated_rmsnorm_triton.py; mamba_ssm's
# _layer_norm_fwd / _layer_norm_bwd with NORM_HALVES = "mamba_ssm"). Called directly, they skip what a step pays per
# layer for autograd Functions, causal_conv1d's custom-op dispatch and a graph rebuilt inside the backward
# (docs/performance.md, issue 14: the 370M step is host-bound).
_HALVES: dict | None = None
# Which gated-norm halves gated_rmsnorm_forward / _backward run when not told: "ours", or "mamba_ssm" (for comparison:
# benchmarks/bench_norm.py, tests/gpu/test_kernels_gpu.py).
NORM_HALVES = "ours"


def kernel_halves() -> dict | None:
    """{conv_fwd, conv_bwd, norm_fwd, norm_bwd, conv_entry}, or None when the kernels (or these functions) do not
    import. conv_fwd(x, w, b, seq, silu) -> out; conv_bwd(x, w, b, dout, seq, silu, dx or None) -> (dx, dw, db);
    norm_fwd / norm_bwd: ours (gated_rmsnorm_triton.py), gated_rmsnorm_forward / _backward's contract."""
    global _HALVES
    if _HALVES is None:
        _HALVES = {}
        if _load() is not None:
            try:
                from causal_conv1d.cpp_functions import causal_conv1d_bwd_function, causal_conv1d_fwd_function

                from models.kernels.gated_rmsnorm_triton import gated_rmsnorm_bwd, gated_rmsnorm_fwd
            except Exception:  # an older / newer layout of causal_conv1d: the autograd path still works
                pass
            else:
                _HALVES = dict(
                    conv_fwd=lambda x, w, b, seq, silu: causal_conv1d_fwd_function(x, w, b, seq, None, None, silu),
                    conv_bwd=lambda x, w, b, dout, seq, silu, dx: causal_conv1d_bwd_function(
                        x, w, b, dout, seq, None, None, dx, False, silu
                    )[:3],
                    norm_fwd=gated_rmsnorm_fwd,
                    norm_bwd=gated_rmsnorm_bwd,
                    conv_entry="causal_conv1d.cpp_functions",
                )
                _HALVES.update(_conv_entry_points() or {})
    return _HALVES or None


def _conv_entry_points() -> dict | None:
    """The conv's C++ forward / backward called without the custom ops that cpp_functions wraps them in (~160 us of
    Python dispatch per call, measured on an H100: three calls per layer and step). Only for the C++ signature those
    wrappers call (outputs passed in: forward 8 arguments, backward 12, both returning None), read from pybind's
    docstrings; any other build keeps the wrappers. Same arguments and buffers as the wrappers pass."""
    try:
        import causal_conv1d_cuda as cc
    except Exception:
        return None

    def signature(fn) -> tuple[int, bool]:  # "name(arg0: torch.Tensor, ..., arg7: bool) -> None"
        head = (getattr(fn, "__doc__", None) or "").split("\n", 1)[0]
        return head.count(": "), head.rstrip().endswith("-> None")

    if signature(cc.causal_conv1d_fwd) != (8, True) or signature(cc.causal_conv1d_bwd) != (12, True):
        return None

    def conv_fwd(x, w, b, seq, silu):
        out = torch.empty_like(x)
        cc.causal_conv1d_fwd(x, w, b, seq, None, out, None, silu)
        return out

    def conv_bwd(x, w, b, dout, seq, silu, dx):
        dx = torch.empty_like(x) if dx is None else dx
        dw = torch.zeros_like(w, dtype=torch.float32)
        db = None if b is None else torch.zeros_like(b, dtype=torch.float32)
        cc.causal_conv1d_bwd(x, w, b, dout, seq, None, None, dx, dw, db, None, silu)
        return dx, dw, db

    return dict(conv_fwd=conv_fwd, conv_bwd=conv_bwd, conv_entry="causal_conv1d_cuda")


def conv_forward(x_BDL, weight_DW, bias_D, seq_idx_BL, silu: bool) -> torch.Tensor:
    """causal conv (+ silu): [B, D, L] -> [B, D, L], no autograd."""
    x_BDL, weight_DW, bias_D, seq_idx_BL = _conv_operands(x_BDL, weight_DW, bias_D, seq_idx_BL)
    return kernel_halves()["conv_fwd"](x_BDL, weight_DW, bias_D, seq_idx_BL, silu)


def conv_backward(x_BDL, weight_DW, bias_D, dout_BDL, seq_idx_BL, silu: bool, dx_BDL: torch.Tensor):
    """The conv's gradients: writes dx into dx_BDL ([B, D, L], any layout) and returns (dweight in weight's dtype,
    dbias in bias's dtype or None)."""
    w_dtype, b_dtype = weight_DW.dtype, None if bias_D is None else bias_D.dtype
    x_BDL, weight_DW, bias_D, seq_idx_BL = _conv_operands(x_BDL, weight_DW, bias_D, seq_idx_BL)
    if dout_BDL.stride(1) != 1 or not _channel_last_ok(dout_BDL):
        dout_BDL = dout_BDL.transpose(1, 2).contiguous().transpose(1, 2)  # the layout of x (channel-last)
    same = dx_BDL.stride() == x_BDL.stride()
    dx, dw, db = kernel_halves()["conv_bwd"](
        x_BDL, weight_DW, bias_D, dout_BDL, seq_idx_BL, silu, dx_BDL if same else None
    )
    if not same:
        dx_BDL.copy_(dx)
    return dw.to(w_dtype), None if db is None else db.to(b_dtype)


def gated_rmsnorm_forward(y_MD, weight_D, z_MD, eps: float, group_size: int, norm_before_gate: bool, impl=None):
    """Gated, grouped RMSNorm of rows [M, D] (last dim contiguous): (out [M, D], rstd [groups * M] float32).
    impl: "ours" or "mamba_ssm" (None: NORM_HALVES)."""
    if (impl or NORM_HALVES) == "mamba_ssm":
        out, _, rstd = _mamba_ssm_norm_halves()[0](
            y_MD, weight_D, None, eps, z=z_MD, group_size=group_size, norm_before_gate=norm_before_gate,
            is_rms_norm=True,
        )  # fmt: skip
        return out, rstd
    return kernel_halves()["norm_fwd"](y_MD, weight_D, z_MD, eps, group_size, norm_before_gate)


def gated_rmsnorm_backward(
    dout_MD, y_MD, weight_D, z_MD, rstd, eps, group_size, norm_before_gate, dz_MD, recompute, impl=None
):
    """Gradients of gated_rmsnorm_forward (the same impl's rstd): (dy [M, D], dweight, the normed output recomputed
    or None); dz is written into dz_MD."""
    if (impl or NORM_HALVES) == "mamba_ssm":
        dy, dw, _, _, *out = _mamba_ssm_norm_halves()[1](
            dout_MD, y_MD, weight_D, None, eps, None, rstd, z_MD, group_size=group_size,
            norm_before_gate=norm_before_gate, is_rms_norm=True, recompute_output=recompute, dz=dz_MD,
        )  # fmt: skip
        return dy, dw, out[0] if recompute else None
    return kernel_halves()["norm_bwd"](
        dout_MD, y_MD, weight_D, z_MD, rstd, eps, group_size, norm_before_gate, dz_MD, recompute
    )


def _mamba_ssm_norm_halves():
    """mamba_ssm's gated norm forward / backward (_layer_norm_fwd, _layer_norm_bwd), for comparison with ours."""
    kernels()  # the reason, when mamba_ssm does not import
    from mamba_ssm.ops.triton.layernorm_gated import _layer_norm_bwd, _layer_norm_fwd

    return _layer_norm_fwd, _layer_norm_bwd


def rmsnorm_gated_cuda(x, weight, z=None, eps=1e-5, group_size=None, norm_before_gate=False):
    return kernels()["rmsnorm_fn"](
        x, weight, None, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate
    )


def add_rmsnorm_cuda(x, residual, weight, eps=1e-5, residual_in_fp32=False):
    normed, new_residual = kernels()["rms_norm_fn"](
        x, weight, None, residual=residual, eps=eps, prenorm=True, residual_in_fp32=residual_in_fp32
    )
    return normed, new_residual


def mamba_split_conv1d_scan_cuda(
    zxbcdt,
    conv1d_weight,
    conv1d_bias,
    dt_bias,
    A,
    D,
    chunk_size,
    seq_idx=None,
    dt_limit=(0.0, float("inf")),
    activation="silu",
    rmsnorm_weight=None,
    rmsnorm_eps=1e-6,
    outproj_weight=None,
    outproj_bias=None,
    headdim=None,
    ngroups=1,
    norm_before_gate=True,
    initial_states=None,
    return_final_states=False,
):
    if zxbcdt.shape[-1] % 8 or conv1d_weight.shape[0] % 8:
        # The fused kernel runs causal_conv1d channel-last on a view of zxbcdt, which needs both multiples of 8.
        raise ValueError(
            f"the fused kernel needs zxbcdt width ({zxbcdt.shape[-1]}) and conv channels ({conv1d_weight.shape[0]}) "
            "to be multiples of 8; change the sizes or use the unfused path (model.use_fused_path=false)"
        )
    return kernels()["mamba_split_conv1d_scan_combined"](
        zxbcdt.contiguous(),
        conv1d_weight,
        conv1d_bias,
        dt_bias,
        A,
        D,
        chunk_size,
        initial_states=initial_states,
        seq_idx=_seq_idx_i32(seq_idx),
        dt_limit=tuple(dt_limit),
        return_final_states=return_final_states,
        activation=activation,
        rmsnorm_weight=rmsnorm_weight,
        rmsnorm_eps=rmsnorm_eps,
        outproj_weight=outproj_weight,
        outproj_bias=outproj_bias,
        headdim=headdim,
        ngroups=ngroups,
        norm_before_gate=norm_before_gate,
    )
