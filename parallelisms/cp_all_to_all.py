"""The all-to-alls of context parallel (parallelisms/context_parallel.py): sequence-sharded <-> head-sharded, each
the other's backward. Tensors are batch-first; every function states its shapes before and after.

    [b, s/cp, D]  this rank's tokens, every channel      --all_to_all_seq_to_heads-->  [b, s, D/cp]  every token, this
    [b, s, d]     every token, this rank's channel slice --all_to_all_heads_to_seq-->  [b, s/cp, d*cp]  rank's slice
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "group_rank",
    "group_size",
    "all_to_all_seq_to_heads",
    "all_to_all_seq_to_heads_packed",
    "all_to_all_heads_to_seq",
    "all_to_all_heads_to_seq_blocks",
]


def group_size(group) -> int:
    return 1 if group is None else group.size()


def group_rank(group) -> int:
    return 0 if group is None else group.rank()


# ----------------------------------------------------------------------------------------------------
# All-to-alls (each one is the other's backward)
# ----------------------------------------------------------------------------------------------------


def _seq_to_heads_send(send_KBSd: torch.Tensor, group) -> torch.Tensor:
    """send [cp, b, s/cp, d] (send[k] = channel slice k, for rank k) -> [b, s, d]: every rank's tokens of our slice."""
    cp, b, s_local, d = send_KBSd.shape
    recv_KBSd = torch.empty_like(send_KBSd)
    dist.all_to_all_single(recv_KBSd, send_KBSd, group=group)
    # recv[j] = rank j's tokens (sequence block j), our channel slice (a view when b == 1)
    return recv_KBSd.permute(1, 0, 2, 3).reshape(b, cp * s_local, d)


