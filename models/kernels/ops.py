"""The kernel API the model calls: GPU kernels on CUDA when installed, PyTorch references otherwise.

Every op has its reference's signature plus a keyword ``backend``:
  "auto"      on CUDA tensors: our Triton kernels for the chunked SSD, the fused mixer and the residual add + RMSNorm
              (models/kernels/ssd_triton, split_conv1d_scan.py, add_rmsnorm_triton.py; mamba_ssm's when triton does
              not import), the causal_conv1d / mamba_ssm kernels for the conv and the gated norm when they import;
              on the CPU the references;
  "triton"    as "auto", but our SSD kernels or a clear error (on CUDA tensors, or on the CPU under
              TRITON_INTERPRET=1, for tests);
  "mamba_ssm" the mamba_ssm / causal_conv1d kernels for every op, or a clear error naming what is missing
              ("cuda" is the same, its older name);
  "reference" always the pure-PyTorch reference (any device).
Our SSD is faster than mamba_ssm's on an H100 and its errors against float64 are no larger (docs/performance.md).
mamba_ssm and triton are never imported when this module is imported (see cuda.py, ssd_triton).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from models.kernels import cuda as _cuda
from models.kernels import ssd_triton as _ssd_triton
from models.kernels.autocast_linear import float32_weight_grad_applies
from models.kernels.reference import (
    add_rmsnorm_ref,
    causal_conv1d_ref,
    mamba_split_conv1d_scan_ref,
    rmsnorm_gated_ref,
    ssd_chunk_scan_ref,
)
from models.kernels.row_scale import RowScaled, materialize
from models.kernels.split_conv1d_scan import mamba_split_conv1d_scan_triton
from models.loss import IGNORE_INDEX, chunked_cross_entropy_sum, cross_entropy_sum

__all__ = [
    "BACKENDS",
    "use_cuda_kernels",
    "use_triton_ssd",
    "ssd_chunk_scan",
    "causal_conv1d",
    "rmsnorm_gated",
    "add_rmsnorm",
    "mamba_split_conv1d_scan",
    "linear_cross_entropy_sum",
]

BACKENDS = ("auto", "triton", "mamba_ssm", "reference", "cuda")


def use_cuda_kernels(backend: str, t: torch.Tensor) -> bool:
    """Whether an op on tensor ``t`` runs the mamba_ssm / causal_conv1d kernels under ``backend`` (raises for
    'mamba_ssm' / 'cuda' when it can't). For the SSD, use_triton_ssd decides first."""
    if backend == "reference":
        return False
    if backend in ("auto", "triton"):
        return t.is_cuda and _cuda.cuda_kernels_available()
    if backend in ("mamba_ssm", "cuda"):
        if not t.is_cuda:
            raise ValueError(f"backend={backend!r} needs CUDA tensors, got a tensor on {t.device}; use backend='auto'")
        if not _cuda.cuda_kernels_available():
            raise RuntimeError(
                f"backend={backend!r} but the mamba_ssm / causal_conv1d kernels are unavailable "
                f"({_cuda.cuda_kernels_import_error()}); install them or use backend='auto' / 'reference'"
            )
        return True
    raise ValueError(f"backend={backend!r} is unknown; choose one of {BACKENDS}")


def use_triton_ssd(backend: str, t: torch.Tensor) -> bool:
    """Whether the SSD (and the fused mixer) on tensor ``t`` runs our Triton kernels: under 'auto' on CUDA tensors
    when triton imports; under 'triton' always, or an error saying why it can't."""
    if backend == "auto":
        return t.is_cuda and _ssd_triton.triton_available()
    if backend != "triton":
        return False
    if not (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got a tensor on {t.device}); use backend='auto' or 'reference'"
        )
    if not _ssd_triton.triton_available():
        raise RuntimeError(
            f"backend='triton' but triton does not import ({_ssd_triton.triton_import_error()}); "
            "pip install triton, or use backend='mamba_ssm'"
        )
    return True


