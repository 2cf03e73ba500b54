"""The Mamba-2 mixer after in_proj (mamba_split_conv1d_scan_combined's contract) with our Triton SSD.

Used on CUDA by the "auto" and "triton" backends. One autograd Function runs conv -> our SSD -> gated RMSNorm
(-> out_proj) and keeps for its backward only what mamba_ssm's fused mixer keeps: zxbcdt (the input) and the SSD's
output y (plus the float32 dt and within-chunk decay, [B, H, L] each). The conv output (x, B, C) and the normed,
gated y that enters out_proj are recomputed in the backward: kept, they cost 265 MiB per layer at the 1.3B shape
(16384 tokens x (4352 + 4096) bf16 channels), 12.7 GiB over its 48 layers (docs/ssd_sessions.md, session 8); with
keep_conv (model.ssd_keep_conv_layers) the conv's output is kept too (136 MiB per layer there), not recomputed. The
conv and the norm run as ops.causal_conv1d / ops.rmsnorm_gated with backend "auto" (the installed GPU kernels, else
the references, as on the CPU under TRITON_INTERPRET=1) and their backward is autograd's, through a graph rebuilt
in the backward.
Same arguments, semantics and outputs as models.kernels.reference.mamba_split_conv1d_scan_ref, which documents them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.kernels import cuda as _cuda
from models.kernels._utils import no_autocast
from models.kernels.autocast_linear import gradient_dtype, weight_grad
from models.kernels.reference import split_zxbcdt_sizes
from models.kernels.row_scale import RowScaled
from models.kernels.weight_copies import compute_weight

__all__ = ["mamba_split_conv1d_scan_triton"]


@dataclass(frozen=True)
class _Sizes:
    """Everything of the call that is not a tensor: the widths of zxbcdt's parts and the scalar options."""

    d_nonssm: int
    dim: int
    ngroups: int
    dstate: int
    nheads: int
    chunk_size: int
    activation: str | None
    rmsnorm_eps: float
    norm_before_gate: bool
    dt_limit: tuple[float, float]
    other_backend: str
    keep_states: bool = False  # the SSD's entering states kept for its backward (ssd_chunk_scan_triton)
    # A given as A_log (A = -exp(A_log), the model's parameter): the dt kernels take the exponential and return
    # A_log's gradient, so no PyTorch ops for it run in the forward or the backward (four tiny kernels per layer)
    a_is_log: bool = False
    # The gated norm's division by the rows' rms left to the next block's add + RMSNorm (row_scale.py; model option
    # fuse_gate_into_scan): the chunk scan writes out_proj's input before it, and the Function returns the rows'
    # sums of squares beside out_proj's output. Taken only where _fuses_gate says it applies.
    fuse_gate: bool = False
    # The conv's output (x, B, C) kept from the forward for the backward instead of recomputed there (model option
    # ssd_keep_conv_layers): on the kernel-halves path only (the autograd path rebuilds the conv's graph anyway).
    keep_conv: bool = False

    @property
    def headdim(self) -> int:
        return self.dim // self.nheads

    @property
    def silu(self) -> bool:
        return self.activation in ("silu", "swish")

    def split(self, zxbcdt_BLF):
        """zxbcdt [B, L, F] -> views (zx0 [B, L, 2 d_nonssm], z [B, L, dim], xBC [B, L, conv_dim], dt [B, L, H])."""
        conv_dim = self.dim + 2 * self.ngroups * self.dstate
        return torch.split(zxbcdt_BLF, [2 * self.d_nonssm, self.dim, conv_dim, self.nheads], dim=-1)

    def ssd_operands(self, xBC_BLC):
        """The conv output [B, L, conv_dim] -> views x [B, L, H, P], B [B, L, G, N], C [B, L, G, N] (views, never
        copies: the backward writes the SSD's gradients through them)."""
        b, L, _ = xBC_BLC.shape
        GN = self.ngroups * self.dstate
        x, B, C = torch.split(xBC_BLC, [self.dim, GN, GN], dim=-1)
        shape = (b, L, self.ngroups, self.dstate)
        return x.view(b, L, self.nheads, self.headdim), B.view(shape), C.view(shape)


