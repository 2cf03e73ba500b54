"""One-token (recurrent decoding) references with the GPU step kernels' semantics, in pure PyTorch.

- ``selective_state_update_ref``: mamba_ssm.ops.triton.selective_state_update.selective_state_update,
  multi-head form (state [B, H, P, N]), plus a ``dt_limit`` the kernel lacks (the dispatch in step_ops applies
  it outside the kernel). One step of the recurrence the chunked SSD computes in parallel:

      dt = clamp(softplus(dt + dt_bias), dt_limit);  state = exp(dt * A) * state + dt * x B^T
      y = state C + D * x;  y *= silu(z)

- ``causal_conv1d_update_ref``: causal_conv1d.causal_conv1d_update for one token: the state holds the last
  ``state_len >= width - 1`` inputs (oldest first), is shifted left by one with x appended, and the output is
  the depthwise conv of the last ``width`` inputs (then the activation).

Both update the state IN PLACE (as the kernels do) and compute in float32 (float64 for float64 inputs);
the output comes back in x's dtype, the state keeps its own dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.kernels._utils import no_autocast
from models.kernels.ssd_reference import process_dt

__all__ = ["selective_state_update_ref", "causal_conv1d_update_ref"]

_ACTIVATIONS = (None, "silu", "swish")


def _compute_dtype(*ts: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def _check_shape(name: str, t: torch.Tensor | None, shape: tuple[int, ...], meaning: str) -> None:
    if t is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {meaning} = {list(shape)}, got {list(t.shape)}")


def selective_state_update_ref(
    state_BHPN: torch.Tensor,
    x_BHP: torch.Tensor,
    dt_BHP: torch.Tensor,
    A_HPN: torch.Tensor,
    B_BGN: torch.Tensor,
    C_BGN: torch.Tensor,
    D_HP: torch.Tensor | None = None,
    z_BHP: torch.Tensor | None = None,
    dt_bias_HP: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """One SSM step; updates state_BHPN in place and returns y [B, H, P] in x's dtype.

    Shapes are the kernel's multi-head ones; per-head quantities come expanded over P (and N for A), which
    may be stride-0 views (``A_H[:, None, None].expand(H, P, N)``). Heads h use group h // (H / G) of B, C.
    """
    if state_BHPN.dim() != 4:
        raise ValueError(f"state must be [batch, nheads, headdim, dstate], got {list(state_BHPN.shape)}")
    b, H, P, N = state_BHPN.shape
    _check_shape("x", x_BHP, (b, H, P), "[batch, nheads, headdim]")
    _check_shape("dt", dt_BHP, (b, H, P), "[batch, nheads, headdim]")
    _check_shape("A", A_HPN, (H, P, N), "[nheads, headdim, dstate]")
    if B_BGN.dim() != 3 or B_BGN.shape[0] != b or B_BGN.shape[2] != N or H % B_BGN.shape[1]:
        raise ValueError(
            f"B must be [batch, ngroups, dstate] = [{b}, G, {N}] with G dividing {H}, got {list(B_BGN.shape)}"
        )
    _check_shape("C", C_BGN, tuple(B_BGN.shape), "B's shape [batch, ngroups, dstate]")
    _check_shape("D", D_HP, (H, P), "[nheads, headdim]")
    _check_shape("z", z_BHP, (b, H, P), "[batch, nheads, headdim]")
    _check_shape("dt_bias", dt_bias_HP, (H, P), "[nheads, headdim]")
    cdt = _compute_dtype(state_BHPN, x_BHP)
    heads_per_group = H // B_BGN.shape[1]
    with no_autocast(x_BHP.device):
        dt = process_dt(dt_BHP, dt_bias_HP, dt_softplus, dt_limit, cdt)  # [b, H, P]
        B_BHN = B_BGN.to(cdt).repeat_interleave(heads_per_group, dim=1)
        C_BHN = C_BGN.to(cdt).repeat_interleave(heads_per_group, dim=1)
        x = x_BHP.to(cdt)
        dA_BHPN = torch.exp(dt[..., None] * A_HPN.to(cdt))
        new_state = state_BHPN.to(cdt) * dA_BHPN + (dt * x)[..., None] * B_BHN[:, :, None, :]
        state_BHPN.copy_(new_state)
        # The output reads the fp32 state (before rounding it to a bf16 state's dtype), as the kernel does.
        y = torch.einsum("bhpn,bhn->bhp", new_state, C_BHN)
        if D_HP is not None:
            y = y + x * D_HP.to(cdt)
        if z_BHP is not None:
            y = y * F.silu(z_BHP.to(cdt))
    return y.to(x_BHP.dtype)


def causal_conv1d_update_ref(
    x_BD: torch.Tensor,
    conv_state_BDS: torch.Tensor,
    weight_DW: torch.Tensor,
    bias_D: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """One conv step; updates conv_state_BDS [B, D, state_len] in place, returns out [B, D] in x's dtype."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    if x_BD.dim() != 2:
        raise ValueError(f"x must be [batch, dim] (one token), got {list(x_BD.shape)}")
    b, d = x_BD.shape
    if weight_DW.dim() != 2 or weight_DW.shape[0] != d:
        raise ValueError(f"weight must be [dim, width] with dim={d}, got {list(weight_DW.shape)}")
    W = weight_DW.shape[1]
    if conv_state_BDS.dim() != 3 or conv_state_BDS.shape[:2] != (b, d) or conv_state_BDS.shape[2] < W - 1:
        raise ValueError(
            f"conv_state must be [batch, dim, state_len >= width - 1] = [{b}, {d}, >= {W - 1}], "
            f"got {list(conv_state_BDS.shape)}"
        )
    _check_shape("bias", bias_D, (d,), "[dim]")
    cdt = _compute_dtype(x_BD)
    with no_autocast(x_BD.device):
        inputs_BDT = torch.cat([conv_state_BDS, x_BD.to(conv_state_BDS.dtype)[:, :, None]], dim=-1)
        window_BDW = inputs_BDT[:, :, inputs_BDT.shape[-1] - W :].to(cdt)
        out = (window_BDW * weight_DW.to(cdt)).sum(-1)
        if bias_D is not None:
            out = out + bias_D.to(cdt)
        if activation is not None:
            out = F.silu(out)
        conv_state_BDS.copy_(inputs_BDT[:, :, 1:])
    return out.to(x_BD.dtype)
