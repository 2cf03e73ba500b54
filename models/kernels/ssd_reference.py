"""Chunked SSD (Mamba-2 state-space dual) in pure PyTorch, with mamba_ssm's kernel semantics.

Same signature and meaning as ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``:

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t B_t^T        (per head; h is [P, N])
    y_t = C_t h_t + D * x_t,   then  y_t *= silu(z_t)

computed chunk by chunk (intra-chunk quadratic form, chunk states, inter-chunk recurrence,
state-to-output), so the largest temporaries are [chunk, chunk] per head and chunk, never [L, L].

Document boundaries (seq_idx): the decay between positions t >= s is multiplied by
[seq_t == seq_s] everywhere. The initial state sits at "position -1" with document id 0, exactly as
the Triton kernels treat it (state passing starts from seq id 0, the state-to-output term of chunk
0 compares against 0), so it only reaches tokens of document 0.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models.kernels._utils import can_inspect_values, no_autocast

__all__ = ["ssd_chunk_scan_ref", "process_dt"]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # float64 stays float64 (tests against naive recurrences); everything else runs in float32 as the kernels do.
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def process_dt(
    dt_BLH: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    dtype: torch.dtype,
) -> torch.Tensor:
    """dt -> (dt + dt_bias) -> softplus -> clamp(dt_limit), in ``dtype``.

    The kernels clamp unconditionally, so with the default limit (0, inf) a negative dt (no softplus)
    becomes 0 and gets no gradient; we do the same.
    """
    dt = dt_BLH.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)  # threshold 20, as the kernels' softplus
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _check_inputs(x, dt, A, B, C, chunk_size, D, z, dt_bias, seq_idx, initial_states):
    if x.dim() != 4:
        raise ValueError(f"x must be [batch, seqlen, nheads, headdim], got shape {tuple(x.shape)}")
    b, L, H, P = x.shape
    if B.dim() != 4 or B.shape[:2] != (b, L):
        raise ValueError(f"B must be [batch, seqlen, ngroups, dstate] = [{b}, {L}, G, N], got {tuple(B.shape)}")
    G, N = B.shape[2:]
    if C.shape != B.shape:
        raise ValueError(f"C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    if H % G:
        raise ValueError(f"ngroups={G} must divide nheads={H}")
    if dt.shape != (b, L, H):
        raise ValueError(f"dt must be [batch, seqlen, nheads] = {(b, L, H)}, got {tuple(dt.shape)}")
    if A.shape != (H,):
        raise ValueError(f"A must be [nheads] = [{H}], got {tuple(A.shape)}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if D is not None and D.shape not in ((H,), (H, P)):
        raise ValueError(f"D must be [nheads] or [nheads, headdim] = [{H}] or [{H}, {P}], got {tuple(D.shape)}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must have x's shape {tuple(x.shape)}, got {tuple(z.shape)}")
    if dt_bias is not None and dt_bias.shape != (H,):
        raise ValueError(f"dt_bias must be [nheads] = [{H}], got {tuple(dt_bias.shape)}")
    if initial_states is not None and initial_states.shape != (b, H, P, N):
        raise ValueError(
            f"initial_states must be [batch, nheads, headdim, dstate] = {(b, H, P, N)}, "
            f"got {tuple(initial_states.shape)}"
        )
    if seq_idx is not None:
        if seq_idx.shape != (b, L):
            raise ValueError(f"seq_idx must be [batch, seqlen] = {(b, L)}, got {tuple(seq_idx.shape)}")
        if seq_idx.dtype.is_floating_point or seq_idx.dtype == torch.bool:
            raise ValueError(f"seq_idx must be an integer tensor (int32), got {seq_idx.dtype}")
        if L > 1 and can_inspect_values(seq_idx) and bool((seq_idx[:, 1:] < seq_idx[:, :-1]).any()):
            raise ValueError("seq_idx must be non-decreasing along each row (document index, starting at 0)")


def ssd_chunk_scan_ref(
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
):
    """Reference for mamba_chunk_scan_combined.

    Returns y [B, L, H, P] in x's dtype, and with return_final_states also the state after the last
    token [B, H, P, N] in float32 (float64 for float64 inputs), like the kernel. chunk_size need not
    divide L. Differentiable by autograd; autocast is disabled inside (the kernels ignore it too).
    """
    _check_inputs(x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, chunk_size, D, z, dt_bias, seq_idx, initial_states)
    cdt = _compute_dtype(x_BLHP)
    with no_autocast(x_BLHP.device):
        y_BLHP, final_BHPN = _ssd_chunked(
            x_BLHP,
            dt_BLH,
            A_H,
            B_BLGN,
            C_BLGN,
            chunk_size,
            D,
            z,
            dt_bias,
            dt_softplus,
            dt_limit,
            seq_idx,
            initial_states,
            cdt,
        )
    y_BLHP = y_BLHP.to(x_BLHP.dtype)
    return (y_BLHP, final_BHPN) if return_final_states else y_BLHP


def _ssd_chunked(x, dt, A, B, C, cs, D, z, dt_bias, dt_softplus, dt_limit, seq_idx, initial_states, cdt):
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    R = H // G  # heads per group
    nc = math.ceil(L / cs)
    pad = nc * cs - L

    dt = process_dt(dt, dt_bias, dt_softplus, dt_limit, cdt)
    xf, Bf, Cf = x.to(cdt), B.to(cdt), C.to(cdt)
    if pad:
        # Padded tokens have dt = x = B = C = 0: they neither decay nor add to any state (as the kernels' masks).
        xf = F.pad(xf, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        Bf = F.pad(Bf, (0, 0, 0, 0, 0, pad))
        Cf = F.pad(Cf, (0, 0, 0, 0, 0, pad))
    seq = None
    if seq_idx is not None:
        seq = seq_idx.long()
        if pad:
            # Repeat the last id so the "last token of the chunk" is the last real token, as the kernels use.
            seq = torch.cat([seq, seq[:, -1:].expand(b, pad)], dim=1)
        seq = seq.view(b, nc, cs)

    # Chunked views; heads split as (group, head-in-group) so B / C are never repeated per head.
    x_c = xf.view(b, nc, cs, G, R, P)
    B_c = Bf.view(b, nc, cs, G, N)
    C_c = Cf.view(b, nc, cs, G, N)
    dt_c = dt.view(b, nc, cs, G, R).permute(0, 1, 3, 4, 2)  # [b, nc, G, R, cs]
    dAcs = torch.cumsum(dt_c * A.to(cdt).view(1, 1, G, R, 1), dim=-1)  # [b, nc, G, R, cs]

    neg_inf = torch.tensor(float("-inf"), dtype=cdt, device=x.device)

    # 1) Intra-chunk (diagonal blocks): y_l = sum_{s<=l, same doc} C_l.B_s exp(cs_l - cs_s) dt_s x_s.
    causal = torch.ones(cs, cs, dtype=torch.bool, device=x.device).tril()
    mask_ls = causal.view(1, 1, 1, 1, cs, cs)
    if seq is not None:
        same = seq[:, :, :, None] == seq[:, :, None, :]  # [b, nc, cs, cs]
        mask_ls = mask_ls & same[:, :, None, None]
    # The exponent is masked (not the exp) so no inf * 0 can appear in forward or backward.
    decay_ls = torch.where(mask_ls, dAcs[..., :, None] - dAcs[..., None, :], neg_inf).exp()
    CB = torch.einsum("bclgn,bcsgn->bcgls", C_c, B_c)  # [b, nc, G, cs, cs]
    W = CB[:, :, :, None] * decay_ls * dt_c[..., None, :]  # [b, nc, G, R, cs, cs]
    y_diag = torch.einsum("bcgrls,bcsgrp->bclgrp", W, x_c)

    # 2) Chunk states: the state at the chunk's last token from its own tokens (same doc as that token).
    last = dAcs[..., -1:]
    if seq is not None:
        same_last = (seq == seq[:, :, -1:])[:, :, None, None, :]  # [b, nc, 1, 1, cs]
        decay_s = torch.where(same_last, last - dAcs, neg_inf).exp()
    else:
        decay_s = (last - dAcs).exp()
    xw = x_c * (decay_s * dt_c).permute(0, 1, 4, 2, 3)[..., None]  # [b, nc, cs, G, R, P]
    states = torch.einsum("bcsgn,bcsgrp->bcgrpn", B_c, xw)  # [b, nc, G, R, P, N]

    # 3) Inter-chunk recurrence H_c = exp(tot_c) [same doc] H_{c-1} + states_c, H_{-1} = initial (doc 0),
    #    written as one small lower-triangular [nc+1, nc+1] product per head.
    tot = dAcs[..., -1]  # [b, nc, G, R]: total decay exponent of each chunk
    cumT = torch.cumsum(F.pad(tot, (0, 0, 0, 0, 1, 0)), dim=1)  # [b, nc+1, G, R]
    mask_zc = torch.ones(nc + 1, nc + 1, dtype=torch.bool, device=x.device).tril().view(1, nc + 1, nc + 1)
    if seq is not None:
        # Document of each boundary state: 0 for the initial state, then the last token of each chunk.
        seq_bound = F.pad(seq[:, :, -1], (1, 0), value=0)  # [b, nc+1]
        mask_zc = mask_zc & (seq_bound[:, :, None] == seq_bound[:, None, :])
    decay_zc = torch.where(
        mask_zc[..., None, None], cumT[:, :, None] - cumT[:, None, :], neg_inf
    ).exp()  # [b, nc+1, nc+1, G, R]
    if initial_states is not None:
        init = initial_states.to(cdt).view(b, 1, G, R, P, N)
    else:
        init = torch.zeros(b, 1, G, R, P, N, dtype=cdt, device=x.device)
    states_all = torch.cat([init, states], dim=1)  # [b, nc+1, G, R, P, N]
    bound = torch.einsum("bzcgr,bcgrpn->bzgrpn", decay_zc, states_all)  # [b, nc+1, G, R, P, N]
    state_in = bound[:, :-1]  # the state entering chunk c
    final = bound[:, -1].reshape(b, H, P, N)

    # 4) State-to-output: y_l += exp(cs_l) C_l . state_in, for tokens of the document that state belongs to.
    if seq is not None:
        same_prev = (seq == seq_bound[:, :-1, None])[:, :, None, None, :]  # [b, nc, 1, 1, cs]
        decay_out = torch.where(same_prev, dAcs, neg_inf).exp()
    else:
        decay_out = dAcs.exp()
    y_off = torch.einsum("bclgn,bcgrpn->bclgrp", C_c, state_in)
    y_off = y_off * decay_out.permute(0, 1, 4, 2, 3)[..., None]

    y = (y_diag + y_off).reshape(b, nc * cs, H, P)[:, :L]
    if D is not None:
        Df = D.to(cdt)
        y = y + xf[:, :L] * (Df if Df.dim() == 2 else Df[:, None])
    if z is not None:
        y = y * F.silu(z.to(cdt))
    return y, final
