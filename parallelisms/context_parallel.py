"""All-to-all context parallel (CP): the hooks of the Mamba-2 mixers and attention layers, after Megatron-LM's
MambaContextParallel design. Which tokens a rank holds (and the load-balanced order) is
parallelisms/sequence_sharding.py, the all-to-alls parallelisms/cp_all_to_all.py; this file is the per-layer hooks.

Outside the conv + SSM every CP rank holds s/cp tokens of every sequence ("sequence-sharded", [b, s/cp, D]).
The SSM is a recurrence over the whole sequence, so before the conv one all-to-all turns a rank's
[b, s/cp, D] into [b, s, D/cp]: the WHOLE sequence, but only this rank's slice of heads (and their groups'
B / C channels and dt). The conv and SSD then run locally with the matching slices of conv1d / dt_bias /
A_log / D; after them the inverse all-to-all returns [b, s/cp, d_inner]. No state is passed between
ranks and the SSD chunk size is unconstrained: every rank runs the ordinary kernels on the full length.

Conventions: tensors are batch-first [b, s, d]. seq_idx under CP is the FULL-length [b, s] segment-id
tensor of the rank's rows, in natural token order (each layer sees the whole sequence after the
all-to-all, so nothing else is needed).

Load balance (sequence_sharding.py): with it, the all-to-all delivers the 2*cp chunks in rank order
(cp=3, 1-based: 1 6 2 5 3 4); the hooks undo_load_balance to 1 2 3 4 5 6 for the conv / SSM / attention
core and redo_load_balance before the inverse all-to-all.

The hooks: `apply_context_parallel` finds the layers by class (models.mamba2.mixer.Mamba2Mixer,
models.hybrid.attention.Attention) and sets their `.cp` attribute; the layers call it in their forward.

Tensor-parallel: this repo has none. The constructor keeps Megatron's argument names
(d_inner_local_tp, ...) for familiarity; pass the FULL sizes (tp = 1).
"""

from __future__ import annotations

import copy
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from models.hybrid.attention import Attention
from models.kernels import ops
from models.mamba2.mixer import Mamba2Mixer
from parallelisms.cp_all_to_all import (
    all_to_all_heads_to_seq,
    all_to_all_heads_to_seq_blocks,
    all_to_all_seq_to_heads,
    all_to_all_seq_to_heads_packed,
    group_rank,
    group_size,
)
from parallelisms.cp_mamba_autograd import (
    in_proj_seq_to_heads,
    local_params,
)
from parallelisms.sequence_sharding import redo_load_balance, undo_load_balance

__all__ = [
    "all_to_all_seq_to_heads",
    "all_to_all_seq_to_heads_packed",
    "all_to_all_heads_to_seq",
    "validate_cp_mamba",
    "MambaContextParallel",
    "AttentionContextParallel",
    "apply_context_parallel",
]


# ----------------------------------------------------------------------------------------------------
# Mamba mixer CP
# ----------------------------------------------------------------------------------------------------


def validate_cp_mamba(nheads: int, ngroups: int, cp: int) -> int:
    """Check that heads and groups split over cp; return the group repeat count (1 if no replication).

    Heads must divide by cp. Groups either divide by cp (each rank owns ngroups/cp whole groups) or cp
    divides by groups (each group's B / C is replicated cp/ngroups times, one replica per rank).
    """
    if cp < 1 or nheads % ngroups:
        raise ValueError(f"invalid Mamba sizes: nheads={nheads}, ngroups={ngroups}, cp={cp}")
    if nheads % cp:
        raise ValueError(
            f"context parallel needs nheads % cp == 0: nheads={nheads}, ngroups={ngroups}, cp={cp}; "
            f"choose a context_parallel_degree that divides nheads={nheads}"
        )
    if ngroups % cp == 0:
        return 1
    if cp % ngroups == 0:
        return cp // ngroups
    raise ValueError(
        f"context parallel needs ngroups % cp == 0 or cp % ngroups == 0: nheads={nheads}, ngroups={ngroups}, "
        f"cp={cp}; choose a context_parallel_degree that divides or is a multiple of ngroups={ngroups}"
    )


