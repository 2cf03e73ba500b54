"""Depthwise causal conv1d in pure PyTorch, with causal_conv1d_fn's semantics (seq_idx included).

    out[b, d, t] = act(bias[d] + sum_k weight[d, k] * x[b, d, t - (W-1) + k] * [seq[t - (W-1) + k] == seq[t]])

Positions before the start of the row count as zeros; with seq_idx a token never sees inputs of an
earlier document (the CUDA kernel gives those taps id -1 / compares ids the same way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.kernels._utils import no_autocast

__all__ = ["causal_conv1d_ref"]

_ACTIVATIONS = (None, "silu", "swish")


def causal_conv1d_ref(
    x_BDL: torch.Tensor,
    weight_DW: torch.Tensor,
    bias_D: torch.Tensor | None = None,
    seq_idx_BL: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """[B, D, L] -> [B, D, L] in x's dtype; computed in float32 (float64 for float64 x)."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if x_BDL.dim() != 3:
        raise ValueError(f"x must be [batch, dim, seqlen], got shape {tuple(x_BDL.shape)}")
    b, d, L = x_BDL.shape
    if weight_DW.dim() != 2 or weight_DW.shape[0] != d:
        raise ValueError(f"weight must be [dim, width] with dim={d}, got {tuple(weight_DW.shape)}")
    if bias_D is not None and bias_D.shape != (d,):
        raise ValueError(f"bias must be [dim] = [{d}], got {tuple(bias_D.shape)}")
    if seq_idx_BL is not None:
        if seq_idx_BL.shape != (b, L):
            raise ValueError(f"seq_idx must be [batch, seqlen] = {(b, L)}, got {tuple(seq_idx_BL.shape)}")
        if seq_idx_BL.dtype.is_floating_point or seq_idx_BL.dtype == torch.bool:
            raise ValueError(f"seq_idx must be an integer tensor (int32), got {seq_idx_BL.dtype}")
    W = weight_DW.shape[1]
    cdt = torch.float64 if x_BDL.dtype == torch.float64 else torch.float32

    with no_autocast(x_BDL.device):
        xf = x_BDL.to(cdt)
        wf = weight_DW.to(cdt)
        bf = bias_D.to(cdt) if bias_D is not None else None
        if seq_idx_BL is None:
            out = F.conv1d(F.pad(xf, (W - 1, 0)), wf.unsqueeze(1), bf, groups=d)
        else:
            seq = seq_idx_BL.long()
            # Taps left of the row start get id -1, which never matches a real document id (>= 0).
            seq_pad = F.pad(seq, (W - 1, 0), value=-1)
            x_pad = F.pad(xf, (W - 1, 0))
            out = bf[None, :, None].expand(b, d, L) if bf is not None else x_pad.new_zeros(b, d, L)
            for k in range(W):
                keep = (seq_pad[:, k : k + L] == seq).to(cdt)[:, None, :]  # [b, 1, L]
                out = out + wf[None, :, k, None] * x_pad[:, :, k : k + L] * keep
        if activation is not None:
            out = F.silu(out)
    return out.to(x_BDL.dtype)
