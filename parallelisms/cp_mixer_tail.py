"""The Mamba-2 mixer after in_proj under context parallel, as ONE autograd node: conv -> SSD -> all-to-all back to the
sequence layout -> gated RMSNorm -> out_proj (parallelisms/context_parallel.py's hooks around it).

Why: the CP step at 1.3B / 32k tokens is bound by the host (docs/performance.md, sessions 27-29): the unfused tail
is a conv node, the SSD's node, the all-to-all's node, the norm's node, out_proj's product with autocast's cast and a
few view nodes per layer, each paid three times per step under full activation checkpointing (forward, recompute,
backward). Without CP the model runs the same chain as one node (models/kernels/split_conv1d_scan.py's
_MixerFunction, mamba_ssm's fused mixer); this is that node with the all-to-all inside: on CUDA the conv and the norm
run as bare kernel halves (no autograd inside), out_proj's backward by hand, the conv and out_proj's input recomputed
in the backward instead of kept. Elsewhere (the CPU, under TRITON_INTERPRET=1) the conv and the norm run through
ops and autograd, as _MixerFunction does: the same function, so CI tests it.

Used by models/mamba2/mixer.py under CP where the non-CP mixer would use the fused path (model.use_fused_path, our
Triton SSD); mamba_ssm's kernels and the references keep the unfused chain.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The fused mixer's building blocks; the kernel halves are read as scs.<name> (tests stand references in for them).
from models.kernels import cuda as _cuda
from models.kernels import split_conv1d_scan as scs
from models.kernels._utils import no_autocast
from models.kernels.autocast_linear import weight_grad
from models.kernels.split_conv1d_scan import _conv, _gate_norm, _leaf, _rows, _Sizes
from models.kernels.weight_copies import compute_weight

__all__ = ["cp_mixer_tail"]


class _CPMixerTail(torch.autograd.Function):
    """See cp_mixer_tail. Keeps the input xBCdt (heads layout), z, the SSD's output y in the sequence layout, its
    float32 dt / decay and the norm's 1 / rms (the kernel-halves path), as _MixerFunction keeps zxbcdt and y."""

    @staticmethod
    def forward(ctx, z_BSE, xBCdt_BLd, conv_w, conv_b, dt_bias, A, D, norm_w, out_w, out_b, seq, s, norm_s, cp):
        from models.kernels.ssd_triton.autograd import prepare_inputs, ssd_forward_pass

        conv_dim = s.dim + 2 * s.ngroups * s.dstate
        xBC_in, dt = xBCdt_BLd.split([conv_dim, s.nheads], dim=-1)
        seq = None if seq is None else seq.to(torch.int32).contiguous()
        halves = scs._kernel_halves_on(xBCdt_BLd, s)
        xBC = (
            scs._conv_forward_halves(xBC_in, conv_w, conv_b, seq, s)
            if halves
            else _conv(xBC_in, conv_w, conv_b, seq, s)
        )
        x, B, C = s.ssd_operands(xBC)
        A32, B, C, D32, _, seq, cfg = prepare_inputs(
            x, dt, A, B, C, s.chunk_size, D, None, dt_bias, seq, None, s.keep_states
        )
        y, _, saved = ssd_forward_pass(x, dt, A32, dt_bias, B, C, D32, None, seq, s.chunk_size, cfg, x.dtype, True,
                                       s.dt_limit)  # fmt: skip
        del xBC, x, B, C
        # [b, s, d_inner / cp] this rank's heads -> [b, s / cp, d_inner] this rank's tokens
        y_BSE = cp.heads_to_seq_tensor(y.reshape(*xBCdt_BLd.shape[:2], s.dim))
        rstd = None
        if halves:  # the norm's 1 / rms per row and group, kept for its backward
            h, rstd = _cuda.gated_rmsnorm_forward(
                _rows(y_BSE), norm_w, _rows(z_BSE), norm_s.rmsnorm_eps, norm_s.dim // norm_s.ngroups,
                norm_s.norm_before_gate,
            )  # fmt: skip
            h = h.view(y_BSE.shape)
        else:
            h = _gate_norm(y_BSE, z_BSE, None, norm_w, norm_s)
        out = F.linear(h, compute_weight(out_w, h.dtype), None if out_b is None else out_b.to(h.dtype))
        dt_p, dA_cs, S_kept = saved[4], saved[5], saved[-1]  # S_kept: None unless config keep_states
        ctx.save_for_backward(z_BSE, xBCdt_BLd, conv_w, conv_b, dt_bias, A32, D32, norm_w, out_w, out_b, seq, y_BSE,
                              dt_p, dA_cs, rstd, S_kept)  # fmt: skip
        ctx.s, ctx.norm_s, ctx.cp, ctx.cfg, ctx.halves = s, norm_s, cp, cfg, halves
        ctx.dtypes = (A.dtype, D.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        from models.kernels.ssd_triton.autograd import ssd_backward_pass

        s, norm_s, cp, cfg, needs = ctx.s, ctx.norm_s, ctx.cp, ctx.cfg, ctx.needs_input_grad
        z, xBCdt, conv_w, conv_b, dt_bias, A32, D32, norm_w, out_w, out_b, seq, y_BSE, dt_p, dA_cs, rstd, S_kept = (
            ctx.saved_tensors
        )
        conv_dim = s.dim + 2 * s.ngroups * s.dstate
        xBC_in, dt = xBCdt.split([conv_dim, s.nheads], dim=-1)
        dout_2d = dout.reshape(-1, dout.shape[-1]).to(y_BSE.dtype)
        dh = (dout_2d @ compute_weight(out_w, y_BSE.dtype)).view(y_BSE.shape)  # out_proj's input gradient
        dout_b = dout_2d.sum(0).to(out_b.dtype) if out_b is not None and needs[9] else None
        dout_w = dnorm_w = None
        if ctx.halves:
            dz = torch.empty_like(z)
            dy_BSE, dnorm_w, h = _cuda.gated_rmsnorm_backward(
                _rows(dh), _rows(y_BSE), norm_w, _rows(z), rstd, norm_s.rmsnorm_eps, norm_s.dim // norm_s.ngroups,
                norm_s.norm_before_gate, _rows(dz), needs[8],
            )  # fmt: skip
            dy_BSE = dy_BSE.view(y_BSE.shape)
            if needs[8]:  # out_proj's weight gradient from its recomputed input (float32 from cuBLAS)
                dout_w = weight_grad(dout_2d, h, out_w.dtype)
            del h
        else:
            with torch.enable_grad(), no_autocast(z.device):
                z_, y_, norm_w_ = _leaf(z, True), _leaf(y_BSE, True), _leaf(norm_w, needs[7])
                h = _gate_norm(y_, z_, None, norm_w_, norm_s)  # recomputed: out_proj's input
            if needs[8]:
                dout_w = weight_grad(dout_2d, h.detach().reshape(-1, h.shape[-1]), out_w.dtype)
            torch.autograd.backward(h, dh)  # -> y_.grad, z_.grad, norm_w_.grad
            dz, dy_BSE, dnorm_w = z_.grad, y_.grad, norm_w_.grad if norm_w_ is not None else None
            del h
        del dh
        # [b, s / cp, d_inner] this rank's tokens -> [b, s, d_inner / cp] this rank's heads
        dy_BLd = cp.seq_to_heads_tensor(dy_BSE)
        dxBCdt = torch.empty_like(xBCdt, memory_format=torch.contiguous_format)
        dxBC_in, ddt_out = dxBCdt.split([conv_dim, s.nheads], dim=-1)
        if ctx.halves:
            xBC = scs._conv_forward_halves(xBC_in, conv_w, conv_b, seq, s)  # recomputed: the SSD's operands
        else:
            with torch.enable_grad(), no_autocast(z.device):
                xBC_in_ = _leaf(xBC_in, True)
                conv_w_, conv_b_ = _leaf(conv_w, needs[2]), _leaf(conv_b, needs[3])
                xBC_graph = _conv(xBC_in_, conv_w_, conv_b_, seq, s)
            xBC = xBC_graph.detach()
        x, B, C = s.ssd_operands(xBC)
        dxBC = torch.empty(xBC.shape, device=xBC.device, dtype=xBC.dtype)  # the SSD's gradients = the conv's output's
        saved = (x, dt, A32, dt_bias, dt_p, dA_cs, B, C, D32, None, seq, S_kept)
        _, ddt, dA, ddt_bias, _, _, dD, _ = ssd_backward_pass(
            saved, dy_BLd.view(x.shape), None, s.chunk_size, cfg, True, s.dt_limit, out=s.ssd_operands(dxBC)
        )
        del xBC, x, B, C
        ddt_out.copy_(ddt)
        if ctx.halves:
            dconv_w, dconv_b = scs._conv_backward_halves(xBC_in, conv_w, conv_b, dxBC, seq, s, dxBC_in)
        else:
            torch.autograd.backward(xBC_graph, dxBC)  # -> xBC_in_.grad, conv_w_.grad, conv_b_.grad
            dxBC_in.copy_(xBC_in_.grad)
            dconv_w = None if conv_w_ is None else conv_w_.grad
            dconv_b = None if conv_b_ is None else conv_b_.grad
        A_dtype, D_dtype = ctx.dtypes
        return (
            dz,
            dxBCdt,
            dconv_w if needs[2] else None,
            dconv_b if needs[3] else None,
            ddt_bias,
            dA.to(A_dtype),
            dD.to(D_dtype),
            dnorm_w if needs[7] else None,
            dout_w,
            dout_b,
            None,
            None,
            None,
            None,
        )


def cp_mixer_tail(mixer, cp, z_BSE, xBCdt_BLd, seq_idx):
    """The mixer after in_proj under CP, one autograd node (see the module docstring).

    Before: z [b, s/cp, d_inner] (this rank's tokens, in_proj's z rows); xBCdt [b, s, conv1d_channels + nheads_local]
            (the whole sequence in natural order, this rank's heads: MambaContextParallel.in_proj_pre_conv_ssm's
            output); seq_idx [b, s] or None (the whole sequence's segment ids).
    After:  out [b, s/cp, d_model], this rank's tokens. Inside: conv and SSD on [b, s, .] of this rank's heads, one
            all-to-all to [b, s/cp, d_inner] (MambaContextParallel.heads_to_seq_tensor; its inverse in the backward),
            gated RMSNorm over all of d_inner, out_proj.
    The same values as the mixer's unfused chain (_conv_ssm_out) up to float rounding."""
    a = mixer.args
    conv_w, conv_b, dt_bias, A, D = cp.local_params()
    local = _Sizes(
        d_nonssm=0, dim=cp.d_inner_local, ngroups=cp.ngroups_local, dstate=a.d_state, nheads=cp.nheads_local,
        chunk_size=a.chunk_size, activation="silu", rmsnorm_eps=mixer.norm.eps, norm_before_gate=a.norm_before_gate,
        dt_limit=(float(mixer.dt_limit[0]), float(mixer.dt_limit[1])), other_backend=mixer.backend,
        keep_states=a.ssd_keep_states,
    )  # fmt: skip
    # the norm runs in the sequence layout over all of d_inner, with the model's groups
    norm = _Sizes(
        d_nonssm=0, dim=mixer.d_inner, ngroups=mixer.ngroups, dstate=a.d_state, nheads=mixer.nheads,
        chunk_size=a.chunk_size, activation="silu", rmsnorm_eps=mixer.norm.eps, norm_before_gate=a.norm_before_gate,
        dt_limit=local.dt_limit, other_backend=mixer.backend,
    )  # fmt: skip
    with no_autocast(z_BSE.device):
        return _CPMixerTail.apply(
            z_BSE, xBCdt_BLd, conv_w, conv_b, dt_bias, A, D, mixer.norm.weight, mixer.out_proj.weight,
            mixer.out_proj.bias, seq_idx, local, norm, cp,
        )  # fmt: skip
