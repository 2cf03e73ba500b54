"""The Mamba-2 mixer after in_proj (mamba_split_conv1d_scan_combined's contract) composed from separate ops.

Used by the "triton" backend: causal_conv1d and the gated RMSNorm run the installed GPU kernels (as
"auto" does), the SSD runs our Triton kernels. Same arguments, semantics and outputs as
models.kernels.reference.mamba_split_conv1d_scan_ref, which documents them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.kernels.reference import split_zxbcdt_sizes

__all__ = ["mamba_split_conv1d_scan_composed"]


def mamba_split_conv1d_scan_composed(
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
    *,
    ssd_backend: str,
    other_backend: str = "auto",
):
    from models.kernels import ops  # lazy: an import cycle (ops imports this module for its triton backend)

    if zxbcdt.dim() != 3:
        raise ValueError(f"zxbcdt must be [batch, seqlen, features], got {tuple(zxbcdt.shape)}")
    d_nonssm, dim, dstate, nheads = split_zxbcdt_sizes(zxbcdt.shape[-1], conv1d_weight.shape[0], D, headdim, ngroups)
    headdim = dim // nheads
    if outproj_weight is None and outproj_bias is not None:
        raise ValueError("outproj_bias given without outproj_weight")
    b, L, _ = zxbcdt.shape
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
    # causal_conv1d takes [b, c, L]; the transposed view is channel-last, which its seq_idx path needs.
    xBC = ops.causal_conv1d(
        xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx, activation, backend=other_backend
    ).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    out = ops.ssd_chunk_scan(
        x.reshape(b, L, nheads, headdim),
        dt,
        A,
        B.reshape(b, L, ngroups, dstate),
        C.reshape(b, L, ngroups, dstate),
        chunk_size,
        D=D,
        z=z.reshape(b, L, nheads, headdim) if rmsnorm_weight is None else None,
        dt_bias=dt_bias,
        dt_softplus=True,
        dt_limit=dt_limit,
        seq_idx=seq_idx,
        initial_states=initial_states,
        return_final_states=return_final_states,
        backend=ssd_backend,
    )
    out, final_states = out if return_final_states else (out, None)
    y = out.reshape(b, L, dim)
    if rmsnorm_weight is not None:
        y = ops.rmsnorm_gated(
            y,
            rmsnorm_weight,
            z=z,
            eps=rmsnorm_eps,
            group_size=dim // ngroups,
            norm_before_gate=norm_before_gate,
            backend=other_backend,
        )
    if d_nonssm > 0:
        x0, x1 = zx0.to(torch.promote_types(zx0.dtype, torch.float32)).chunk(2, dim=-1)
        y = torch.cat([(F.silu(x0) * x1).to(y.dtype), y], dim=-1)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, final_states) if return_final_states else y
