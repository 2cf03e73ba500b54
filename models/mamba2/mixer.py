"""The Mamba-2 mixer, with mamba_ssm's parameter names (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj).

Kernels come from models.kernels.ops: mamba_ssm's Triton SSD / causal_conv1d on CUDA, this repo's PyTorch
references elsewhere. Under context parallel, `self.cp` (a parallelisms.context_parallel.MambaContextParallel)
turns the sequence-sharded in_proj output into whole sequences for a slice of heads before the conv and
the SSD, and back after, so the gated norm and out_proj run on the rank's own tokens.

Recurrent decoding (models.inference): `prefill` is the forward that also leaves the conv inputs and the SSM
state of the last token in the cache; `step` advances them by one token with the step kernels
(models.kernels.step_ops: mamba_ssm's selective_state_update / causal_conv1d_update, or their references).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from models.args import ModelArgs
from models.inference import InferenceCache, MambaLayerCache, last_conv_inputs
from models.kernels import ops, step_ops
from models.kernels.autocast_linear import autocast_linear
from models.kernels.row_scale import RowScaled
from models.norms import GatedRMSNorm


class Mamba2Mixer(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, n_layers: int):
        super().__init__()
        self.args = args
        self.layer_id = layer_id
        self.d_inner, self.nheads, self.headdim = args.d_inner, args.nheads, args.headdim
        self.ngroups, self.d_state = args.ngroups, args.d_state
        self.conv_dim = self.d_inner + 2 * self.ngroups * self.d_state
        self.in_proj = nn.Linear(args.d_model, self.d_inner + self.conv_dim + self.nheads, bias=args.bias)
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            args.d_conv,
            groups=self.conv_dim,
            padding=args.d_conv - 1,
            bias=args.conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.empty(self.nheads))
        self.A_log = nn.Parameter(torch.empty(self.nheads))
        self.D = nn.Parameter(torch.empty(self.d_inner if args.D_has_hdim else self.nheads))
        self.norm = GatedRMSNorm(
            self.d_inner,
            eps=args.norm_eps,
            group_size=self.d_inner // self.ngroups,
            norm_before_gate=args.norm_before_gate,
        )
        self.out_proj = nn.Linear(self.d_inner, args.d_model, bias=args.bias)
        self.dt_limit = (args.dt_limit_min, args.dt_limit_max)
        keep_conv = args.ssd_keep_conv_layers
        self.keep_conv = keep_conv < 0 or layer_id >= n_layers - keep_conv  # model.ssd_keep_conv_layers
        self.backend = "auto"  # "reference" forces the PyTorch references (model.kernels)
        self.cp = None  # set by parallelisms.context_parallel.apply_context_parallel

    # ---- forward -------------------------------------------------------------------------------------
    def forward(self, u_BSD: torch.Tensor, seq_idx: torch.Tensor | None = None) -> torch.Tensor | RowScaled:
        """[b, s, d_model] -> [b, s, d_model]; with model.fuse_gate_into_scan on the fused path a RowScaled (its rows'
        scale applied by the next block's norm: models/kernels/row_scale.py)."""
        if self.cp is not None:
            # z [b, s/cp, d_inner] (this rank's tokens), xBCdt [b, s, (conv_dim + H) of this rank's heads]: the hook
            # runs in_proj in two halves, the all-to-all of the second one hidden behind the first
            z_BSE, xBCdt = self.cp.in_proj_pre_conv_ssm(u_BSD, self.in_proj)
            return self._conv_ssm_out(z_BSE, xBCdt, seq_idx)[0]
        # autocast_linear: nn.Linear's product, with the float32 weight's gradient written in float32 by cuBLAS on CUDA
        zxbcdt = autocast_linear(u_BSD, self.in_proj.weight, self.in_proj.bias)
        return self.forward_from_in_proj(zxbcdt, seq_idx)

    def forward_from_in_proj(self, zxbcdt: torch.Tensor, seq_idx: torch.Tensor | None = None):
        """forward after in_proj (its output zxbcdt [b, s, in_proj's out] given: the block's norm_linear.py path,
        model.recompute_in_proj_input); not under context parallel, whose hook runs in_proj itself."""
        return self._forward(zxbcdt, seq_idx, fuse_gate=self.args.fuse_gate_into_scan)[0]

    def _forward(
        self, zxbcdt: torch.Tensor, seq_idx: torch.Tensor | None, return_final_states: bool = False, fuse_gate=False
    ):
        """in_proj output -> (out [b, s, d_model], the SSM state after the last token [b, H, P, N] or None)."""
        if self.cp is None and self.args.use_fused_path and zxbcdt.is_cuda and self.backend != "reference":
            return self._fused_forward(zxbcdt, seq_idx, return_final_states, fuse_gate)
        if self.cp is not None and return_final_states:
            raise ValueError(
                "Mamba2Mixer: final SSM states (inference prefill) are not available under context "
                "parallel; decode with a model built without context parallel"
            )
        z_BSE, xBCdt = zxbcdt.split([self.d_inner, self.conv_dim + self.nheads], dim=-1)
        if self.cp is not None:
            xBCdt = self.cp.pre_conv_ssm(
                xBCdt
            )  # [b, s/cp, conv_dim + H] -> [b, s, (conv_dim + H) of this rank's heads]
        return self._conv_ssm_out(z_BSE, xBCdt, seq_idx, return_final_states)

    def _conv_ssm_out(
        self, z_BSE: torch.Tensor, xBCdt: torch.Tensor, seq_idx: torch.Tensor | None, return_final_states: bool = False
    ):
        """conv -> SSD -> gated norm -> out_proj, unfused. Under CP xBCdt is the whole sequence of this rank's heads
        (pre_conv_ssm's output) and z this rank's tokens."""
        if self.cp is not None:
            conv_channels, nheads = self.cp.conv1d_channels, self.cp.nheads_local
            d_inner, ngroups = self.cp.d_inner_local, self.cp.ngroups_local
            # this rank's slices, A = -exp(A_log) and D in the SSD's layout, as one autograd node
            conv_w_CW, conv_b, dt_bias, A_H, D_ssd = self.cp.local_params()
        else:
            conv_channels, nheads, d_inner, ngroups = self.conv_dim, self.nheads, self.d_inner, self.ngroups
            conv_w_CW, conv_b = self.conv1d.weight.squeeze(1), self.conv1d.bias
            dt_bias, A_H = self.dt_bias, -torch.exp(self.A_log.float())
            D_ssd = self.D.view(-1, self.headdim) if self.args.D_has_hdim else self.D
        xBC_BSC, dt_BSH = xBCdt.split([conv_channels, nheads], dim=-1)
        # causal_conv1d takes [b, c, s]; the transposed view is channel-last, which its seq_idx path needs.
        xBC_BSC = ops.causal_conv1d(
            xBC_BSC.transpose(1, 2), conv_w_CW, conv_b, seq_idx, activation="silu", backend=self.backend
        ).transpose(1, 2)
        gn = ngroups * self.d_state
        x_BSI, B_BSG, C_BSG = xBC_BSC.split([d_inner, gn, gn], dim=-1)
        b, s = x_BSI.shape[:2]
        y_BSHP = ops.ssd_chunk_scan(
            x_BSI.reshape(b, s, -1, self.headdim),
            dt_BSH,
            A_H,
            B_BSG.reshape(b, s, ngroups, self.d_state),
            C_BSG.reshape(b, s, ngroups, self.d_state),
            self.args.chunk_size,
            D=D_ssd,
            dt_bias=dt_bias,
            dt_softplus=True,
            dt_limit=self.dt_limit,
            seq_idx=seq_idx,
            return_final_states=return_final_states,
            backend=self.backend,
            keep_states=self.args.ssd_keep_states,
        )
        y_BSHP, final_BHPN = y_BSHP if return_final_states else (y_BSHP, None)
        y_BSI = y_BSHP.reshape(b, s, -1)
        if self.cp is not None:
            # [b, s, d_inner/cp] -> all-to-all -> [b, s/cp, d_inner] -> gated norm, the norm reading the all-to-all's
            # blocks where they lie
            return self.out_proj(self.cp.post_conv_ssm_norm(y_BSI, z_BSE, self.norm)), final_BHPN
        return self.out_proj(self.norm(y_BSI, z_BSE)), final_BHPN

    def _fused_forward(
        self, zxbcdt: torch.Tensor, seq_idx: torch.Tensor | None, return_final_states: bool, fuse_gate: bool = False
    ):
        """conv + SSD + gated norm + out_proj in mamba_ssm's fused kernel (CUDA, no CP): (out, final or None)."""
        D = self.D.view(-1, self.headdim) if self.args.D_has_hdim else self.D
        out = ops.mamba_split_conv1d_scan(
            zxbcdt,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            self.dt_bias,
            None,  # A: from A_log, inside our dt kernels on their path (ops.mamba_split_conv1d_scan)
            D,
            self.args.chunk_size,
            seq_idx=seq_idx,
            dt_limit=self.dt_limit,
            activation="silu",
            rmsnorm_weight=self.norm.weight,
            rmsnorm_eps=self.norm.eps,
            outproj_weight=self.out_proj.weight,
            outproj_bias=self.out_proj.bias,
            headdim=self.headdim,
            ngroups=self.ngroups,
            norm_before_gate=self.args.norm_before_gate,
            return_final_states=return_final_states,
            backend=self.backend,
            keep_states=self.args.ssd_keep_states,
            A_log=self.A_log,
            fuse_gate=fuse_gate,
            keep_conv=self.keep_conv,
        )
        return out if return_final_states else (out, None)

    # ---- recurrent decoding (models.inference) -------------------------------------------------------
    def allocate_inference_cache(
        self, batch_size: int, max_seqlen: int, dtype: torch.dtype, device: torch.device
    ) -> MambaLayerCache:
        """Zeroed conv state [b, conv_dim, d_conv] in `dtype` and SSM state [b, H, P, N] in float32."""
        return MambaLayerCache(
            conv_state_BCW=torch.zeros(batch_size, self.conv_dim, self.args.d_conv, dtype=dtype, device=device),
            ssm_state_BHPN=torch.zeros(
                batch_size, self.nheads, self.headdim, self.d_state, dtype=torch.float32, device=device
            ),
        )

    def prefill(self, u_BSD: torch.Tensor, cache: InferenceCache, seq_idx: torch.Tensor | None = None):
        """forward(u_BSD, seq_idx), leaving the conv inputs and the SSM state after the last token in the cache."""
        zxbcdt = self.in_proj(u_BSD)
        out_BSD, final_BHPN = self._forward(zxbcdt, seq_idx, return_final_states=True)
        layer = cache.layers[str(self.layer_id)]
        xBC_BSC = zxbcdt[..., self.d_inner : self.d_inner + self.conv_dim]
        layer.conv_state_BCW.copy_(last_conv_inputs(xBC_BSC, seq_idx, self.args.d_conv))
        layer.ssm_state_BHPN.copy_(final_BHPN)
        return out_BSD

    def step(self, u_B1D: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """One token [b, 1, d_model] -> [b, 1, d_model], advancing this layer's conv and SSM states in place.

        The same math as forward at that position: conv over the last d_conv inputs, then
        state = exp(dt A) state + dt x B^T, y = C state + D x, gated norm with z, out_proj.
        """
        if self.cp is not None:
            raise ValueError("Mamba2Mixer.step: recurrent decoding does not run under context parallel")
        layer = cache.layers[str(self.layer_id)]
        b = u_B1D.shape[0]
        H, P, N, G = self.nheads, self.headdim, self.d_state, self.ngroups
        z_BI, xBC_BC, dt_BH = self.in_proj(u_B1D[:, 0]).split([self.d_inner, self.conv_dim, H], dim=-1)
        xBC_BC = step_ops.causal_conv1d_update(
            xBC_BC, layer.conv_state_BCW, self.conv1d.weight.squeeze(1), self.conv1d.bias, "silu", backend=self.backend
        )
        x_BI, B_BGN, C_BGN = xBC_BC.split([self.d_inner, G * N, G * N], dim=-1)
        # Per-head quantities as the step kernel's [H, P(, N)] stride-0 views (its fast "tied head dim" path).
        D_HP = self.D.view(H, P) if self.args.D_has_hdim else self.D[:, None].expand(H, P)
        y_BHP = step_ops.selective_state_update(
            layer.ssm_state_BHPN,
            x_BI.view(b, H, P),
            dt_BH[:, :, None].expand(b, H, P),
            (-torch.exp(self.A_log.float()))[:, None, None].expand(H, P, N),
            B_BGN.view(b, G, N),
            C_BGN.view(b, G, N),
            D_HP,
            None,
            self.dt_bias[:, None].expand(H, P),
            dt_softplus=True,
            dt_limit=self.dt_limit,
            backend=self.backend,
        )
        return self.out_proj(self.norm(y_BHP.reshape(b, 1, self.d_inner), z_BI[:, None]))

    # ---- initialisation (mamba_ssm's scheme; called on full, unsharded tensors by models.init) --------
    @torch.no_grad()
    def init_param(self, name: str, full: torch.Tensor, gen: torch.Generator) -> None:
        a = self.args
        if name in ("in_proj.weight", "out_proj.weight", "conv1d.weight"):
            fan_in = full[0].numel()
            bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)), PyTorch's Linear / Conv default
            full.uniform_(-bound, bound, generator=gen)
            if name == "out_proj.weight" and a.rescale_prenorm_residual:
                full /= math.sqrt(a.n_layers)
        elif name == "conv1d.bias":
            bound = 1.0 / math.sqrt(a.d_conv)
            full.uniform_(-bound, bound, generator=gen)
        elif name in ("in_proj.bias", "out_proj.bias"):
            full.zero_()
        elif name == "dt_bias":
            u = torch.rand(full.shape, generator=gen, device=full.device, dtype=torch.float32)
            dt = torch.exp(u * (math.log(a.dt_max) - math.log(a.dt_min)) + math.log(a.dt_min))
            dt = dt.clamp(min=a.dt_init_floor)
            full.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        elif name == "A_log":
            full.uniform_(a.A_init_min, a.A_init_max, generator=gen).log_()
        elif name in ("D", "norm.weight"):
            full.fill_(1.0)
        else:
            raise KeyError(f"Mamba2Mixer.init_param: no rule for parameter {name!r}")


def mixer_flops_per_token(args: ModelArgs, seq_len: int) -> float:
    """Forward FLOPs per token of the conv and the chunked SSD (the matmuls are counted as 2 * params)."""
    q, n, h, p, g = min(args.chunk_size, seq_len), args.d_state, args.nheads, args.headdim, args.ngroups
    conv = 2 * (args.d_inner + 2 * g * n) * args.d_conv
    intra_chunk = 2 * q * n * g + 2 * q * h * p  # C B^T scores and their product with x (causal half ignored)
    states = 2 * h * p * n * 2  # chunk states and the state-to-output term
    return float(conv + intra_chunk + states)


__all__ = ["Mamba2Mixer", "mixer_flops_per_token"]
