"""The chunked SSD as one autograd Function over our Triton kernels, plus the public entry point.

Split of the work:
  - the Function ``_SSDChunked`` takes dt as given ([B, L, H], any dtype) with A, dt_bias, softplus and the dt
    limits: dt.py's kernel makes the float32 [B, H, NC, Q] dt_p and the within-chunk cumulative decay
    a = cumsum(dt_p A) (the last chunk padded with dt = 0, so padding neither decays nor adds; with config fold_dt
    also a2dt, dt in the decay's exponent for the chunk scan and dCB), and its backward twin turns the kernels'
    gradients into those of dt, A and dt_bias in one pass. In between, the kernels: forward.py's CB -> the chained
    chunk states and recurrence (chained_states.py; or the staged chunk states -> state passing)
    -> chunk scan; backward.py's recompute of CB and the states entering each chunk (unless config keep_states kept
    them), dS_in and the reverse recurrence, dx / ddt / dD, dCB and the decay terms, dB, and dC / dB finished per
    group (that module's docstring). The z gate is a PyTorch op after it.

The gradient with respect to dA_t (before the cumsum) is, within its chunk, the sum of four parts:
    sum_{l >= t} O_l            y's state term (O from the dCB kernel)
  + R_t                         intra-chunk pairs (l >= t > s) whose decay spans t (same kernel, as row minus
                                column sums of float32 terms, whose reverse cumsum is R: dcb_bwd.py)
  + sum_{s < t} q_s             chunk-state terms: exp(a_last - a_s) spans t for s < t (dx kernel)
  + dtot_c                      the decay between chunks, exp(a_last), spans every t (state passing).
A first version formed these from bf16-rounded sums subtracted from each other and lost two digits; every term
here is float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F

from models.kernels._utils import no_autocast
from models.kernels.ssd_reference import _check_inputs
from models.kernels.ssd_triton.backward import ssd_backward_kernels
from models.kernels.ssd_triton.config import block_config
from models.kernels.ssd_triton.dt import dt_backward, dt_forward
from models.kernels.ssd_triton.forward import ssd_forward

__all__ = ["ssd_chunk_scan_triton", "ssd_forward_pass", "ssd_backward_pass", "prepare_inputs", "check_seq_idx_shape"]


def ssd_forward_pass(
    x, dt, A, dt_bias, B, C, D, init, seq, Q, cfg, y_dtype, softplus, dt_limit, a_is_log=False, gate=None
):
    """The forward outside autograd: (y, final_states, saved), where ``saved`` is what ssd_backward_pass needs
    (inputs plus the float32 dt_p, within-chunk decay a and, with config fold_dt, a2dt (else None), [B, H, NC, Q]
    each; and last the entering states [K, B, NC, H, P, N] with config keep_states, else None: then nothing of that
    size is kept). a_is_log: A holds A_log (A = -exp(A_log) in the dt kernels; ssd_backward_pass then returns A_log's
    gradient and must be told so too)."""
    NC = math.ceil(x.shape[1] / Q)
    dt_p, dA_cs, a2dt = dt_forward(dt, dt_bias, A, Q, NC, softplus, dt_limit, cfg.fold_dt, a_is_log=a_is_log)
    y, final, S_kept = ssd_forward(x, dt_p, dA_cs, B, C, D, seq, init, cfg, y_dtype, a2dt, gate)
    return y, final, (x, dt, A, dt_bias, dt_p, dA_cs, a2dt, B, C, D, init, seq, S_kept)


def ssd_backward_pass(saved, dy, dfinal, Q, cfg, softplus, dt_limit, out=None, ddt_out=None, a_is_log=False):
    """The backward outside autograd, from ssd_forward_pass's ``saved``: (dx, ddt, dA, ddt_bias, dB, dC, dD, dinit);
    dD is None without D, dinit is None without initial states. out: (dx, dB, dC) to write into (see
    backward.ssd_backward_kernels);
    ddt_out: [B, L, H] in dt's dtype to write ddt into (any strides), else it is allocated. a_is_log: as the
    forward's (dA is then A_log's gradient)."""
    x, dt, A, dt_bias, dt_p, dA_cs, a2dt, B, C, D, init, seq, S_kept = saved
    # A float32 dy (y kept in float32 for the z gate) is rounded to x's dtype for the kernels; dD uses it as given.
    dy_exact = dy if dy.dtype != x.dtype else None
    dy = dy.to(x.dtype).contiguous()
    dfinal = None if dfinal is None else dfinal.float().contiguous()
    dx, ddt_p, decay_parts, dB, dC, (dD, dD_parts), dinit = ssd_backward_kernels(
        dy, dfinal, x, dt_p, dA_cs, B, C, D, seq, init, Q, cfg, dy_exact, out, S_kept, a2dt
    )
    ddt, dA, ddt_bias, dD_summed = dt_backward(
        dt, dt_bias, A, ddt_p, *decay_parts, softplus, dt_limit, dD_parts, ddt_out=ddt_out, a_is_log=a_is_log
    )
    if dD_parts is not None:
        dD = dD_summed
    return dx, ddt, dA, ddt_bias, dB, dC, dD, dinit if init is not None else None


class _SSDChunked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dt, A, dt_bias, B, C, D, init, seq, Q, cfg, y_dtype, softplus, dt_limit):
        y, final, saved = ssd_forward_pass(x, dt, A, dt_bias, B, C, D, init, seq, Q, cfg, y_dtype, softplus, dt_limit)
        ctx.save_for_backward(*saved)
        ctx.Q, ctx.cfg, ctx.softplus, ctx.dt_limit = Q, cfg, softplus, dt_limit
        ctx.y_meta = (y.shape, y.dtype)
        # An unused output (the final states, under context parallel or in training) reaches backward as None, not
        # as a zero tensor autograd fills and the chained dstates then read
        ctx.set_materialize_grads(False)
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        if dy is None:  # only the final states were used
            shape, dtype = ctx.y_meta
            dy = torch.zeros(shape, device=ctx.saved_tensors[0].device, dtype=dtype)
        grads = ssd_backward_pass(ctx.saved_tensors, dy, dfinal, ctx.Q, ctx.cfg, ctx.softplus, ctx.dt_limit)
        return (*grads, None, None, None, None, None, None)


def check_seq_idx_shape(seq_idx, b: int, L: int) -> None:
    """seq_idx must be an integer [b, L] tensor (its values are checked where that costs no device sync)."""
    if tuple(seq_idx.shape) != (b, L) or seq_idx.dtype.is_floating_point or seq_idx.dtype == torch.bool:
        raise ValueError(
            f"seq_idx must be an integer [batch, seqlen] = {(b, L)} tensor (int32), got "
            f"{seq_idx.dtype} {tuple(seq_idx.shape)}"
        )


def prepare_inputs(
    x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, chunk_size, D, z, dt_bias, seq_idx, initial_states, keep_states=False
):
    """Checks the inputs (before any kernel runs) and brings them to the kernels' dtypes and layouts:
    (A, B, C, D, init, seq, cfg) with A / D / init in float32, B / C in x's dtype, seq int32; cfg is the shape's
    block_config, with keep_states switched on when asked (config.py: speed for memory)."""
    _check_inputs(x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, chunk_size, D, z, dt_bias, None, initial_states)
    b, L, H, P = x_BLHP.shape
    if seq_idx is not None:
        check_seq_idx_shape(seq_idx, b, L)
        if not seq_idx.is_cuda:
            # The non-decreasing check reads values; on CUDA that would synchronise the device on every call
            # (every layer of every step), so there, as in mamba_ssm, it is the caller's contract.
            _check_inputs(x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, chunk_size, D, z, dt_bias, seq_idx, initial_states)
    dtype = x_BLHP.dtype
    cfg = block_config(chunk_size, P, B_BLGN.shape[-1])
    return (
        A_H.float(),
        B_BLGN.to(dtype),
        C_BLGN.to(dtype),
        None if D is None else D.float().contiguous(),
        None if initial_states is None else initial_states.float().contiguous(),
        None if seq_idx is None else seq_idx.to(torch.int32).contiguous(),
        _with_kept_states(cfg) if keep_states and not cfg.keep_states else cfg,
    )


@functools.cache  # dataclasses.replace costs ~18 us of host, in every layer's forward
def _with_kept_states(cfg):
    return dataclasses.replace(cfg, keep_states=True)


def ssd_chunk_scan_triton(
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
    keep_states: bool = False,
):
    """Our Triton chunked SSD: ssd_chunk_scan_ref's signature, semantics and output dtypes.

    y [B, L, H, P] in x's dtype (, final_states [B, H, P, N] float32). B and C are used in x's dtype
    (their gradients come back in their own). Any chunk size >= 1 and any length work; CUDA tensors,
    or CPU tensors under TRITON_INTERPRET=1 (the CPU tests). seq_idx must be non-decreasing along each
    row (checked on the CPU only: on CUDA the check would synchronise the device on every call). dt must not be
    negative (with dt_softplus off, a dt_limit below 0 is refused): the kernels clamp every decay at 1.
    keep_states: the forward's entering states kept for the backward instead of recomputed there (faster, and
    [B, L / chunk_size, H, P, N] x 4 bytes more held from forward to backward; config.py's keep_states).
    """
    if not dt_softplus and dt_limit[0] < 0:
        raise ValueError(
            f"dt_limit's lower bound {dt_limit[0]} lets dt be negative (dt_softplus is off): our kernels, like "
            "mamba_ssm's, clamp every decay exp(A dt) within a chunk at 1, so they would not compute what the "
            "reference does; use a lower bound >= 0 or dt_softplus=True"
        )
    with no_autocast(x_BLHP.device):
        A, B, C, D, init, seq, cfg = prepare_inputs(
            x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, chunk_size, D, z, dt_bias, seq_idx, initial_states, keep_states
        )
        dtype = x_BLHP.dtype
        y, final = _SSDChunked.apply(
            x_BLHP,
            dt_BLH,
            A,
            dt_bias,
            B,
            C,
            D,
            init,
            seq,
            chunk_size,
            cfg,
            # With z, y stays float32 until after the gate: one rounding to x's dtype, as in a fused gate.
            torch.float32 if z is not None else dtype,
            dt_softplus,
            (float(dt_limit[0]), float(dt_limit[1])),
        )
        if z is not None:
            y = (y.float() * F.silu(z.float())).to(dtype)
    return (y, final) if return_final_states else y