def _send_layout(x_BSD: torch.Tensor, cp: int) -> torch.Tensor:
    """[b, s/cp, D] -> [cp, b, s/cp, D/cp], contiguous: channel slice k first, the all-to-all's send order."""
    b, s_local, D = x_BSD.shape
    return x_BSD.reshape(b, s_local, cp, D // cp).permute(2, 0, 1, 3).contiguous()


def _exchange_sequence_blocks(x_BSd: torch.Tensor, group) -> torch.Tensor:
    """[b, s, d] -> [cp, b, s/cp, d]: sequence block k of x goes to rank k; block j of the result is what rank j sent
    (its channel slice of our tokens in the forward of heads_to_seq; the gradient of the channel slice we sent to
    rank j in the backward of seq_to_heads)."""
    cp = group_size(group)
    b, s, d = x_BSd.shape
    send_KBSd = x_BSd.reshape(b, cp, s // cp, d).transpose(0, 1).contiguous()  # no copy when b == 1
    recv_KBSd = torch.empty_like(send_KBSd)
    dist.all_to_all_single(recv_KBSd, send_KBSd, group=group)
    return recv_KBSd


def _heads_to_seq(x_BSd: torch.Tensor, group) -> torch.Tensor:
    recv_KBSd = _exchange_sequence_blocks(x_BSd, group)
    cp, b, s_local, d = recv_KBSd.shape
    # recv[j] = our tokens, rank j's channel slice
    return recv_KBSd.permute(1, 2, 0, 3).reshape(b, s_local, cp * d)


class _SeqToHeads(torch.autograd.Function):
    """Input in the send layout [cp, b, s/cp, d] (so that the caller can pack it with the one copy it needs)."""

    @staticmethod
    def forward(ctx, send_KBSd, group):
        ctx.group = group
        return _seq_to_heads_send(send_KBSd, group)

    @staticmethod
    def backward(ctx, grad_BSd):
        return _exchange_sequence_blocks(grad_BSd.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_BSd, group):
        ctx.group = group
        return _heads_to_seq(x_BSd, group)

    @staticmethod
    def backward(ctx, grad_BSD):
        cp = group_size(ctx.group)
        return _seq_to_heads_send(_send_layout(grad_BSD, cp), ctx.group), None


class _HeadsToSeqBlocks(torch.autograd.Function):
    """all_to_all_heads_to_seq's receive buffer as it comes: [cp, b * s/cp, d]; its gradient in that layout is the
    inverse all-to-all's send buffer."""

    @staticmethod
    def forward(ctx, x_BSd, group):
        recv_KBSd = _exchange_sequence_blocks(x_BSd, group)
        cp, b, s_local, d = recv_KBSd.shape
        ctx.group, ctx.shape = group, recv_KBSd.shape
        return recv_KBSd.view(cp, b * s_local, d)

    @staticmethod
    def backward(ctx, grad_KTd):
        return _seq_to_heads_send(grad_KTd.contiguous().view(ctx.shape), ctx.group), None


def all_to_all_seq_to_heads(x_BSD_local: torch.Tensor, group) -> torch.Tensor:
    """Sequence-sharded -> channel-sharded, over the CP group (autograd: backward is heads_to_seq).

    Before: [b, s/cp, D], this rank's tokens (rank j holds sequence block j), all D channels.
    After:  [b, s, D/cp], all ranks' tokens concatenated in rank order, channels [r*D/cp, (r+1)*D/cp)
            of this rank r. D must divide by cp. With cp = 1 (or group None) it is the identity.
    """
    cp = group_size(group)
    if cp == 1:
        return x_BSD_local
    if x_BSD_local.dim() != 3 or x_BSD_local.shape[-1] % cp:
        raise ValueError(
            f"all_to_all_seq_to_heads expects [b, s/cp, D] with D divisible by cp={cp}; got {tuple(x_BSD_local.shape)}"
        )
    return _SeqToHeads.apply(_send_layout(x_BSD_local, cp), group)


def all_to_all_seq_to_heads_packed(send_KBSd: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_seq_to_heads for an input the caller already laid out in send order (one copy fewer).

    Before: [cp, b, s/cp, d], send[k] = channel slice k of this rank's tokens (destined for rank k), contiguous.
    After:  [b, s, d], all ranks' tokens in rank order, this rank's channel slice. Autograd: the gradient comes
            back in the same [cp, b, s/cp, d] layout.
    """
    cp = group_size(group)
    if cp == 1:
        return send_KBSd[0]
    if send_KBSd.dim() != 4 or send_KBSd.shape[0] != cp or not send_KBSd.is_contiguous():
        raise ValueError(
            f"all_to_all_seq_to_heads_packed expects a contiguous [cp={cp}, b, s/cp, d]; got {tuple(send_KBSd.shape)}"
        )
    return _SeqToHeads.apply(send_KBSd, group)


def all_to_all_heads_to_seq(x_BSd: torch.Tensor, group) -> torch.Tensor:
    """Channel-sharded -> sequence-sharded, over the CP group (autograd: backward is seq_to_heads).

    Before: [b, s, d], the whole sequence (blocks in rank order), this rank's channel slice.
    After:  [b, s/cp, d*cp], this rank's sequence block r, all ranks' channel slices concatenated in
            rank order. s must divide by cp. With cp = 1 (or group None) it is the identity.
    """
    cp = group_size(group)
    if cp == 1:
        return x_BSd
    if x_BSd.dim() != 3 or x_BSd.shape[1] % cp:
        raise ValueError(
            f"all_to_all_heads_to_seq expects [b, s, d] with s divisible by cp={cp}; got {tuple(x_BSd.shape)}"
        )
    return _HeadsToSeq.apply(x_BSd, group)


def all_to_all_heads_to_seq_blocks(x_BSd: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_heads_to_seq without its last copy: the channels stay in one block per rank.

    Before: [b, s, d], the whole sequence (blocks in rank order), this rank's channel slice.
    After:  [cp, b * s/cp, d]: block j holds rank j's channel slice of this rank's tokens (all_to_all_heads_to_seq's
            [b, s/cp, d*cp] is its permute(1, 0, 2), assembled by a copy). For a consumer that reads the blocks where
            they lie (ops.rmsnorm_gated_blocks); the gradient it gives back in this layout goes out with no copy.
    """
    cp = group_size(group)
    b, s, d = x_BSd.shape
    if cp == 1:
        return x_BSd.reshape(1, b * s, d)
    if x_BSd.dim() != 3 or s % cp:
        raise ValueError(
            f"all_to_all_heads_to_seq_blocks expects [b, s, d] with s divisible by cp={cp}; got {tuple(x_BSd.shape)}"
        )
    return _HeadsToSeqBlocks.apply(x_BSd, group)
