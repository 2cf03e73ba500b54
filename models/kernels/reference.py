"""Pure-PyTorch references for every GPU kernel the model uses, plus the fused Mamba-2 mixer path.

Each reference has the GPU kernel's signature and semantics (seq_idx included) and is differentiable
by autograd; they run on any device and are what the CPU path of the model calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.kernels.conv_reference import causal_conv1d_ref
from models.kernels.norm_reference import add_rmsnorm_ref, rmsnorm_gated_ref
from models.kernels.ssd_reference import ssd_chunk_scan_ref

__all__ = [
    "ssd_chunk_scan_ref",
    "causal_conv1d_ref",
    "rmsnorm_gated_ref",
    "add_rmsnorm_ref",
    "mamba_split_conv1d_scan_ref",
    "split_zxbcdt_sizes",
]


def split_zxbcdt_sizes(
    zxbcdt_width: int, conv_dim: int, D: torch.Tensor, headdim: int | None, ngroups: int
) -> tuple[int, int, int, int]:
    """(d_nonssm, dim, dstate, nheads) for zxbcdt = [zx0 (2*d_nonssm) | z (dim) | xBC | dt (nheads)].

    conv_dim is conv1d_weight.shape[0] = dim + 2 * ngroups * dstate. Raises on inconsistent sizes.
    """
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("headdim must be given when D is 1-D [nheads]")
        nheads = D.shape[0]
    elif D.dim() == 2:
        nheads, headdim = D.shape
    else:
        raise ValueError(f"D must be [nheads] or [nheads, headdim], got {tuple(D.shape)}")
    if nheads % ngroups:
        raise ValueError(f"ngroups={ngroups} must divide nheads={nheads}")
    dim = nheads * headdim
    if conv_dim <= dim or (conv_dim - dim) % (2 * ngroups):
        raise ValueError(
            f"conv1d_weight.shape[0]={conv_dim} must be dim + 2*ngroups*dstate with dim=nheads*headdim={dim}, "
            f"ngroups={ngroups}"
        )
    dstate = (conv_dim - dim) // (2 * ngroups)
    rest = zxbcdt_width - 2 * dim - 2 * ngroups * dstate - nheads
    if rest < 0 or rest % 2:
        raise ValueError(
            f"zxbcdt last dim {zxbcdt_width} must be 2*d_nonssm + 2*dim + 2*ngroups*dstate + nheads "
            f"(dim={dim}, ngroups={ngroups}, dstate={dstate}, nheads={nheads})"
        )
    return rest // 2, dim, dstate, nheads


def mamba_split_conv1d_scan_ref(
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
):
    """Reference for mamba_ssm's mamba_split_conv1d_scan_combined (the whole Mamba-2 mixer after in_proj).

    zxbcdt: [B, L, 2*d_nonssm + 2*dim + 2*ngroups*dstate + nheads] = [zx0 | z | xBC | dt].
    conv (with seq_idx) + activation on xBC -> x, B, C; SSD with dt_softplus=True. Without
    rmsnorm_weight, y = ssd(...) * silu(z); with it, y = gated RMSNorm(ssd(...), z) over groups of
    dim // ngroups channels. A d_nonssm > 0 prefix adds silu(zx0[:d]) * zx0[d:] before y. Finally the
    optional out projection. Returns out [B, L, out_dim or dim] (and final_states [B, H, P, N]).
    """
    if zxbcdt.dim() != 3:
        raise ValueError(f"zxbcdt must be [batch, seqlen, features], got {tuple(zxbcdt.shape)}")
    d_nonssm, dim, dstate, nheads = split_zxbcdt_sizes(zxbcdt.shape[-1], conv1d_weight.shape[0], D, headdim, ngroups)
    headdim = dim // nheads
    if outproj_weight is None and outproj_bias is not None:
        raise ValueError("outproj_bias given without outproj_weight")
    b, L, _ = zxbcdt.shape
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, nheads], dim=-1)

    xBC = causal_conv1d_ref(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx, activation).transpose(1, 2)
    x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(b, L, nheads, headdim)
    B = B.reshape(b, L, ngroups, dstate)
    C = C.reshape(b, L, ngroups, dstate)
    z_BLHP = z.reshape(b, L, nheads, headdim)

    out = ssd_chunk_scan_ref(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=D,
        z=z_BLHP if rmsnorm_weight is None else None,
        dt_bias=dt_bias,
        dt_softplus=True,
        dt_limit=dt_limit,
        seq_idx=seq_idx,
        initial_states=initial_states,
        return_final_states=return_final_states,
    )
    out, final_states = out if return_final_states else (out, None)
    y = out.reshape(b, L, dim)
    if rmsnorm_weight is not None:
        y = rmsnorm_gated_ref(
            y, rmsnorm_weight, z=z, eps=rmsnorm_eps, group_size=dim // ngroups, norm_before_gate=norm_before_gate
        )
    if d_nonssm > 0:
        x0, x1 = zx0.to(torch.promote_types(zx0.dtype, torch.float32)).chunk(2, dim=-1)
        y = torch.cat([(F.silu(x0) * x1).to(y.dtype), y], dim=-1)
    if outproj_weight is not None:
        y = F.linear(y, outproj_weight, outproj_bias)
    return (y, final_states) if return_final_states else y
