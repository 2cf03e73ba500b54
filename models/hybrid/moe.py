"""Dropless top-k mixture-of-experts feed-forward layer ('E' in a hybrid layer pattern).

A "mixer": MoE(args, layer_id, n_layers), forward(x_BSD, seq_idx=None) -> y_BSD (seq_idx unused: per token).

Per token t (T = b*s tokens, E experts, K = top_k):
    logits_TE = router(x)                          fp32; scores = softmax(logits) or sigmoid(logits)
    idx_TK    = topk(scores + expert_bias, K)      the bias only SELECTS (auxiliary-loss-free balancing)
    w_TK      = scores[idx_TK]                     combine weights (without the bias), / sum_k if route_norm
    y_t       = sum_k w_tk * expert_{idx_tk}(x_t) + shared_experts(x_t)

Expert-parallel seam: ``self.experts`` is called exactly once per forward as
    pending = self.experts.prefetch_counts(num_tokens_per_expert_E)       (right after routing)
    y_sorted_TD = self.experts(x_sorted_TD, num_tokens_per_expert_E, pending)
      x_sorted_TD              [T*K, d_model]  token copies sorted by expert id (stable: by token within an
                                               expert), expert e's rows are the e-th block of the counts
      num_tokens_per_expert_E  [E] int64       block sizes (sum = T*K), on x's device
      y_sorted_TD              [T*K, d_model]  each row's expert output, SAME order as x_sorted_TD
prefetch_counts lets expert parallel start what the counts must do before the experts run (their exchange between
ranks and their copy to the host, read for the all-to-all's split sizes) as soon as they exist; it returns None
for a GroupedExperts. The forward queues the work that needs no count (the shared experts, the sort) between the
two calls, so that the device has it while the host waits for the copy. The combine weights are applied
afterwards, outside the seam. Expert parallel replaces ``self.experts`` by a
module with the same call signature that all-to-alls each block to the rank owning that expert (experts split
contiguously over ep ranks: rank r owns experts [r*E/ep, (r+1)*E/ep)), runs a GroupedExperts holding only
those experts (w1/w3 [E/ep, d_model, hidden], w2 [E/ep, hidden, d_model]; its counts argument then has E/ep
entries), and all-to-alls the results back into the original order.

Balancing and metrics:
  tokens_per_expert  int64 buffer [E] (not persistent): routed token copies per expert accumulated by every
                     forward in training mode (not by activation-checkpoint recomputation). The trainer reads
                     it for load metrics, all-reduces (SUM) it over every rank holding a replica of this layer
                     (dp_replicate x dp_shard x cp; experts under EP are still routed on every rank) and then
                     calls update_expert_bias(), which also zeroes it.
  expert_bias        float32 buffer [E] (persistent, checkpointed): += coeff * sign(mean_load - load), centred.
  Switch aux loss (moe_aux_loss_coeff) and router z-loss (moe_z_loss_coeff) are not returned: their gradient,
  scaled by coeff * self.aux_loss_scale, is attached to the output by AttachAuxLoss (identity forward). Set
  aux_loss_scale to whatever factor multiplies the main loss before backward (e.g. 1/grad_accum_steps) so that
  the gradients equal those of (main_loss + coeff * aux) * scale. last_aux_loss / last_z_loss hold the
  detached values of the latest training forward for logging.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from models.args import ModelArgs
from models.hybrid.mlp import MLP, mlp_hidden_dim, swiglu_init_

# Rows of each expert's group in the grouped GEMM are padded to a multiple of this (16 bytes of bf16 = 8 rows
# is the TMA minimum; 16 also covers fp8), so the gemm and its weight-gradient gemm see aligned groups.
GROUP_ALIGN = 16


def moe_hidden_dim(args: ModelArgs) -> int:
    """moe_hidden_dim, or the dense MLP's hidden size split over the top_k experts a token uses (the same active
    size). The one formula: components/metrics.py counts FLOPs with it too."""
    return args.moe_hidden_dim or mlp_hidden_dim(args) // args.moe_top_k


def _in_recomputation() -> bool:
    """True while autograd runs a backward pass, i.e. when a forward runs as activation-checkpoint recompute."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