def _conv(xBC_BLC, weight, bias, seq, s: _Sizes):
    """Depthwise causal conv + activation on the channel-last view; [B, L, conv_dim] -> [B, L, conv_dim]."""
    from models.kernels import ops  # lazy: ops imports this module for its triton backend

    out = ops.causal_conv1d(xBC_BLC.transpose(1, 2), weight, bias, seq, s.activation, backend=s.other_backend)
    return out.transpose(1, 2)


def _gate_norm(y_BLD, z_BLD, zx0, rmsnorm_weight, s: _Sizes):
    """SSD output -> out_proj's input [B, L, 2 d_nonssm / 2 + dim]: gated RMSNorm (or y * silu(z) without a norm
    weight, y float32 then), with silu(x0) * x1 of the non-SSM part in front when d_nonssm > 0."""
    from models.kernels import ops

    if rmsnorm_weight is not None:
        h = ops.rmsnorm_gated(
            y_BLD,
            rmsnorm_weight,
            z=z_BLD,
            eps=s.rmsnorm_eps,
            group_size=s.dim // s.ngroups,
            norm_before_gate=s.norm_before_gate,
            backend=s.other_backend,
        )
    else:  # the z gate the SSD applies when it is given z: float32 y, one rounding after the gate
        h = (y_BLD.float() * F.silu(z_BLD.float())).to(z_BLD.dtype)
    if s.d_nonssm > 0:
        x0, x1 = zx0.to(torch.promote_types(zx0.dtype, torch.float32)).chunk(2, dim=-1)
        h = torch.cat([(F.silu(x0) * x1).to(h.dtype), h], dim=-1)
    return h


def _runs_kernel_halves(zxbcdt, norm_w, s: _Sizes) -> bool:
    """Whether the conv and the gated norm run as the GPU kernels' forward / backward halves called directly
    (cuda.kernel_halves: no autograd Function, no custom-op dispatch, no graph rebuilt in the backward, the norm's
    output recomputed inside its backward kernel, dzxbcdt written in place): on CUDA with those kernels installed,
    for the mixer our model builds (a norm weight, no non-SSM part, silu or no activation). Otherwise both run
    through ops.causal_conv1d / ops.rmsnorm_gated and autograd (the references on the CPU): the same function."""
    if norm_w is None or s.d_nonssm or s.activation not in (None, "silu", "swish"):
        return False
    return _kernel_halves_on(zxbcdt, s)


def _conv_forward_halves(xBC_in_BLC, conv_w, conv_b, seq, s: _Sizes):
    """The conv's forward as a bare kernel (no autograd): [B, L, conv_dim] -> [B, L, conv_dim]. With documents our
    Triton kernel (conv_triton.py: 0.113 ms against causal_conv1d's 0.157 at the 1.3B shape, 0.064 against 0.094 at
    the 370M, H100, docs/ssd_sessions.md session 23), run twice per layer and step (forward and the backward's
    recompute); without them causal_conv1d's (a tie: 0.109 against 0.114)."""
    x_BCL = xBC_in_BLC.transpose(1, 2)
    if seq is not None:
        from models.kernels.conv_triton import conv_forward_triton  # lazy: imports triton

        return conv_forward_triton(x_BCL, conv_w, conv_b, seq, s.silu).transpose(1, 2)
    return _cuda.conv_forward(x_BCL, conv_w, conv_b, seq, s.silu).transpose(1, 2)


def _conv_backward_halves(xBC_in_BLC, conv_w, conv_b, dxBC_BLC, seq, s: _Sizes, dxBC_in_BLC):
    """The conv's backward as a bare kernel: writes dxBC_in ([B, L, conv_dim], a view of dzxbcdt) and returns
    (dweight, dbias) in the parameters' dtypes. With documents our Triton kernel (conv_triton.py: 0.227 ms against
    causal_conv1d's 0.362 at the 1.3B shape, 0.143 against 0.209 at the 370M, H100, docs/ssd_sessions.md session 23);
    without them causal_conv1d's (0.234 against our 0.220-0.238: a tie)."""
    if seq is not None:
        from models.kernels.conv_triton import conv_backward_triton  # lazy: imports triton

        x_BCL, dx_BCL = xBC_in_BLC.transpose(1, 2), dxBC_in_BLC.transpose(1, 2)
        _, dw, db = conv_backward_triton(x_BCL, conv_w, conv_b, dxBC_BLC.transpose(1, 2), seq, s.silu, dx_BCL)
        return dw.to(conv_w.dtype), None if db is None else db.to(conv_b.dtype)
    return _cuda.conv_backward(
        xBC_in_BLC.transpose(1, 2), conv_w, conv_b, dxBC_BLC.transpose(1, 2), seq, s.silu, dxBC_in_BLC.transpose(1, 2)
    )