def ssd_chunk_scan(
    x_BLHP: torch.Tensor,
    dt_BLH: torch.Tensor,
    A_H: torch.Tensor,
    B_BLGN: torch.Tensor,
    C_BLGN: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    *,
    backend: str = "auto",
    keep_states: bool = False,
):
    """Chunked SSD scan (mamba_chunk_scan_combined). y [B, L, H, P] (, final_states [B, H, P, N] fp32).

    keep_states (our SSD kernels only; the others ignore it): the entering states kept from the forward for the
    backward instead of recomputed (model.ssd_keep_states)."""
    if use_triton_ssd(backend, x_BLHP):
        fn = functools.partial(_ssd_triton.ssd_chunk_scan_triton, keep_states=keep_states)
    else:
        fn = _cuda.ssd_chunk_scan_cuda if use_cuda_kernels(backend, x_BLHP) else ssd_chunk_scan_ref
    return fn(
        x_BLHP,
        dt_BLH,
        A_H,
        B_BLGN,
        C_BLGN,
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


def causal_conv1d(
    x_BDL: torch.Tensor,
    weight_DW: torch.Tensor,
    bias_D: torch.Tensor | None = None,
    seq_idx_BL: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Depthwise causal conv1d (causal_conv1d_fn): [B, D, L] -> [B, D, L]; resets at document starts.
    causal_conv1d's CUDA kernels where installed; without them, under "auto" / "triton" on CUDA, our Triton kernels
    (conv_triton.py: widths <= 4; on an H100 faster than causal_conv1d's with documents, backward 1.2x slower without
    them: docs/performance.md), else the PyTorch reference."""
    if use_cuda_kernels(backend, x_BDL):
        return _cuda.causal_conv1d_cuda(x_BDL, weight_DW, bias_D, seq_idx_BL, activation)
    if weight_DW.shape[-1] <= 4 and use_triton_ssd(backend, x_BDL):
        from models.kernels.conv_triton import causal_conv1d_triton  # lazy: imports triton

        return causal_conv1d_triton(x_BDL, weight_DW, bias_D, seq_idx_BL, activation)
    return causal_conv1d_ref(x_BDL, weight_DW, bias_D, seq_idx_BL, activation)


def rmsnorm_gated(
    x: torch.Tensor,
    weight: torch.Tensor,
    z: torch.Tensor | None = None,
    eps: float = 1e-5,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Gated, grouped RMSNorm (mamba_ssm RMSNormGated); same shape and dtype as x. With z, where the SSD's kernels
    are ours: our Triton kernels (gated_rmsnorm_triton.py: backward 1.3x faster than mamba_ssm's on an H100,
    docs/performance.md), else mamba_ssm's where installed, else the reference."""
    if z is not None and use_triton_ssd(backend, x):
        from models.kernels.gated_rmsnorm_triton import rmsnorm_gated_triton  # lazy: imports triton

        return rmsnorm_gated_triton(x, weight, z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)
    fn = _cuda.rmsnorm_gated_cuda if use_cuda_kernels(backend, x) else rmsnorm_gated_ref
    return fn(x, weight, z=z, eps=eps, group_size=group_size, norm_before_gate=norm_before_gate)


def rmsnorm_gated_blocks(
    y_KMd: torch.Tensor,
    weight: torch.Tensor,
    z_MD: torch.Tensor,
    eps: float = 1e-5,
    group_size: int | None = None,
    norm_before_gate: bool = False,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """rmsnorm_gated of rows [M, D] given as K column blocks y [K, M, D / K] (block k: columns k * D / K on), with z
    [M, D]: -> [M, D]. Where the SSD's kernels are ours, our kernels read the blocks where they lie and give y's
    gradient back as blocks (context parallel's all-to-all delivers and takes them so: no copy either way); else the
    blocks are assembled and rmsnorm_gated runs."""
    if use_triton_ssd(backend, y_KMd):
        from models.kernels.gated_rmsnorm_triton import rmsnorm_gated_blocks_triton  # lazy: imports triton

        return rmsnorm_gated_blocks_triton(y_KMd, weight, z_MD, eps, group_size, norm_before_gate)
    K, M, d = y_KMd.shape
    y_MD = y_KMd.permute(1, 0, 2).reshape(M, K * d)
    return rmsnorm_gated(y_MD, weight, z_MD, eps, group_size, norm_before_gate, backend=backend)


def add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float = 1e-5,
    residual_in_fp32: bool = False,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm (layer_norm_fn prenorm=True): returns (normed, new_residual). Our Triton kernels
    where the SSD's are ours (add_rmsnorm_triton.py), mamba_ssm's under "mamba_ssm", else the reference. x may be a
    row_scale.RowScaled (a mixer's output with its rows' scale pending): our kernels apply the scale as they read
    it, the others get it applied first."""
    if use_triton_ssd(backend, x.values if isinstance(x, RowScaled) else x):
        from models.kernels.add_rmsnorm_triton import add_rmsnorm_triton  # lazy: imports triton

        return add_rmsnorm_triton(x, residual, weight, eps=eps, residual_in_fp32=residual_in_fp32)
    x = materialize(x)
    fn = _cuda.add_rmsnorm_cuda if use_cuda_kernels(backend, x) else add_rmsnorm_ref
    return fn(x, residual, weight, eps=eps, residual_in_fp32=residual_in_fp32)


def add_rmsnorm_linear_applies(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    lin_weight: torch.Tensor,
    lin_bias: torch.Tensor | None,
    residual_in_fp32: bool,
    *,
    backend="auto",
) -> bool:
    """Whether add_rmsnorm_linear runs its one Function (norm_linear.py): our kernels on CUDA tensors, autocast's
    float32-gradient path for the linear layer (bf16 / fp16 autocast, a plain float32 weight, no bias:
    autocast_linear.py) and a float32 residual stream (the recomputed normed rows then equal the forward's)."""
    values = x.values if isinstance(x, RowScaled) else x
    if residual is not None:
        res_fp32 = residual.dtype == torch.float32
    else:
        res_fp32 = residual_in_fp32 or values.dtype == torch.float32
    return (
        lin_bias is None
        and res_fp32
        and use_triton_ssd(backend, values)
        and float32_weight_grad_applies(values, lin_weight, None)  # CUDA tensors under autocast
    )


def add_rmsnorm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    residual_in_fp32: bool,
    lin_weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rmsnorm(x + residual)) under autocast, new residual) as one autograd Function that keeps no copy of
    the normed rows (model.recompute_in_proj_input; models/kernels/norm_linear.py). Call it where
    add_rmsnorm_linear_applies; it computes in autocast's dtype."""
    from models.kernels.norm_linear import add_rmsnorm_linear_triton  # lazy: imports triton

    compute_dtype = torch.get_autocast_dtype("cuda")
    return add_rmsnorm_linear_triton(x, residual, norm_weight, eps, residual_in_fp32, lin_weight, compute_dtype)


def mamba_split_conv1d_scan(
    zxbcdt: torch.Tensor,
    conv1d_weight: torch.Tensor,
    conv1d_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
    seq_idx: torch.Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    activation: str | None = "silu",
    rmsnorm_weight: torch.Tensor | None = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: torch.Tensor | None = None,
    outproj_bias: torch.Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    *,
    backend: str = "auto",
    keep_states: bool = False,
    A_log: torch.Tensor | None = None,
    fuse_gate: bool = False,
    keep_conv: bool = False,
):
    """Fused conv + SSD + gated norm + out_proj (mamba_split_conv1d_scan_combined).

    With our SSD (backends 'auto' on CUDA, 'triton'): conv, our SSD kernels and the gated norm in one autograd
    Function that recomputes the conv and the norm in its backward, as mamba_ssm's fused mixer does
    (split_conv1d_scan.py). keep_states: as in ssd_chunk_scan. A_log: the model's parameter in place of A (pass
    A=None): A = -exp(A_log), taken inside our dt kernels (no PyTorch ops for it) or here for the other backends.
    fuse_gate: on our path, where it applies, a row_scale.RowScaled output (model.fuse_gate_into_scan); the other
    backends ignore it. keep_conv: on our path, the conv's output kept for the backward instead of recomputed
    (model.ssd_keep_conv_layers); the other backends ignore it.
    """
    if (A is None) == (A_log is None):
        raise ValueError("mamba_split_conv1d_scan: give A or A_log (A = -exp(A_log)), exactly one of them")
    # Every backend takes the same keyword arguments; only ours adds keep_states and A_log.
    options = dict(
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
    args = (zxbcdt, conv1d_weight, conv1d_bias, dt_bias)
    if use_triton_ssd(backend, zxbcdt):
        return mamba_split_conv1d_scan_triton(
            *args,
            A,
            D,
            chunk_size,
            keep_states=keep_states,
            A_log=A_log,
            fuse_gate=fuse_gate,
            keep_conv=keep_conv,
            **options,
        )
    if A is None:  # at least float32 (a bfloat16 parameter under FSDP's mixed precision), float64 kept
        A = -torch.exp(A_log.to(torch.promote_types(A_log.dtype, torch.float32)))
    fn = _cuda.mamba_split_conv1d_scan_cuda if use_cuda_kernels(backend, zxbcdt) else mamba_split_conv1d_scan_ref
    return fn(*args, A, D, chunk_size, **options)


def linear_cross_entropy_sum(
    h_BSD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_BS: torch.Tensor,
    chunk_tokens: int = 0,
    *,
    backend: str = "auto",
    grad_handoff=None,
) -> torch.Tensor:
    """lm_head (no bias) + the summed token cross-entropy, [B, S, D] -> a float32 scalar (labels IGNORE_INDEX don't
    count). Where the SSD's kernels are ours, one Function that makes the gradients in its forward and never the
    float32 logits (cross_entropy_triton.py; chunk_tokens > 0 bounds its logits buffer; its backward gives the
    weight's gradient to `grad_handoff`, a tied_embedding.GradHandoff, if one is passed); otherwise, with
    chunk_tokens > 0, chunks recomputed in the backward (models.loss.chunked_cross_entropy_sum), else lm_head's
    logits and models.loss.cross_entropy_sum (a handoff then gets nothing: the embedding makes its own gradient)."""
    if use_triton_ssd(backend, h_BSD):
        from models.kernels.cross_entropy_triton import linear_cross_entropy_triton  # lazy: imports triton

        h_ND, labels_N = h_BSD.flatten(0, 1), labels_BS.flatten(0, 1)
        return linear_cross_entropy_triton(h_ND, weight_VD, labels_N, chunk_tokens, IGNORE_INDEX, grad_handoff)
    if chunk_tokens > 0:
        return chunked_cross_entropy_sum(h_BSD, weight_VD, labels_BS, chunk_tokens)
    return cross_entropy_sum(F.linear(h_BSD, weight_VD), labels_BS)