class AttachAuxLoss(torch.autograd.Function):
    """out = AttachAuxLoss.apply(x, aux): returns x unchanged; backward gives x its incoming gradient and aux the
    gradient 1, so that d(aux)/d(params) joins the gradients as if aux had been added to the loss."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        return grad_x, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad_x.device)


def count_experts(idx_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """idx_TK [T, K] expert ids -> counts_E [E] int64, token copies per expert. A scatter-add on the device:
    torch.bincount reads its input's min and max on the host (two stream syncs per MoE layer on CUDA)."""
    idx = idx_TK.flatten()
    return idx.new_zeros(num_experts, dtype=torch.int64).scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.int64))


class _GatherRows(torch.autograd.Function):
    """y_ND = x_MD[index_N], where every row of x is taken exactly `copies` times and inverse_N lists, for x's rows
    in order and each row's copies consecutively, where that copy sits in y. Backward: the gradient's rows in that
    order, summed per x row: one gather and a sum instead of the scatter-add of indexing's backward (index_put
    with accumulate: a sort and several launches on CUDA)."""

    @staticmethod
    def forward(ctx, x_MD, index_N, inverse_N, copies: int):
        ctx.save_for_backward(inverse_N)
        ctx.copies = copies
        return x_MD.index_select(0, index_N)

    @staticmethod
    def backward(ctx, grad_ND):
        (inverse_N,) = ctx.saved_tensors
        grad_ND = grad_ND.index_select(0, inverse_N)
        if ctx.copies > 1:
            grad_ND = grad_ND.view(-1, ctx.copies, *grad_ND.shape[1:]).sum(1)
        return grad_ND, None, None, None


def gather_rows(x_MD: torch.Tensor, index_N: torch.Tensor, inverse_N: torch.Tensor, copies: int) -> torch.Tensor:
    """Autograd-aware x_MD[index_N] -> [N = M * copies, D] (see _GatherRows for inverse_N)."""
    return _GatherRows.apply(x_MD, index_N, inverse_N, copies)