def _fuses_gate(halves: bool, norm_w, out_w, out_b, s: _Sizes) -> bool:
    """Whether this call takes the fused gate (s.fuse_gate, row_scale.py): on the kernel-halves path with our gated
    norm, whose one group spans all channels (ngroups 1) after the gate, and out_proj without a bias (a bias is not
    scaled with the rows)."""
    return (
        s.fuse_gate
        and halves
        and norm_w is not None
        and out_w is not None
        and out_b is None
        and s.ngroups == 1
        and not s.norm_before_gate
        and _cuda.NORM_HALVES != "mamba_ssm"
    )


def _fast_gate() -> bool:
    """The gated norm's sigmoid flavour (gated_rmsnorm_triton._fast), which the chunk scan's gate must share."""
    from models.kernels.gated_rmsnorm_triton import _fast  # lazy: imports triton

    return _fast()


def _kernel_halves_on(zxbcdt, s: _Sizes) -> bool:
    """CUDA tensors, a GPU backend and the kernels installed (the CPU tests stand references in for the halves)."""
    return zxbcdt.is_cuda and s.other_backend != "reference" and _cuda.kernel_halves() is not None


def _rows(t_BLD):
    """[B, L, D] (last dim contiguous, rows evenly strided) -> the [B * L, D] view the norm kernels take (a view, never
    a copy: the backward writes dz through it)."""
    return t_BLD.view(-1, t_BLD.shape[-1])


def _leaf(t, needs_grad: bool):
    return None if t is None else t.detach().requires_grad_(needs_grad)


