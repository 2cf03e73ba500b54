"""The autograd Functions of the Mamba-2 mixer's context-parallel (CP) path (parallelisms/context_parallel.py).

Each replaces a chain of small autograd nodes with one, because the CP step at 1.3B / 32k tokens is host-bound: every
aten op, autograd node and Python call per layer is paid three times per step (forward, its recompute under full
activation checkpointing, backward). The GPU work stays the same or shrinks.

- _InProjSeqToHeads: in_proj + the all-to-all to the heads layout, the all-to-all overlapped by the z half of the
  product, both ways (the backward's inverse all-to-all runs while z's gradients are multiplied). It replaces the
  rows' index_select, two parameter slices, F.linear, the functional collective (its AsyncCollectiveTensor dispatches
  in Python) and its wait, and the gradient's per-slice zeros + copy + add.
- _LocalParams: this rank's slices of conv1d.weight / conv1d.bias / dt_bias / A_log / D as one gather, A = -exp(A_log)
  included; the backward scatters the five gradients into one zero buffer (instead of 11 slice nodes, each a zeros
  and a copy, two cats and the exp / neg / cast nodes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.kernels.weight_copies import compute_weight

__all__ = ["in_proj_seq_to_heads", "local_params"]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a product on `t` runs in: autocast's where it is on (as F.linear would), else t's own."""
    device_type = t.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else t.dtype


def _mm_into(a_MK: torch.Tensor, b_KN: torch.Tensor, out_MN: torch.Tensor) -> torch.Tensor:
    """out = a @ b, written in place (out may be a row block of a larger buffer: no copy). A float32 out from 16-bit
    operands comes from cuBLAS in float32 on CUDA (mm's out_dtype, as models.kernels.autocast_linear.weight_grad);
    elsewhere the product is cast."""
    if out_MN.dtype == a_MK.dtype:
        return torch.mm(a_MK, b_KN, out=out_MN)
    if a_MK.is_cuda:
        return torch.mm(a_MK, b_KN, out_dtype=out_MN.dtype, out=out_MN)
    return out_MN.copy_(a_MK @ b_KN)


def row_blocks_mm(u_TD: torch.Tensor, W_KdD: torch.Tensor, bias_Kd: torch.Tensor | None) -> torch.Tensor:
    """u [T, D] @ W [K, d, D]^T (+ bias [K, d]) -> [K, T, d], each block contiguous (the all-to-all's send order). One
    product per block written in place (torch.mm's out=, the transposes as cuBLAS flags): no copy of the activations.
    (torch.matmul of [T, D] by [K, D, d], tried first, added six copy kernels per layer and step on the GPU at 32k
    tokens, ~0.35 ms each: the broadcast u and the transposed gradient are made contiguous for the batched product.)"""
    K, d, _ = W_KdD.shape
    out_KTd = u_TD.new_empty(K, u_TD.shape[0], d)
    for k in range(K):
        if bias_Kd is None:
            torch.mm(u_TD, W_KdD[k].t(), out=out_KTd[k])
        else:
            torch.addmm(bias_Kd[k], u_TD, W_KdD[k].t(), out=out_KTd[k])
    return out_KTd


def _row_blocks_grad_input(grad_KTd: torch.Tensor, W_KdD: torch.Tensor, grad_TD: torch.Tensor | None) -> torch.Tensor:
    """sum_k grad[k] @ W[k] [T, D], accumulated in place into grad_TD (a new tensor when None)."""
    start = 0
    if grad_TD is None:
        grad_TD, start = torch.mm(grad_KTd[0], W_KdD[0]), 1
    for k in range(start, W_KdD.shape[0]):
        grad_TD.addmm_(grad_KTd[k], W_KdD[k])
    return grad_TD


# ----------------------------------------------------------------------------------------------------
# in_proj + all-to-all (sequence-sharded -> heads), overlapped both ways
# ----------------------------------------------------------------------------------------------------