# A cp=1 parameter: the tensor itself, or (owner_module, attribute_name), read at every forward. Use the
# second form in models: FSDP2 (and to_empty / deepcopy) replace the Parameter object on its module, so a
# stored tensor reference would go stale and silently stop training.
ParamSource = Union[torch.Tensor, tuple]


def _resolve(src: ParamSource) -> torch.Tensor:
    if isinstance(src, tuple):
        module, name = src
        return getattr(module, name)
    return src


class MambaContextParallel:
    """All-to-all CP for one Mamba-2 mixer: activations' collectives and this rank's parameter slices.

    Holds no parameters (not an nn.Module, not in checkpoints): get_* slice the cp=1 parameters in the
    forward, so gradients flow back into the full parameters (each rank fills only its slice; the
    all-reduce over the CP group that FSDP / DDP does anyway sums the slices). Under FSDP2 the full
    unsharded parameter is what gets sliced, provided the sources are given as (module, name).

    Args:
        cp_group: the CP process group (None means cp = 1).
        d_inner_local_tp, nheads_local_tp, ngroups_local_tp: d_inner, nheads, ngroups (full sizes: no TP).
        d_state: N.
        conv1d_cp1: the depthwise nn.Conv1d(conv_dim, conv_dim, d_conv, groups=conv_dim) of the mixer,
            conv_dim = d_inner + 2*ngroups*d_state, channels [x (h*P+p) | B (g*N+n) | C (g*N+n)].
        dt_bias_cp1, A_log_cp1: [nheads]; D_cp1: [nheads], or [nheads*headdim] / [nheads, headdim] when
            D_has_hdim. Each a tensor or (module, attribute_name) (see ParamSource).
        load_balance: the tokens are in the balanced layout (see sequence_sharding.shard_sequence).

    Per rank: d_inner_local = d_inner/cp, nheads_local = nheads/cp, ngroups_local = ngroups/cp or 1 (with
    replication), conv1d_channels = d_inner_local + 2*ngroups_local*d_state.
    """

    def __init__(
        self,
        cp_group: Optional[dist.ProcessGroup],
        d_inner_local_tp: int,
        nheads_local_tp: int,
        ngroups_local_tp: int,
        d_state: int,
        conv1d_cp1: nn.Conv1d,
        dt_bias_cp1: ParamSource,
        A_log_cp1: ParamSource,
        D_cp1: ParamSource,
        D_has_hdim: bool,
        load_balance: bool = False,
        overlap: bool = True,
    ) -> None:
        self.cp_group = cp_group
        self.cp_size = group_size(cp_group)
        self.cp_rank = group_rank(cp_group)
        self.d_inner = d_inner_local_tp
        self.nheads = nheads_local_tp
        self.ngroups = ngroups_local_tp
        self.d_state = d_state
        self.conv1d_cp1 = conv1d_cp1
        self.dt_bias_cp1 = dt_bias_cp1
        self.A_log_cp1 = A_log_cp1
        self.D_cp1 = D_cp1
        self.D_has_hdim = D_has_hdim
        self.load_balance = load_balance and self.cp_size > 1
        self.overlap = overlap  # in_proj's all-to-all beside the z product (parallelism.context_parallel_overlap)

        if self.d_inner % self.nheads:
            raise ValueError(f"d_inner={self.d_inner} must be nheads={self.nheads} * headdim")
        self.headdim = self.d_inner // self.nheads
        conv_dim = self.d_inner + 2 * self.ngroups * d_state
        if conv1d_cp1.weight.shape[0] != conv_dim or conv1d_cp1.groups != conv_dim:
            raise ValueError(
                f"conv1d must be depthwise over conv_dim = d_inner + 2*ngroups*d_state = {conv_dim} channels; "
                f"got weight {tuple(conv1d_cp1.weight.shape)}, groups={conv1d_cp1.groups}"
            )
        cp = self.cp_size
        self.group_repeat_count = validate_cp_mamba(self.nheads, self.ngroups, cp)
        self.nheads_local = self.nheads // cp
        self.d_inner_local = self.d_inner // cp
        self.ngroups_local = max(self.ngroups // cp, 1)
        self.conv1d_channels = self.d_inner_local + 2 * self.ngroups_local * d_state
        self._rows: torch.Tensor | None = None  # in_proj's x B C dt rows in send order (_send_rows), per device
        self._param_index: tuple | None = None  # (positions, sizes) of the local parameters (_local_param_index)

    @classmethod
    def from_mixer(
        cls, mixer: nn.Module, cp_group, load_balance: bool = False, overlap: bool = True
    ) -> "MambaContextParallel":
        """Build from a mixer with mamba_ssm Mamba2 attributes: d_ssm (or d_inner), nheads, ngroups,
        d_state, conv1d, dt_bias, A_log, D (and D_has_hdim, else inferred from D's size). Parameters are
        read through (mixer, name), so FSDP2 / to_empty / deepcopy are safe."""
        d_inner = getattr(mixer, "d_ssm", None) or mixer.d_inner
        D_has_hdim = getattr(mixer, "D_has_hdim", None)
        if D_has_hdim is None:
            D_has_hdim = mixer.D.numel() != mixer.nheads
        return cls(
            cp_group,
            d_inner,
            mixer.nheads,
            mixer.ngroups,
            mixer.d_state,
            mixer.conv1d,
            (mixer, "dt_bias"),
            (mixer, "A_log"),
            (mixer, "D"),
            D_has_hdim,
            load_balance,
            overlap,
        )

    def __deepcopy__(self, memo):
        # Process groups cannot be copied; share it, deep-copy the module / parameter references so a
        # copied model's CP reads the copy's parameters.
        new = copy.copy(self)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k != "cp_group":
                setattr(new, k, copy.deepcopy(v, memo))
        return new

    # ---- activations ------------------------------------------------------------------------------

    def pre_conv_ssm(self, xBCdt_BSD: torch.Tensor) -> torch.Tensor:
        """[b, s/cp, conv_dim + nheads] (x | B | C | dt, this rank's tokens)
        -> [b, s, conv1d_channels + nheads_local] (x | B | C | dt of this rank's heads, whole sequence,
        natural token order). One all-to-all carries x, B, C and dt together."""
        if self.cp_size == 1:
            return xBCdt_BSD
        out_BSd = all_to_all_seq_to_heads_packed(self._send_order(xBCdt_BSD), self.cp_group)
        return undo_load_balance(out_BSd, self.cp_size, seq_dim=1) if self.load_balance else out_BSd

    def in_proj_pre_conv_ssm(self, u_BSD: torch.Tensor, in_proj: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixer's in_proj and pre_conv_ssm, with the all-to-all overlapped by half of the in_proj.

        u [b, s/cp, d_model] (this rank's tokens) -> (z [b, s/cp, d_inner], this rank's tokens;
        xBCdt [b, s, conv1d_channels + nheads_local], as pre_conv_ssm returns it). in_proj's output rows are
        [z (d_inner) | x B C dt]: the x B C dt rows are multiplied first, straight into the all-to-all's send buffer
        (their rows taken in send order, _send_rows: no copy of the activations), the all-to-all is started, and the
        z rows (about half of in_proj's FLOPs) are multiplied while it runs; its backward overlaps the same way. One
        autograd node (cp_mamba_autograd.in_proj_seq_to_heads). The same values as in_proj(u) split in two (each
        output column is the same dot product).
        """
        if self.cp_size == 1:
            return in_proj(u_BSD).split([self.d_inner, self.conv1d_channels + self.nheads_local], dim=-1)
        rows = self._send_rows(in_proj.weight.device)  # [cp * d]: in_proj rows of x B C dt, in send order
        z_BSE, out_BSd = in_proj_seq_to_heads(
            u_BSD,
            in_proj.weight,
            in_proj.bias,
            rows,
            self.d_inner,
            self.group_repeat_count == 1,
            self.cp_group,
            overlap=self.overlap,
        )
        if self.load_balance:
            out_BSd = undo_load_balance(out_BSd, self.cp_size, seq_dim=1)
        return z_BSE, out_BSd

    def _send_rows(self, device: torch.device) -> torch.Tensor:
        """[cp * (conv1d_channels + nheads_local)] int64: the rows of in_proj's x B C dt part (row 0 = x's first) in
        the all-to-all's send order, so that rows[k*d : (k+1)*d] are what _send_order puts in send[k] (a group's B / C
        rows repeat when groups are replicated). Made by _send_order itself, from the row numbers."""
        if self._rows is None or self._rows.device != device:
            n = self.d_inner + 2 * self.ngroups * self.d_state + self.nheads
            rows = torch.arange(n, device=device).view(1, 1, n)
            self._rows = self._send_order(rows).reshape(-1)
        return self._rows

    def _send_order(self, xBCdt_BSD: torch.Tensor) -> torch.Tensor:
        """[b, s/cp, conv_dim + nheads] -> the all-to-all's send buffer [cp, b, s/cp, conv1d_channels + nheads_local]:
        send[k] = [x_k | B_k | C_k | dt_k], rank k's heads (and their groups' B / C), written by one cat."""
        cp, N = self.cp_size, self.d_state
        GN = self.ngroups * N
        b, s_local, D = xBCdt_BSD.shape
        if D != self.d_inner + 2 * GN + self.nheads:
            raise ValueError(f"pre_conv_ssm: last dim {D} != conv_dim + nheads = {self.d_inner + 2 * GN + self.nheads}")
        x, B, C, dt = torch.split(xBCdt_BSD, [self.d_inner, GN, GN, self.nheads], dim=-1)
        r = self.group_repeat_count
        if r > 1:
            # replicas of group g land on consecutive ranks g*r .. g*r+r-1, next to that group's heads;
            # autograd of expand sums the replicas' gradients
            B = B.reshape(b, s_local, self.ngroups, 1, N).expand(-1, -1, -1, r, -1).reshape(b, s_local, cp * N)
            C = C.reshape(b, s_local, self.ngroups, 1, N).expand(-1, -1, -1, r, -1).reshape(b, s_local, cp * N)
        return torch.cat([t.reshape(b, s_local, cp, -1).permute(2, 0, 1, 3) for t in (x, B, C, dt)], dim=-1)

    def post_conv_ssm(self, y_BSd: torch.Tensor) -> torch.Tensor:
        """[b, s, d_inner_local] (this rank's heads, whole sequence, natural order)
        -> [b, s/cp, d_inner] (this rank's tokens, all heads, in the rank's token layout)."""
        if self.cp_size == 1:
            return y_BSd
        if self.load_balance:
            y_BSd = redo_load_balance(y_BSd, self.cp_size, seq_dim=1)
        return all_to_all_heads_to_seq(y_BSd, self.cp_group)

    def post_conv_ssm_norm(self, y_BSd: torch.Tensor, z_BSE: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """norm(post_conv_ssm(y), z), the norm reading the all-to-all's receive buffer where it lies.

        y [b, s, d_inner_local] (this rank's heads, whole sequence, natural order), z [b, s/cp, d_inner] (this rank's
        tokens) -> [b, s/cp, d_inner] (this rank's tokens). The all-to-all delivers each token's channels as one block
        per rank; assembling them is a copy of y's size each way (forward, full AC's recompute, and the gradient's
        send buffer in the backward: ~0.17 ms each at the 1.3B's 32k shape), which ops.rmsnorm_gated_blocks avoids
        with our kernels (the same values)."""
        if self.cp_size == 1:
            return norm(y_BSd, z_BSE)
        if self.load_balance:
            y_BSd = redo_load_balance(y_BSd, self.cp_size, seq_dim=1)
        y_KTd = all_to_all_heads_to_seq_blocks(y_BSd, self.cp_group)
        b, s_local, d_inner = z_BSE.shape
        normed_TI = ops.rmsnorm_gated_blocks(
            y_KTd,
            norm.weight,
            z_BSE.reshape(b * s_local, d_inner),
            eps=norm.eps,
            group_size=norm.group_size,
            norm_before_gate=norm.norm_before_gate,
            backend=norm.backend,
        )
        return normed_TI.view(b, s_local, d_inner)

    # ---- parameter slices (taken in the forward) ----------------------------------------------------

    def get_conv1d_weight(self) -> torch.Tensor:
        """[conv1d_channels, 1, d_conv]: this rank's rows of conv1d.weight [conv_dim, 1, d_conv] (same layout
        as the parameter; causal_conv1d takes weight.squeeze(1))."""
        return self._slice_conv_param(self.conv1d_cp1.weight)

    def get_conv1d_bias(self) -> Optional[torch.Tensor]:
        """[conv1d_channels] or None (conv without bias)."""
        bias = self.conv1d_cp1.bias
        return None if bias is None else self._slice_conv_param(bias)

    def get_dt_bias(self) -> torch.Tensor:
        """[nheads_local]."""
        return self._slice_heads(_resolve(self.dt_bias_cp1))

    def get_A_log(self) -> torch.Tensor:
        """[nheads_local]."""
        return self._slice_heads(_resolve(self.A_log_cp1))

    def get_D(self) -> torch.Tensor:
        """[nheads_local], or [d_inner_local] / [nheads_local, headdim] when D_has_hdim (same layout as D)."""
        return self._slice_D(_resolve(self.D_cp1))

    def local_params(self) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (conv1d weight [conv1d_channels, d_conv], conv1d bias [conv1d_channels] or None, dt_bias
        [nheads_local], A = -exp(A_log) [nheads_local] float32, D [nheads_local] or [nheads_local, headdim] when
        D_has_hdim), what the conv and the SSD take. One autograd node (cp_mamba_autograd.local_params: one gather
        forward, one scatter backward) instead of a slice node per parameter and part; the same values as the get_*
        slices."""
        w, b = self.conv1d_cp1.weight, self.conv1d_cp1.bias
        params = (w, b, _resolve(self.dt_bias_cp1), _resolve(self.A_log_cp1), _resolve(self.D_cp1))
        d_shape = (self.nheads_local, self.headdim) if self.D_has_hdim else (self.nheads_local,)
        conv_shape = (self.conv1d_channels, w.shape[-1])
        if self.cp_size == 1 or not all(p is None or p.dtype == w.dtype for p in params):
            # one concatenation needs one dtype; otherwise (and without CP) slice each parameter
            A = -torch.exp(self.get_A_log().float())
            conv_b = self.get_conv1d_bias()
            return self.get_conv1d_weight().view(conv_shape), conv_b, self.get_dt_bias(), A, self.get_D().view(d_shape)
        index, sizes = self._local_param_index(params)
        return local_params(index, sizes, conv_shape, d_shape, *params)

    def _local_param_index(self, params) -> tuple[torch.Tensor, list[int]]:
        """(index [n] int64, the local parameters' sizes): where this rank's slices of the parameters (conv1d weight,
        bias if any, dt_bias, A_log, D) lie in their flattened concatenation, in that order. Made once per device by
        the get_* slicing itself, applied to the positions."""
        device = params[0].device
        if self._param_index is None or self._param_index[0].device != device:
            pos, offset = [], 0
            for p in (p for p in params if p is not None):
                pos.append(torch.arange(offset, offset + p.numel(), device=device).view(p.shape))
                offset += p.numel()
            w, rest = pos[0], pos[1:]
            b = rest.pop(0) if params[1] is not None else None
            dt_bias, A_log, D = rest
            local = [self._slice_conv_param(w), None if b is None else self._slice_conv_param(b)]
            local += [self._slice_heads(dt_bias), self._slice_heads(A_log), self._slice_D(D)]
            local = [t.reshape(-1) for t in local if t is not None]
            self._param_index = (torch.cat(local), [t.numel() for t in local])
        return self._param_index

    def _slice_D(self, D: torch.Tensor) -> torch.Tensor:
        if self.cp_size == 1:
            return D
        if self.D_has_hdim and D.dim() == 1:
            n = self.d_inner_local
            return D[self.cp_rank * n : (self.cp_rank + 1) * n]
        return self._slice_heads(D)

    def _slice_heads(self, p: torch.Tensor) -> torch.Tensor:
        if self.cp_size == 1:
            return p
        n = self.nheads_local
        return p[self.cp_rank * n : (self.cp_rank + 1) * n]

    def _slice_conv_param(self, p: torch.Tensor) -> torch.Tensor:
        if self.cp_size == 1:
            return p
        GN = self.ngroups * self.d_state
        x, B, C = torch.split(p, [self.d_inner, GN, GN], dim=0)
        n = self.d_inner_local
        x = x[self.cp_rank * n : (self.cp_rank + 1) * n]
        # with replication rank k owns group k // r; otherwise groups [k*G/cp, (k+1)*G/cp)
        gn = self.ngroups_local * self.d_state
        g0 = (self.cp_rank // self.group_repeat_count) * gn
        return torch.cat([x, B[g0 : g0 + gn], C[g0 : g0 + gn]], dim=0)


# ----------------------------------------------------------------------------------------------------
# Attention CP hook and model wiring
# ----------------------------------------------------------------------------------------------------


class AttentionContextParallel:
    """The attention layers' CP hook (models/hybrid/attention.py: degree, seq_to_heads, heads_to_seq).

    Rank r gets heads [r*h/cp, (r+1)*h/cp) (the attention layer repeats kv heads first when cp > n_kv).
    """

    def __init__(self, cp_group: Optional[dist.ProcessGroup], load_balance: bool = False) -> None:
        self.cp_group = cp_group
        self.degree = group_size(cp_group)
        self.load_balance = load_balance and self.degree > 1

    def seq_to_heads(self, x_BSHD: torch.Tensor) -> torch.Tensor:
        """[b, s/cp, h, d] (this rank's tokens) -> [b, s, h/cp, d] (whole sequence, natural order)."""
        if self.degree == 1:
            return x_BSHD
        b, s_local, h, d = x_BSHD.shape
        if h % self.degree:
            raise ValueError(f"attention heads h={h} must divide by cp={self.degree}")
        # head-major channels: channel slice r of h*d is heads [r*h/cp, (r+1)*h/cp)
        y_BSd = all_to_all_seq_to_heads(x_BSHD.reshape(b, s_local, h * d), self.cp_group)
        if self.load_balance:
            y_BSd = undo_load_balance(y_BSd, self.degree, seq_dim=1)
        return y_BSd.reshape(b, s_local * self.degree, h // self.degree, d)

    def heads_to_seq(self, x_BSHD: torch.Tensor) -> torch.Tensor:
        """[b, s, h/cp, d] (whole sequence, natural order) -> [b, s/cp, h, d] (this rank's tokens)."""
        if self.degree == 1:
            return x_BSHD
        b, s, h_local, d = x_BSHD.shape
        x_BSd = x_BSHD.reshape(b, s, h_local * d)
        if self.load_balance:
            x_BSd = redo_load_balance(x_BSd, self.degree, seq_dim=1)
        return all_to_all_heads_to_seq(x_BSd, self.cp_group).reshape(b, s // self.degree, h_local * self.degree, d)

    def __deepcopy__(self, memo):
        return self  # stateless apart from the group, which cannot be copied


def apply_context_parallel(model: nn.Module, cp_group, load_balance: bool = False, overlap: bool = True) -> int:
    """Set `.cp` on every Mamba2Mixer (a MambaContextParallel) and Attention layer (an
    AttentionContextParallel) of `model`; checks every layer's heads / groups against cp first (before any
    compute). Returns how many layers got a hook. With cp = 1 nothing is set (the hooks stay None and cost
    nothing). The caller also shards input_ids / labels with sequence_sharding.shard_sequence and passes the
    FULL seq_idx."""
    cp = group_size(cp_group)
    if cp == 1:
        return 0
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, Mamba2Mixer):
            hooks.append((m, MambaContextParallel.from_mixer(m, cp_group, load_balance, overlap)))
        elif isinstance(m, Attention):
            kv = m.n_kv_heads
            if m.n_heads % cp or (kv % cp and cp % kv):
                raise ValueError(
                    f"{name}: context parallel needs n_heads % cp == 0 and (n_kv_heads % cp == 0 or cp % n_kv_heads "
                    f"== 0): n_heads={m.n_heads}, n_kv_heads={kv}, cp={cp}; change the heads or context_parallel_degree"
                )
            hooks.append((m, AttentionContextParallel(cp_group, load_balance)))
    for m, hook in hooks:
        m.cp = hook
    return len(hooks)