class _MixerFunction(torch.autograd.Function):
    """zxbcdt [B, L, F] -> out [B, L, out_dim] (and final_states [B, H, P, N] float32); see the module docstring."""

    @staticmethod
    def forward(ctx, zxbcdt, conv_w, conv_b, dt_bias, A, D, norm_w, out_w, out_b, initial_states, seq, s: _Sizes):
        from models.kernels.ssd_triton.autograd import prepare_inputs, ssd_forward_pass

        zx0, z, xBC_in, dt = s.split(zxbcdt)
        seq = None if seq is None else seq.to(torch.int32).contiguous()
        halves = _runs_kernel_halves(zxbcdt, norm_w, s)
        if halves:
            xBC = _conv_forward_halves(xBC_in, conv_w, conv_b, seq, s)
        else:
            xBC = _conv(xBC_in, conv_w, conv_b, seq, s)
        x, B, C = s.ssd_operands(xBC)
        A32, B, C, D32, init, seq, cfg = prepare_inputs(
            x, dt, A, B, C, s.chunk_size, D, None, dt_bias, seq, initial_states, s.keep_states
        )
        y_dtype = x.dtype if norm_w is not None else torch.float32  # the gate without a norm wants float32 y
        fused_gate = _fuses_gate(halves, norm_w, out_w, out_b, s)
        gate = (z, norm_w, _fast_gate()) if fused_gate else None
        y, final, saved = ssd_forward_pass(
            x, dt, A32, dt_bias, B, C, D32, init, seq, s.chunk_size, cfg, y_dtype, True, s.dt_limit, s.a_is_log, gate
        )
        sumsq = None
        if fused_gate:  # y, out_proj's input before the rows' 1 / rms, the rows' sums of squares in parts
            y, h, sumsq = y
        y_BLD = y.reshape(*zxbcdt.shape[:2], s.dim)
        rstd = None
        if halves and not fused_gate:  # the norm's 1 / rms per row and group, kept for its backward
            h, rstd = _cuda.gated_rmsnorm_forward(
                _rows(y_BLD), norm_w, _rows(z), s.rmsnorm_eps, s.dim // s.ngroups, s.norm_before_gate
            )
            h = h.view(y_BLD.shape)
        elif not halves:
            h = _gate_norm(y_BLD, z, zx0, norm_w, s)
        out = (
            h
            if out_w is None
            else F.linear(h, compute_weight(out_w, h.dtype), None if out_b is None else out_b.to(h.dtype))
        )
        dt_p, dA_cs, a2dt, S_kept = saved[4:7] + saved[-1:]  # a2dt, S_kept: None unless config fold_dt, keep_states
        kept_conv = xBC if halves and s.keep_conv else None
        ctx.save_for_backward(
            zxbcdt, conv_w, conv_b, dt_bias, A32, D32, norm_w, out_w, out_b, init, seq, y_BLD, dt_p, dA_cs, a2dt,
            sumsq if fused_gate else rstd, S_kept, kept_conv,
        )  # fmt: skip
        ctx.s, ctx.cfg, ctx.halves, ctx.fused_gate = s, cfg, halves, fused_gate
        ctx.out_w_grad_dtype = None if out_w is None else gradient_dtype(out_w)  # float32, or training.grad_dtype's
        ctx.set_materialize_grads(False)  # an unused final state then reaches backward as None, not a zero tensor
        ctx.dtypes = (A.dtype, None if D is None else D.dtype, None if initial_states is None else initial_states.dtype)
        if sumsq is not None:
            ctx.mark_non_differentiable(sumsq)
        return out, final, sumsq

    @staticmethod
    def backward(ctx, dout, dfinal, _dsumsq=None):
        from models.kernels.ssd_triton.autograd import ssd_backward_pass

        if ctx.halves:
            return _backward_with_kernel_halves(ctx, dout, dfinal)
        s, cfg = ctx.s, ctx.cfg
        (zxbcdt, conv_w, conv_b, dt_bias, A32, D32, norm_w, out_w, out_b, init, seq, y_BLD, dt_p, dA_cs, a2dt,
         _, S_kept, _) = ctx.saved_tensors  # fmt: skip
        A_dtype, D_dtype, init_dtype = ctx.dtypes
        needs = ctx.needs_input_grad
        if dout is None:  # only the final state was used
            dout = torch.zeros(*zxbcdt.shape[:2], out_w.shape[0] if out_w is not None else s.d_nonssm + s.dim,
                               device=zxbcdt.device, dtype=zxbcdt.dtype)  # fmt: skip
        zx0, z, xBC_in, dt = s.split(zxbcdt)
        with torch.enable_grad(), no_autocast(zxbcdt.device):
            zx0_, z_, xBC_in_, y_ = _leaf(zx0, True), _leaf(z, True), _leaf(xBC_in, True), _leaf(y_BLD, True)
            conv_w_, conv_b_, norm_w_ = _leaf(conv_w, needs[1]), _leaf(conv_b, needs[2]), _leaf(norm_w, needs[6])
            h = _gate_norm(y_, z_, zx0_, norm_w_, s)  # recomputed: out_proj's input
        # out_proj's backward by hand, so that only its input is recomputed, not its product.
        dout_w = dout_b = None
        if out_w is None:
            dh = dout
        else:
            dout_2d = dout.reshape(-1, dout.shape[-1]).to(h.dtype)
            dh = (dout_2d @ compute_weight(out_w, h.dtype)).view(h.shape)
            if needs[7]:
                dout_w = weight_grad(dout_2d, h.detach().reshape(-1, h.shape[-1]), ctx.out_w_grad_dtype)
            if out_b is not None and needs[8]:
                dout_b = dout_2d.sum(0).to(out_b.dtype)
        torch.autograd.backward(h, dh)  # -> y_.grad, z_.grad, zx0_.grad, norm_w_.grad
        del h, dh
        with torch.enable_grad(), no_autocast(zxbcdt.device):
            xBC = _conv(xBC_in_, conv_w_, conv_b_, seq, s)  # recomputed: the SSD's operands
        x, B, C = s.ssd_operands(xBC.detach())
        # The SSD's gradients land in one [B, L, conv_dim] buffer, the conv's output gradient as it is.
        dxBC = torch.empty(xBC.shape, device=xBC.device, dtype=xBC.dtype)
        saved = (x, dt, A32, dt_bias, dt_p, dA_cs, a2dt, B, C, D32, init, seq, S_kept)
        _, ddt, dA, ddt_bias, _, _, dD, dinit = ssd_backward_pass(
            saved, y_.grad.view(x.shape), dfinal, s.chunk_size, cfg, True, s.dt_limit, out=s.ssd_operands(dxBC),
            a_is_log=s.a_is_log,
        )  # fmt: skip
        torch.autograd.backward(xBC, dxBC)  # -> xBC_in_.grad, conv_w_.grad, conv_b_.grad
        parts = (zx0_.grad if s.d_nonssm else None, z_.grad, xBC_in_.grad, ddt.to(zxbcdt.dtype))
        dzxbcdt = torch.cat([g for g in parts if g is not None], dim=-1)
        return (
            dzxbcdt,
            None if conv_w_ is None else conv_w_.grad,
            None if conv_b_ is None else conv_b_.grad,
            ddt_bias,
            dA.to(A_dtype),
            None if dD is None else dD.to(D_dtype),
            None if norm_w_ is None else norm_w_.grad,
            dout_w,
            dout_b,
            None if dinit is None else dinit.to(init_dtype),
            None,
            None,
        )