class _InProjSeqToHeads(torch.autograd.Function):
    """See in_proj_seq_to_heads. Saves u (in the compute dtype), the cast weight and its gathered x B C dt rows."""

    @staticmethod
    def forward(ctx, u_BSD, W_FD, bias_F, rows, zdim, unique_rows, group, overlap):
        b, s_local, D = u_BSD.shape
        cp = group.size()
        dtype = _compute_dtype(u_BSD)
        with torch.autocast(u_BSD.device.type, enabled=False):  # out= products: the dtypes are set here
            u_TD = u_BSD.reshape(b * s_local, D).to(dtype)
            W_c = compute_weight(W_FD, dtype)  # the weight's bf16 copy where one is kept, else one cast
            W_KdD = W_c[zdim:].index_select(0, rows).view(cp, -1, D)  # x B C dt rows in send order
            bias_c = None if bias_F is None else bias_F.detach().to(dtype)
            bias_Kd = None if bias_c is None else bias_c[zdim:].index_select(0, rows).view(cp, -1)
            # [T, D] -> send [cp, T, d]: send[k] = channel slice k (rank k's heads) of our tokens
            send_KTd = row_blocks_mm(u_TD, W_KdD, bias_Kd)
            recv_KTd = torch.empty_like(send_KTd)
            work = dist.all_to_all_single(recv_KTd, send_KTd, group=group, async_op=True)
            if not overlap:
                work.wait()
            # while it runs (overlap): the z rows, about half of in_proj's FLOPs
            Wz_ED = W_c[:zdim]
            z_TE = torch.mm(u_TD, Wz_ED.t()) if bias_c is None else torch.addmm(bias_c[:zdim], u_TD, Wz_ED.t())
            if overlap:
                work.wait()  # on CUDA the stream waits, not the host
        ctx.save_for_backward(u_TD, W_c, W_KdD)
        # rows: a constant of the hook (its cache), so not a saved tensor (no activation-checkpoint hooks for it)
        ctx.rows, ctx.zdim, ctx.unique_rows, ctx.group, ctx.shape = rows, zdim, unique_rows, group, (b, s_local, D)
        ctx.overlap = overlap
        ctx.dtypes = (u_BSD.dtype, W_FD.dtype, None if bias_F is None else bias_F.dtype)
        d = send_KTd.shape[-1]
        # recv[j] = rank j's tokens (sequence block j) of our slice -> [b, s, d] (a view when b == 1)
        xBCdt_BSd = recv_KTd.view(cp, b, s_local, d).permute(1, 0, 2, 3).reshape(b, cp * s_local, d)
        return z_TE.view(b, s_local, zdim), xBCdt_BSd

    @staticmethod
    def backward(ctx, grad_z_BSE, grad_xBCdt_BSd):
        u_TD, W_c, W_KdD = ctx.saved_tensors
        rows = ctx.rows
        b, s_local, D = ctx.shape
        zdim, (u_dtype, W_dtype, bias_dtype) = ctx.zdim, ctx.dtypes
        need_u, need_W, need_bias = ctx.needs_input_grad[:3]
        cp, d, _ = W_KdD.shape
        T = b * s_local
        # [b, s, d] -> send [cp, T, d]: send[j] = the gradient of rank j's tokens (no copy when b == 1)
        g_send_KTd = grad_xBCdt_BSd.to(u_TD.dtype).reshape(b, cp, s_local, d).transpose(0, 1).contiguous()
        g_send_KTd = g_send_KTd.view(cp, T, d)
        g_recv_KTd = torch.empty_like(g_send_KTd)  # [k] = the gradient of the send block k (rank k's heads)
        work = dist.all_to_all_single(g_recv_KTd, g_send_KTd, group=ctx.group, async_op=True)
        if not ctx.overlap:
            work.wait()
        # while it runs (overlap): z's gradients, straight into their rows of the full weight gradient
        gz_TE = grad_z_BSE.reshape(T, zdim).to(u_TD.dtype)
        grad_u = torch.mm(gz_TE, W_c[:zdim]) if need_u else None
        grad_W = grad_bias = None
        if need_W:
            grad_W = torch.empty(W_c.shape, dtype=W_dtype, device=W_c.device)
            _mm_into(gz_TE.t(), u_TD, grad_W[:zdim])
        if need_bias:
            grad_bias = torch.empty(W_c.shape[0], dtype=bias_dtype, device=W_c.device)
            grad_bias[:zdim] = gz_TE.sum(0)
        if ctx.overlap:
            work.wait()
        if need_u:
            grad_u = _row_blocks_grad_input(g_recv_KTd, W_KdD, grad_u).view(b, s_local, D).to(u_dtype)
        if need_W:
            dW_KdD = torch.empty(W_KdD.shape, dtype=W_dtype, device=W_c.device)
            for k in range(cp):
                _mm_into(g_recv_KTd[k].t(), u_TD, dW_KdD[k])  # [d, T] @ [T, D]
            _scatter_rows(grad_W[zdim:], rows, dW_KdD.view(cp * d, D), ctx.unique_rows)
        if need_bias:
            _scatter_rows(grad_bias[zdim:], rows, g_recv_KTd.sum(1).view(-1).to(bias_dtype), ctx.unique_rows)
        return grad_u, grad_W, grad_bias, None, None, None, None, None


