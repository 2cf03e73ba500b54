"""The one-token ops of recurrent decoding: mamba_ssm / causal_conv1d step kernels on CUDA, references elsewhere.

``backend`` means what it means in models.kernels.ops: "auto" (the kernels for CUDA tensors when they import,
else the reference), "reference", "mamba_ssm" or its older name "cuda" (the kernels or a clear error), "triton"
(our Triton kernels have no step kernel: as "auto"). The kernels are imported on first use, never at module
import, by models/kernels/cuda.py's loader (with the training kernels: one import, one cached error).
"""

from __future__ import annotations

import torch

from models.kernels.cuda import cuda_kernels_available, cuda_kernels_import_error, kernels
from models.kernels.ssd_reference import process_dt
from models.kernels.step_reference import causal_conv1d_update_ref, selective_state_update_ref

__all__ = ["selective_state_update", "causal_conv1d_update"]

BACKENDS = ("auto", "triton", "mamba_ssm", "reference", "cuda")


def _use_kernels(backend: str, t: torch.Tensor) -> bool:
    if backend == "reference":
        return False
    if backend in ("auto", "triton"):
        return t.is_cuda and cuda_kernels_available()
    if backend in ("mamba_ssm", "cuda"):
        if not t.is_cuda:
            raise ValueError(f"backend={backend!r} needs CUDA tensors, got a tensor on {t.device}; use backend='auto'")
        if not cuda_kernels_available():
            raise RuntimeError(
                f"backend={backend!r} but the step kernels are unavailable ({cuda_kernels_import_error()}); install "
                "mamba-ssm and causal-conv1d, or use backend='auto' / 'reference'"
            )
        return True
    raise ValueError(f"backend={backend!r} is unknown; choose one of {BACKENDS}")


def selective_state_update(
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
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """One SSM step (see step_reference.selective_state_update_ref); updates the state in place, returns y."""
    if not _use_kernels(backend, x_BHP):
        return selective_state_update_ref(
            state_BHPN, x_BHP, dt_BHP, A_HPN, B_BGN, C_BGN, D_HP, z_BHP, dt_bias_HP, dt_softplus, dt_limit
        )
    if tuple(dt_limit) != (0.0, float("inf")):
        # The kernel has no clamp: hand it the final dt (bias, softplus and clamp in fp32, as the reference).
        # contiguous: the kernel's "tied head dim" test reads dt_bias.stride() unless dt's last stride is non-zero.
        dt_BHP = process_dt(dt_BHP, dt_bias_HP, dt_softplus, dt_limit, torch.float32).contiguous()
        dt_bias_HP, dt_softplus = None, False
    # mamba_ssm 2.3's launcher unpacks dt_bias.stride() and D.stride() unconditionally (`*(...) if x is not None
    # else 0` is a TypeError for None): zeros are the same step.
    H, P = x_BHP.shape[-2:]
    if dt_bias_HP is None:
        dt_bias_HP = x_BHP.new_zeros(H, P, dtype=torch.float32)
    if D_HP is None:
        D_HP = x_BHP.new_zeros(H, P, dtype=torch.float32)
    return kernels()["selective_state_update"](
        state_BHPN, x_BHP, dt_BHP, A_HPN, B_BGN, C_BGN, D=D_HP, z=z_BHP, dt_bias=dt_bias_HP, dt_softplus=dt_softplus
    )


def causal_conv1d_update(
    x_BD: torch.Tensor,
    conv_state_BDS: torch.Tensor,
    weight_DW: torch.Tensor,
    bias_D: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """One conv step (see step_reference.causal_conv1d_update_ref); updates conv_state in place, returns out."""
    width = weight_DW.shape[-1]
    if backend == "cuda" and not 2 <= width <= 4:
        raise ValueError(f"causal_conv1d_update supports conv widths 2..4, got d_conv={width}; use backend='auto'")
    if not (2 <= width <= 4 and _use_kernels(backend, x_BD)):
        return causal_conv1d_update_ref(x_BD, conv_state_BDS, weight_DW, bias_D, activation)
    # The kernel wants x, the state, the weight and the bias in one dtype: the state's (the model's dtype unless
    # the cache was allocated otherwise, e.g. fp32 weights under autocast).
    dtype = conv_state_BDS.dtype
    out_BD = kernels()["causal_conv1d_update"](
        x_BD.to(dtype),
        conv_state_BDS,
        weight_DW.to(dtype).contiguous(),
        None if bias_D is None else bias_D.to(dtype),
        activation,
    )
    return out_BD.to(x_BD.dtype)