class GroupedExperts(nn.Module):
    """E SwiGLU experts with stacked weights. forward(x_sorted_TD, num_tokens_per_expert_E) -> y_sorted_TD
    (see the module docstring). backend: "auto" (torch._grouped_mm on CUDA for bf16 with 8-aligned dims,
    else the loop), "grouped_mm", or "loop" (one matmul per expert: the CPU path, same math)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, n_layers: int):
        super().__init__()
        self.num_experts, self.n_layers = num_experts, n_layers
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))  # gate
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))  # up
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))  # down
        self.backend = "auto"
        for name, p in self.named_parameters():  # usable standalone; the model's init overwrites
            if not p.is_meta:
                self.init_param(name, p.data, None)

    @torch.no_grad()
    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator | None) -> None:
        swiglu_init_(full, name, self.n_layers, generator, "GroupedExperts")

    def _use_grouped_mm(self, x_TD: torch.Tensor) -> bool:
        if self.backend == "loop":
            return False
        ok = (
            hasattr(torch, "_grouped_mm")
            and x_TD.is_cuda
            and x_TD.dtype == torch.bfloat16
            and self.w1.shape[1] % 8 == 0
            and self.w1.shape[2] % 8 == 0
        )
        if self.backend == "grouped_mm":
            if not ok:
                raise RuntimeError(
                    "GroupedExperts.backend='grouped_mm' needs CUDA, bf16 activations and d_model, moe_hidden_dim "
                    "multiples of 8; use backend 'auto' or 'loop'"
                )
            return True
        if self.backend != "auto":
            raise ValueError(f"GroupedExperts.backend={self.backend!r} is unknown; use auto, grouped_mm or loop")
        return ok

    def local_weights(self, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) as plain tensors in `dtype` (None: as stored): under expert parallel they are DTensors
        sharded over ep on dim 0, and this rank computes with its own experts only (to_local keeps the gradient
        path to the DTensor)."""
        weights = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        return tuple(w if dtype is None else w.to(dtype) for w in weights)

    def prefetch_counts(self, num_tokens_per_expert_E: torch.Tensor) -> None:
        """Nothing to start: these experts read the counts on the device (see the module docstring)."""
        return None

    def forward(self, x_TD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor, prefetched=None) -> torch.Tensor:
        return self._forward_local(x_TD, num_tokens_per_expert_E)

    def _forward_local(
        self, x_TD: torch.Tensor, counts_E: torch.Tensor, counts_host: list[int] | None = None
    ) -> torch.Tensor:
        """forward with the counts also on the host when the caller knows them already (expert parallel reads
        them for its all-to-all): the loop path then needs no device -> host copy of its own."""
        if self._use_grouped_mm(x_TD):
            return self._forward_grouped_mm(x_TD, counts_E)
        return self._forward_loop(x_TD, counts_E, counts_host)

    def _forward_loop(self, x_TD, counts_E, counts_host: list[int] | None = None):
        w1, w2, w3 = self.local_weights(x_TD.dtype)
        out, start = [], 0
        for e, n in enumerate(counts_E.tolist() if counts_host is None else counts_host):
            x = x_TD[start : start + n]
            start += n
            out.append((F.silu(x @ w1[e]) * (x @ w3[e])) @ w2[e])
        if start != x_TD.shape[0]:
            raise ValueError(f"num_tokens_per_expert sums to {start}, but {x_TD.shape[0]} rows were given")
        return torch.cat(out)

    def _forward_grouped_mm(self, x_TD, counts_E):
        """Scatter the rows into groups padded to GROUP_ALIGN rows (static size, no host sync), 3 grouped GEMMs."""
        T, D = x_TD.shape
        E = counts_E.shape[0]
        counts = counts_E.to(torch.int64)
        padded_counts = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
        padded_start = padded_counts.cumsum(0) - padded_counts
        start = counts.cumsum(0) - counts
        expert_of_row = torch.repeat_interleave(torch.arange(E, device=x_TD.device), counts, output_size=T)
        dest_T = padded_start[expert_of_row] + torch.arange(T, device=x_TD.device) - start[expert_of_row]
        cap = round_up_static(T + E * (GROUP_ALIGN - 1), GROUP_ALIGN)
        # The last group absorbs the slack up to `cap` (zero rows), so no output row is left undefined.
        offs = (padded_start + padded_counts).to(torch.int32)
        offs[-1] = cap
        x_pad = x_TD.new_zeros(cap, D).index_copy(0, dest_T, x_TD)
        w1, w2, w3 = self.local_weights(torch.bfloat16)
        h = F.silu(torch._grouped_mm(x_pad, w1, offs=offs)) * torch._grouped_mm(x_pad, w3, offs=offs)
        y_pad = torch._grouped_mm(h, w2, offs=offs)
        return y_pad.index_select(0, dest_T)

    def forward_host_groups(self, x_TD: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
        """x_TD [sum(group_sizes), D] rows grouped by local expert, the groups' sizes known on the host ->
        y_TD [sum(group_sizes), D]. For the grouped GEMM (`grouped_mm_align` > 1) every group must be padded to a
        multiple of it (zero rows, dropped by the caller): the padding is then the caller's row copy, and its
        offsets one host -> device copy, instead of the ~25 small device ops of _forward_grouped_mm."""
        if not self._use_grouped_mm(x_TD):
            return self._forward_loop(x_TD, None, group_sizes)
        if any(n % GROUP_ALIGN for n in group_sizes):
            raise ValueError(f"grouped GEMM groups must be padded to multiples of {GROUP_ALIGN}: {group_sizes}")
        offs = host_to_device(list(itertools.accumulate(group_sizes)), torch.int32, x_TD.device)
        w1, w2, w3 = self.local_weights(x_TD.dtype)  # bf16 on CUDA (_use_grouped_mm); the CPU tests run fp32
        h = F.silu(torch._grouped_mm(x_TD, w1, offs=offs)) * torch._grouped_mm(x_TD, w3, offs=offs)
        return torch._grouped_mm(h, w2, offs=offs)

    def grouped_mm_align(self, x_TD: torch.Tensor) -> int:
        """Rows per group multiple that forward_host_groups needs for x_TD: GROUP_ALIGN on the grouped GEMM, else 1."""
        return GROUP_ALIGN if self._use_grouped_mm(x_TD) else 1


def host_to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on `device` without a stream sync: on CUDA through pinned memory and a
    non_blocking copy (a pageable or blocking copy waits for the stream; the caching host allocator keeps the
    pinned block until the copy has run)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def round_up_static(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class MoE(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, n_layers: int):
        super().__init__()
        self.num_experts, self.top_k = args.moe_num_experts, args.moe_top_k
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"model.moe_top_k={self.top_k} must be in [1, moe_num_experts={self.num_experts}]")
        if args.moe_score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"model.moe_score_func={args.moe_score_func!r}: use softmax or sigmoid")
        self.score_func, self.route_norm = args.moe_score_func, args.moe_route_norm
        self.load_balance_coeff = args.moe_load_balance_coeff
        self.aux_loss_coeff, self.z_loss_coeff = args.moe_aux_loss_coeff, args.moe_z_loss_coeff
        self.aux_loss_scale = 1.0
        hidden = moe_hidden_dim(args)
        self.router = nn.Linear(args.d_model, self.num_experts, bias=False)
        self.experts = GroupedExperts(args.d_model, hidden, self.num_experts, n_layers)
        self.shared_experts = (
            MLP(args, layer_id, n_layers, hidden_dim=hidden * args.moe_shared_experts)
            if args.moe_shared_experts
            else None
        )
        self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.int64), persistent=False)
        self.last_aux_loss: torch.Tensor | None = None
        self.last_z_loss: torch.Tensor | None = None

    @torch.no_grad()
    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full (unsharded) tensor of parameter `name` (relative to this module) in place."""
        if name == "router.weight":
            nn.init.normal_(full, mean=0.0, std=0.02, generator=generator)
        elif name.startswith("experts."):
            self.experts.init_param(name.removeprefix("experts."), full, generator)
        elif name.startswith("shared_experts.") and self.shared_experts is not None:
            self.shared_experts.init_param(name.removeprefix("shared_experts."), full, generator)
        else:
            raise KeyError(f"MoE.init_param: unknown parameter {name!r}")

    @torch.no_grad()
    def init_buffer(self, name: str, full: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """Buffers start at zero (after meta-device materialisation, or on a fresh run)."""
        if name not in ("expert_bias", "tokens_per_expert"):
            raise KeyError(f"MoE.init_buffer: unknown buffer {name!r}")
        full.zero_()

    @torch.no_grad()
    def update_expert_bias(self, apply: torch.Tensor | None = None) -> None:
        """After the optimizer step, with tokens_per_expert already summed over the data-parallel ranks: move the
        selection bias toward uniform load, then zero the counts. The update is centred (sum 0): top-k is
        shift-invariant, and centring keeps the bias from drifting. `apply`: a 0-d device tensor the update is
        multiplied by (0.0 for a step the optimizer skipped on the device), so that no host sync decides it."""
        if self.load_balance_coeff:
            load = self.tokens_per_expert.float()
            delta = self.load_balance_coeff * torch.sign(load.mean() - load)
            update = delta - delta.mean()
            self.expert_bias.add_(update if apply is None else update * apply.to(update.dtype))
        self.tokens_per_expert.zero_()

    def route(self, x_TD: torch.Tensor):
        """-> (logits_TE, scores_TE, idx_TK, weights_TK, counts_E int64); routing math in fp32 (fp64 for fp64 x):
        bf16 scores would tie and flip the top-k."""
        dtype = torch.float64 if x_TD.dtype == torch.float64 else torch.float32
        logits_TE = F.linear(x_TD.to(dtype), self.router.weight.to(dtype))
        scores_TE = logits_TE.softmax(-1) if self.score_func == "softmax" else logits_TE.sigmoid()
        with torch.no_grad():
            select_TE = scores_TE + self.expert_bias.to(dtype)
            idx_TK = select_TE.topk(self.top_k, dim=-1).indices
        weights_TK = scores_TE.gather(1, idx_TK)
        if self.route_norm:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        return logits_TE, scores_TE, idx_TK, weights_TK, count_experts(idx_TK, self.num_experts)

    def forward(self, x_BSD: torch.Tensor, seq_idx: torch.Tensor | None = None) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(-1, D)
        T, K = x_TD.shape[0], self.top_k
        logits_TE, scores_TE, idx_TK, weights_TK, counts_E = self.route(x_TD)
        if self.training and not _in_recomputation():
            self.tokens_per_expert.add_(counts_E)

        # Expert parallel starts the counts' exchange and host copy here; what follows up to self.experts needs no
        # count, so the device has it queued while the host waits for that copy (no idle device meanwhile).
        prefetched = self.experts.prefetch_counts(counts_E)
        shared_TD = self.shared_experts(x_TD) if self.shared_experts is not None else None
        perm = idx_TK.flatten().argsort(stable=True)  # [T*K] token copies sorted by expert
        inv_perm = torch.empty_like(perm).scatter_(0, perm, torch.arange(T * K, device=perm.device))
        x_sorted_TD = gather_rows(x_TD, perm // K, inv_perm, K)  # [T, D] -> [T*K, D]
        y_sorted_TD = self.experts(x_sorted_TD, counts_E, prefetched)
        y_TKD = gather_rows(y_sorted_TD, inv_perm, perm, 1).view(T, K, D)  # back to token order
        out_TD = torch.bmm(weights_TK.to(y_TKD.dtype)[:, None, :], y_TKD).squeeze(1)
        if shared_TD is not None:
            out_TD = out_TD + shared_TD

        if self.training and torch.is_grad_enabled() and (self.aux_loss_coeff or self.z_loss_coeff) and T:
            aux = self._aux_losses(logits_TE, scores_TE, counts_E, T)
            out_TD = AttachAuxLoss.apply(out_TD, aux * self.aux_loss_scale)
        return out_TD.view(B, S, D)

    def _aux_losses(self, logits_TE, scores_TE, counts_E, T) -> torch.Tensor:
        """coeff-weighted sum of the Switch balance loss E * sum_e f_e * P_e (f_e: fraction of the T*K routed
        copies sent to e, no gradient; P_e: mean routing probability; 1 when uniform) and the z-loss
        mean_t logsumexp(logits_t)^2. Local to this rank's tokens (as in Switch / ST-MoE)."""
        total = logits_TE.new_zeros(())
        if self.aux_loss_coeff:
            probs_TE = scores_TE if self.score_func == "softmax" else scores_TE / scores_TE.sum(-1, keepdim=True)
            f_E = counts_E.to(probs_TE.dtype) / (T * self.top_k)
            balance = self.num_experts * (f_E * probs_TE.mean(0)).sum()
            self.last_aux_loss = balance.detach()
            total = total + self.aux_loss_coeff * balance
        if self.z_loss_coeff:
            z = logits_TE.logsumexp(-1).square().mean()
            self.last_z_loss = z.detach()
            total = total + self.z_loss_coeff * z
        return total