def _scatter_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, unique: bool) -> None:
    """dst[rows[i]] = src[i] (+= over the repeats of a row: replicated B / C rows get every replica's gradient). Every
    row of dst is in rows."""
    if unique:
        dst.index_copy_(0, rows, src)
    else:
        dst.zero_().index_add_(0, rows, src)


def in_proj_seq_to_heads(
    u_BSD: torch.Tensor,
    weight_FD: torch.Tensor,
    bias_F: torch.Tensor | None,
    rows: torch.Tensor,
    zdim: int,
    unique_rows: bool,
    group,
    overlap: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj (weight [F, D] = [z (zdim) | x B C dt] rows) and the all-to-all of its x B C dt part, one autograd node.

    Before: u [b, s/cp, D], this rank's tokens.
    After:  z [b, s/cp, zdim], this rank's tokens; xBCdt [b, s, d], every rank's tokens in rank order, this rank's
            channel slice d = rows.numel() / cp.
    rows [cp * d] int64: in_proj's x B C dt rows (0 = the first after z) in send order, rows[k*d:(k+1)*d] for rank k
    (unique_rows: no row repeats). The x B C dt rows are multiplied straight into the send buffer [cp, b*s/cp, d], the
    all-to-all is started, the z rows are multiplied while it runs. The backward mirrors it: the inverse all-to-all
    of xBCdt's gradient runs while z's gradients are multiplied. Under autocast the products run in its dtype; a
    float32 weight's gradient is written in float32 (into one full-size buffer: z's rows by their product in place,
    the x B C dt rows by one scatter). The same values as in_proj(u) split in two. overlap False: each all-to-all
    is waited for at once (the same values, for measuring what the overlap gains)."""
    return _InProjSeqToHeads.apply(u_BSD, weight_FD, bias_F, rows, zdim, unique_rows, group, overlap)


# ----------------------------------------------------------------------------------------------------
# This rank's parameter slices, one gather
# ----------------------------------------------------------------------------------------------------


class _LocalParams(torch.autograd.Function):
    """(conv_w, conv_b, dt_bias, A_log, D) full -> this rank's (conv_w [C, W], conv_b [C], dt_bias [H], A [H] float32
    = -exp(A_log), D (d_shape)), by one index_select of their concatenation. conv_b may be None."""

    @staticmethod
    def forward(ctx, index, local_sizes, conv_w_shape, d_shape, conv_w, conv_b, dt_bias, A_log, D):
        params = [p for p in (conv_w, conv_b, dt_bias, A_log, D) if p is not None]
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        parts = list(flat.index_select(0, index).split(local_sizes))
        if conv_b is None:
            parts.insert(1, None)
        w, b, dt_bias_l, A_log_l, D_l = parts
        A = -torch.exp(A_log_l.float())
        ctx.save_for_backward(A)
        ctx.index = index  # a constant of the hook (its cache): no activation-checkpoint hooks for it
        ctx.full_sizes = [p.numel() for p in params]
        ctx.full_shapes = [p.shape for p in params]
        ctx.has_bias, ctx.dtype = conv_b is not None, flat.dtype
        return w.view(conv_w_shape), b, dt_bias_l, A, D_l.view(d_shape)

    @staticmethod
    def backward(ctx, g_w, g_b, g_dt_bias, g_A, g_D):
        (A,) = ctx.saved_tensors
        index = ctx.index
        g_A_log = g_A * A  # d(-exp(a))/da = -exp(a) = A
        grads = [g_w, g_b, g_dt_bias, g_A_log, g_D] if ctx.has_bias else [g_w, g_dt_bias, g_A_log, g_D]
        g_local = torch.cat([g.reshape(-1).to(ctx.dtype) for g in grads])
        full = g_local.new_zeros(sum(ctx.full_sizes)).index_copy_(0, index, g_local)
        # views of one buffer: AccumulateGrad keeps them as the .grad (no copy) where it can
        out = [g.view(shape) for g, shape in zip(full.split(ctx.full_sizes), ctx.full_shapes)]
        if not ctx.has_bias:
            out.insert(1, None)
        return (None, None, None, None, *out)


def local_params(index, local_sizes, conv_w_shape, d_shape, conv_w, conv_b, dt_bias, A_log, D):
    """This rank's parameter slices as one autograd node (see _LocalParams). index [sum(local_sizes)] int64: the
    positions of the local values in the flattened, concatenated full parameters (conv_b left out when None)."""
    return _LocalParams.apply(index, local_sizes, conv_w_shape, d_shape, conv_w, conv_b, dt_bias, A_log, D)