def _backward_with_kernel_halves(ctx, dout, dfinal):
    """_MixerFunction's backward when the conv and the norm run as kernel halves (mamba_ssm's fused mixer's order):
    out_proj's input gradient, the norm's backward (recomputing out_proj's input for its weight gradient, dz written
    into dzxbcdt), the conv recomputed, the SSD's backward, the conv's backward writing dxBC into dzxbcdt."""
    from models.kernels.ssd_triton.autograd import ssd_backward_pass

    s, cfg, needs = ctx.s, ctx.cfg, ctx.needs_input_grad
    (zxbcdt, conv_w, conv_b, dt_bias, A32, D32, norm_w, out_w, out_b, init, seq, y_BLD, dt_p, dA_cs, a2dt,
     rstd, S_kept, kept_conv) = ctx.saved_tensors  # fmt: skip
    A_dtype, D_dtype, init_dtype = ctx.dtypes
    dzxbcdt = torch.empty_like(zxbcdt, memory_format=torch.contiguous_format)
    _, z, xBC_in, dt = s.split(zxbcdt)
    _, dz, dxBC_in, ddt_out = s.split(dzxbcdt)
    dout_w = dout_b = None
    if dout is None:  # only the final state was used: no out_proj product of zeros
        dh = torch.zeros_like(y_BLD)
    elif out_w is None:
        dh = dout.to(y_BLD.dtype).contiguous()
    else:
        dout_2d = dout.reshape(-1, dout.shape[-1]).to(y_BLD.dtype)
        dh = (dout_2d @ compute_weight(out_w, y_BLD.dtype)).view(y_BLD.shape)
        if out_b is not None and needs[8]:
            dout_b = dout_2d.sum(0).to(out_b.dtype)
    recompute = dout is not None and out_w is not None and needs[7]
    if ctx.fused_gate:  # dout is d(out) * rstd per row (row_scale.py): the norm's scaled backward; rstd is sumsq
        from models.kernels.gated_rmsnorm_triton import gated_rmsnorm_bwd  # lazy: imports triton

        dy, dnorm_w, h = gated_rmsnorm_bwd(
            _rows(dh), _rows(y_BLD), norm_w, _rows(z), None, s.rmsnorm_eps, s.dim, False, _rows(dz), recompute,
            sumsq_parts=rstd,
        )  # fmt: skip
    else:
        dy, dnorm_w, h = _cuda.gated_rmsnorm_backward(
            _rows(dh), _rows(y_BLD), norm_w, _rows(z), rstd, s.rmsnorm_eps, s.dim // s.ngroups, s.norm_before_gate,
            _rows(dz), recompute,
        )  # fmt: skip
    if recompute:
        dout_w = weight_grad(dout_2d, h, ctx.out_w_grad_dtype)  # float32 from cuBLAS, or bf16 (training.grad_dtype)
    del dh, h
    # the forward's (s.keep_conv), else recomputed
    xBC = kept_conv if kept_conv is not None else _conv_forward_halves(xBC_in, conv_w, conv_b, seq, s)
    x, B, C = s.ssd_operands(xBC)
    dxBC = torch.empty(xBC.shape, device=xBC.device, dtype=xBC.dtype)  # the SSD's gradients = the conv's output's
    saved = (x, dt, A32, dt_bias, dt_p, dA_cs, a2dt, B, C, D32, init, seq, S_kept)
    # ddt straight into dzxbcdt's slice (dt's dtype, the slice's strides): no copy kernel after it
    _, _, dA, ddt_bias, _, _, dD, dinit = ssd_backward_pass(
        saved, dy.view(x.shape), dfinal, s.chunk_size, cfg, True, s.dt_limit, out=s.ssd_operands(dxBC),
        ddt_out=ddt_out, a_is_log=s.a_is_log,
    )  # fmt: skip
    del xBC, x, B, C, kept_conv
    dconv_w, dconv_b = _conv_backward_halves(xBC_in, conv_w, conv_b, dxBC, seq, s, dxBC_in)
    return (
        dzxbcdt,
        dconv_w if needs[1] else None,
        dconv_b if needs[2] else None,
        ddt_bias,
        dA.to(A_dtype),
        None if dD is None else dD.to(D_dtype),
        dnorm_w if needs[6] else None,
        dout_w,
        dout_b,
        None if dinit is None else dinit.to(init_dtype),
        None,
        None,
    )


def mamba_split_conv1d_scan_triton(
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
    other_backend: str = "auto",
    keep_states: bool = False,
    A_log=None,
    fuse_gate: bool = False,
    keep_conv: bool = False,
):
    """mamba_split_conv1d_scan_combined's contract (models.kernels.reference documents it); with fuse_gate, where
    _fuses_gate allows, the output is a row_scale.RowScaled (the gated norm's 1 / rms left to the next add +
    RMSNorm), else a tensor as without it. keep_conv: the conv's output kept for the backward (on the kernel-halves
    path; _Sizes.keep_conv)."""
    if (A is None) == (A_log is None):
        raise ValueError("mamba_split_conv1d_scan: give A or A_log (A = -exp(A_log)), exactly one of them")
    if zxbcdt.dim() != 3:
        raise ValueError(f"zxbcdt must be [batch, seqlen, features], got {tuple(zxbcdt.shape)}")
    d_nonssm, dim, dstate, nheads = split_zxbcdt_sizes(zxbcdt.shape[-1], conv1d_weight.shape[0], D, headdim, ngroups)
    if outproj_weight is None and outproj_bias is not None:
        raise ValueError("outproj_bias given without outproj_weight")
    # Checked here, before the conv runs (the SSD's own checks come after it).
    from models.kernels.ssd_triton.autograd import check_seq_idx_shape  # lazy: imports triton

    b, L = zxbcdt.shape[:2]
    if seq_idx is not None:
        check_seq_idx_shape(seq_idx, b, L)
    state_shape = (b, nheads, dim // nheads, dstate)
    if initial_states is not None and tuple(initial_states.shape) != state_shape:
        raise ValueError(
            f"initial_states must be [batch, nheads, headdim, dstate] = {state_shape}, "
            f"got {tuple(initial_states.shape)}"
        )
    s = _Sizes(
        d_nonssm=d_nonssm,
        dim=dim,
        ngroups=ngroups,
        dstate=dstate,
        nheads=nheads,
        chunk_size=chunk_size,
        activation=activation,
        rmsnorm_eps=rmsnorm_eps,
        norm_before_gate=norm_before_gate,
        dt_limit=(float(dt_limit[0]), float(dt_limit[1])),
        other_backend=other_backend,
        keep_states=keep_states,
        a_is_log=A is None,
        fuse_gate=fuse_gate,
        keep_conv=keep_conv,
    )
    with no_autocast(zxbcdt.device):
        out, final, sumsq = _MixerFunction.apply(
            zxbcdt,
            conv1d_weight,
            conv1d_bias,
            dt_bias,
            A if A_log is None else A_log,
            D,
            rmsnorm_weight,
            outproj_weight,
            outproj_bias,
            initial_states,
            seq_idx,
            s,
        )
    if sumsq is not None:
        out = RowScaled(out, sumsq, dim, rmsnorm_eps)
    return (out, final) if return_final_states else out
